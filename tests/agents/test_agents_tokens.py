"""The token view of an episode: the whole conversation as the chat template renders it, the mask 1 exactly on
what the model wrote (each assistant message's content and its end token), with rlhfuse's Tokenizer and with a
transformers tokenizer loaded from the folder it saves; templates that re-render earlier turns are refused."""

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from rlhfuse.agents import ToolRunner, episode_tokens, run_episode
from rlhfuse.data import Tokenizer
from rlhfuse.data.tokenizer import ChatTemplateError

# Qwen2.5's layout in brief: tool schemas in a system turn, consecutive tool answers in one user turn.
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


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def byte_tokenizer(template=TEMPLATE):
    """A byte-level tokenizer (every text round-trips) with Qwen's special tokens and `template`."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    ids = {t: backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
    return Tokenizer(
        backend, pad_id=ids["<|endoftext|>"], bos_id=None, eos_id=ids["<|im_end|>"], chat_template=template
    )


class Quiz:
    """Done on the answer 5; anything else is told wrong."""

    def reset(self, row):
        return [{"role": "user", "content": "Use the tools if you like."}]

    def step(self, message):
        done = message["content"] == "5"
        return ([] if done else [{"role": "user", "content": "Wrong — try again."}]), float(done), done


def played(*replies, tools=(add,)):
    replies = iter(replies)
    runner = ToolRunner(list(tools), timeout_s=10) if tools else None
    prompt = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2 + 3 = ?"}]
    return run_episode(Quiz(), {}, prompt, lambda _: next(replies), max_turns=6, tools_runner=runner)


def spans(mask):
    """(start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
REPLIES = ("I will add.\n" + CALL + "\n" + CALL, "Peut-être 6 ?", "5")


def check_mask(ids, mask, episode, decode, end_id):
    """The masked runs decode to the assistant messages, each ending with the end token; nothing else is 1."""
    assistant = [m["content"] for m, t in zip(episode.messages, episode.trainable) if t]
    runs = spans(mask)
    assert [decode(ids[a:b]) for a, b in runs] == assistant
    assert all(
        ids[b - 1] == end_id and not mask[b] for a, b in runs[:-1]
    )  # the newline after it is the template's
    assert sum(mask) == sum(b - a for a, b in runs) and len(mask) == len(ids)


def test_mask_covers_exactly_the_assistant_tokens_with_rlhfuse_tokenizer():
    tok = byte_tokenizer()
    episode = played(*REPLIES, tools=())
    assert episode.ended == "done" and episode.turns == 3
    ids, mask = episode_tokens(tok, episode)
    assert ids == tok.encode_chat(episode.messages, add_generation_prompt=False)
    check_mask(ids, mask, episode, tok.decode, tok.eos_id)
    # the generation prompt before each answer is not the model's
    header = tok.encode("<|im_start|>assistant\n", add_bos=False)
    for a, _ in spans(mask):
        assert ids[a - len(header) : a] == header


def test_tools_reach_a_transformers_template_and_the_mask_stays_exact(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = byte_tokenizer()
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    episode = played(*REPLIES)
    assert (episode.tool_calls, episode.tool_errors) == (2, 0)
    ids, mask = episode_tokens(hf, episode, [add])
    text = hf.decode(ids)
    assert '"name": "add"' in text.split("<|im_end|>")[0]  # the schema, in the system turn
    assert text.count("<tool_response>\n5\n</tool_response>") == 2
    check_mask(ids, mask, episode, lambda x: hf.decode(x, skip_special_tokens=True), hf.eos_token_id)
    expected = hf.apply_chat_template(episode.messages, tools=[add], tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected)  # the same as transformers' own rendering
    # rlhfuse's own tokenizer passes the schemas to the same template: the same ids
    assert episode_tokens(tok, episode, [add]) == (ids, mask)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # drops earlier assistant turns' reasoning (as Qwen3's template does): a prefix render is not a prefix
    rewriting = TEMPLATE.replace(
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content",
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content.split('</think>')[-1] if "
        "m.role == 'assistant' and not loop.last else m.content)",
    )
    assert rewriting != TEMPLATE
    episode = played("<think>hmm</think>6", "5", tools=())
    with pytest.raises(ChatTemplateError, match=r"renders messages\[:4\] as something else than the start"):
        episode_tokens(byte_tokenizer(rewriting), episode)
    assert json.dumps(episode_tokens(byte_tokenizer(), episode))  # the plain template is fine
