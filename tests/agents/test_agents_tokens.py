"""The token view of an episode: the whole conversation as the chat template renders it, the mask 1 exactly on
what the model wrote (each assistant message's content and its end token), with rlhfuse's Tokenizer and with a
transformers tokenizer loaded from the folder it saves; templates that re-render earlier turns are refused."""

import json

import pytest

from rlhfuse.agents import ToolRunner, episode_tokens, run_episode
from rlhfuse.data.tokenizer import ChatTemplateError
from rlhfuse.testing.chat import TEMPLATE, byte_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


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
