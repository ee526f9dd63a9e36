"""A chat tokenizer for tests and benchmarks of multi-turn episodes (`rlhfuse.agents`): byte-level (every text
round-trips, no vocabulary to download) with Qwen2.5's special tokens and a chat template in Qwen2.5's layout
(tool schemas in a system turn, consecutive tool answers in one user turn)."""

from __future__ import annotations

from rlhfuse.data import Tokenizer

TEMPLATE = r"""
{%- if tools %}{{- '<|im_start|>system\nTools:\n' }}{%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}
{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def byte_tokenizer(template: str = TEMPLATE) -> Tokenizer:
    """A byte-level tokenizer (259 ids: the 256 bytes, then <|endoftext|> = pad, <|im_start|>, <|im_end|> = end of
    a message) with `template`."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    pad, end = (backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>"))
    assert pad is not None and end is not None
    return Tokenizer(backend, pad_id=pad, bos_id=None, eos_id=end, chat_template=template)
