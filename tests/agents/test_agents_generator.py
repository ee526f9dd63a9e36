"""`AgentGenerator` over a scripted model: episodes advance turn by turn, tools that raise, time out or are called
malformed become observations and the episode goes on, the answers' tokens are exactly the template's, and the
Rollout marks the model's tokens only (issue 43).

The model here is scripted (each call returns the next reply of a list, as token ids ending with the end token):
what is tested is the loop around a generator; `tests/trainer/test_trainer_agents.py` runs it over the real one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import ClassVar

import torch

from rlhfuse.agents.generator import AgentGenerator
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.sampling_config import SamplingConfig
from rlhfuse.core.stats import episode_metrics
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.data.collate import left_padded
from rlhfuse.data.prompts import Prompt
from rlhfuse.testing.chat import TEMPLATE, byte_tokenizer

RELEASE = threading.Event()  # never set: the stuck tool waits past its timeout


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError(f"no luck with {x}")


def stuck(x: int) -> int:
    """Never answers in time.

    Args:
        x: anything
    """
    RELEASE.wait(30)
    return x


class Calculator:
    """Right when the answer is 12 (reward 1, done); otherwise told to try again (reward 0)."""

    tools: ClassVar = [add, explode, stuck]

    def reset(self, row):
        return [{"role": "system", "content": f"Target: {row['answer']}"}]

    def step(self, message):
        done = message["content"].strip() == "12"
        return ([] if done else [{"role": "user", "content": "Try again."}]), float(done), done


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class Scripted:
    """A Generator replying with `replies[turn]` to every episode of a turn (sampler log-probs -0.5 each)."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.turn, self.seen = tokenizer, replies, 0, []

    def generate(self, prompts: PromptBatch, *, iteration: int, sampling=None) -> Iterator[Rollout]:
        assert sampling is not None and sampling.samples_per_prompt == 1
        self.seen.append(prompts)
        ids = [*self.tokenizer.encode(self.replies[self.turn], add_bos=False), self.tokenizer.eos_id]
        self.turn += 1
        b = len(prompts)
        yield Rollout(
            prompt_ids_BP=prompts.input_ids_BP,
            prompt_mask_BP=prompts.attention_mask_BP,
            response_ids_BR=torch.tensor([ids] * b),
            response_mask_BR=torch.ones(b, len(ids), dtype=torch.long),
            prompt_index_B=prompts.prompt_ids_B,
            sample_index_B=torch.zeros(b, dtype=torch.long),
            finished_B=torch.ones(b, dtype=torch.bool),
            sampler_logprobs_BR=torch.full((b, len(ids)), -0.5),
        )

    def generation_stats(self):
        return None


def test_tools_and_their_failures_are_observations_and_only_the_models_tokens_are_trained() -> None:
    tok = byte_tokenizer(TEMPLATE)
    prompt = [{"role": "user", "content": "What is 7 + 5?"}]
    text = tok.render_chat(prompt)
    prompts = {3: Prompt(3, text, tuple(tok.encode(text, add_bos=False)), {"answer": "12"}, tuple(prompt))}
    replies = [
        call("add", a=7, b=4) + call("explode", x=1),  # a result and a raising tool
        call("stuck", x=2)
        + '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',  # timeout, malformed
        "11",  # wrong: the environment answers
        "12",  # right: done
    ]
    model = Scripted(tok, replies)
    agent = AgentGenerator(
        model, Calculator, tok, prompts, sampling=SamplingConfig(), samples_per_prompt=2, max_turns=6,
        tool_timeout_s=0.5,
    )  # fmt: skip
    batch = PromptBatch(
        torch.tensor([prompts[3].token_ids]), torch.ones(1, len(text), dtype=torch.long), torch.tensor([3])
    )
    (rollout,) = list(agent.generate(batch, iteration=1))
    assert model.turn == 4 and [len(p) for p in model.seen] == [2, 2, 2, 2]  # both samples, four turns
    assert rollout.prompt_index_B.tolist() == [3, 3] and rollout.sample_index_B.tolist() == [0, 1]
    assert rollout.env_reward_B.tolist() == [1.0, 1.0] and rollout.finished_B.all()
    row = rollout.response_ids_BR[0][rollout.response_mask_BR[0].bool()].tolist()
    train = rollout.trainable_mask_BR[0][rollout.response_mask_BR[0].bool()].bool().tolist()
    # the model's runs are exactly its four replies, each with its end token
    runs, start = [], None
    for k, flag in enumerate([*train, False]):
        if flag and start is None:
            start = k
        elif not flag and start is not None:
            runs.append(row[start:k])
            start = None
    assert [tok.decode(r) for r in runs] == replies
    assert (rollout.sampler_logprobs_BR[0][rollout.trainable_mask_BR[0].bool()] == -0.5).all()
    # the answers between them: the tools' results and errors, then the environment's reply
    answers = tok.decode([t for t, f in zip(row, train, strict=True) if not f], skip_special=False)
    assert "<tool_response>\n11\n</tool_response>" in answers and "no luck with 1" in answers
    assert "error: stuck did not finish within 0.5 s" in answers and "are a list, not an object" in answers
    assert answers.count("<tool_response>") == 4 and "Try again." in answers
    # the whole conversation is what the template renders for it (prompt, tools, opening, every turn)
    whole = rollout.prompt_ids_BP[0][rollout.prompt_mask_BP[0].bool()].tolist() + row
    assert tok.decode(whole, skip_special=False).startswith("<|im_start|>system\nTools:\n")
    assert "Target: 12" in tok.decode(whole, skip_special=False)
    # each turn's prompt was the conversation so far
    assert (
        model.seen[3].input_ids_BP[0][model.seen[3].attention_mask_BP[0].bool()].tolist()
        == whole[: len(whole) - len(runs[-1])]
    )
    # what each episode did: 4 turns, 4 tool calls of which 3 errors, at least the stuck tool's timeout waited
    turns, calls, errors, seconds, truncated = rollout.episodes_BE.T
    assert turns.tolist() == [4, 4] and calls.tolist() == [4, 4] and errors.tolist() == [3, 3]
    assert (seconds >= 0.5).all() and not truncated.any()
    metrics = episode_metrics(rollout)
    model_tokens = rollout.trainable_mask_BR.sum(dim=1).float().mean()
    assert metrics["agent/turns_mean"] == 4 and metrics["agent/tool_errors"] == 3
    assert metrics["agent/model_tokens"] == float(model_tokens)
    assert metrics["agent/env_tokens"] == float(
        rollout.response_mask_BR.sum(dim=1).float().mean() - model_tokens
    )


def test_a_held_out_call_samples_its_own_count_and_a_cut_message_ends_the_episode() -> None:
    tok = byte_tokenizer(TEMPLATE)
    prompt = [{"role": "user", "content": "What is 7 + 5?"}]
    text = tok.render_chat(prompt)
    prompts = {0: Prompt(0, text, tuple(tok.encode(text, add_bos=False)), {"answer": "12"}, tuple(prompt))}

    class Cut(Scripted):
        def generate(self, prompts, *, iteration, sampling=None):
            for chunk in super().generate(prompts, iteration=iteration, sampling=sampling):
                yield Rollout(**{**chunk.__dict__, "finished_B": torch.zeros(len(chunk), dtype=torch.bool)})

    model = Cut(tok, ["1"])
    agent = AgentGenerator(model, Calculator, tok, prompts, sampling=SamplingConfig(), samples_per_prompt=2)
    batch = PromptBatch(
        torch.tensor([prompts[0].token_ids]), torch.ones(1, len(text), dtype=torch.long), torch.tensor([0])
    )
    (rollout,) = list(agent.generate(batch, iteration=1, sampling=Sampling(SamplingConfig(), 3)))
    assert len(rollout) == 3 and model.turn == 1  # cut at the token limit: no answer, no second turn
    assert not rollout.finished_B.any() and rollout.env_reward_B.tolist() == [0.0] * 3


def test_an_episode_whose_next_turn_could_pass_the_token_bound_ends_truncated() -> None:
    tok = byte_tokenizer(TEMPLATE)
    prompt = [{"role": "user", "content": "What is 7 + 5?"}]
    text = tok.render_chat(prompt)
    prompts = {0: Prompt(0, text, tuple(tok.encode(text, add_bos=False)), {"answer": "12"}, tuple(prompt))}
    batch = PromptBatch(
        torch.tensor([prompts[0].token_ids]), torch.ones(1, len(text), dtype=torch.long), torch.tensor([0])
    )
    sampling = SamplingConfig(max_new_tokens=8)

    def played(bound: int) -> Rollout:
        agent = AgentGenerator(
            Scripted(tok, ["11", "10", "12"]), Calculator, tok, prompts, sampling=sampling, samples_per_prompt=1,
            max_response_tokens=bound,
        )  # fmt: skip
        (rollout,) = agent.generate(batch, iteration=1)
        return rollout

    whole = played(0)
    assert whole.episodes_BE[0, 0] == 3 and whole.env_reward_B.tolist() == [1.0]
    row = whole.trainable_mask_BR[0][whole.response_mask_BR[0].bool()].tolist()
    first_turn, first_answer = row.index(0), row.index(1, row.index(0)) - row.index(0)
    # room for the first turn, its answer and a whole next turn, less one token: it ends after the first turn
    cut = played(first_turn + first_answer + sampling.max_new_tokens - 1)
    assert cut.episodes_BE[0].tolist()[0] == 1 and cut.episodes_BE[0, -1] == 1.0
    assert int(cut.response_mask_BR.sum()) == first_turn and episode_metrics(cut)["agent/truncated"] == 1.0
    assert cut.finished_B.tolist() == [True] and cut.env_reward_B.tolist() == [0.0]
    exact = played(first_turn + first_answer + sampling.max_new_tokens)
    assert exact.episodes_BE[0, 0] == 2 and exact.episodes_BE[0, -1] == 1.0  # room for one more turn only
    assert int(exact.response_mask_BR.sum()) <= first_turn + first_answer + sampling.max_new_tokens


def test_episodes_are_yielded_as_they_end_while_the_environments_answer_the_next_turn() -> None:
    tok = byte_tokenizer(TEMPLATE)
    consumed = threading.Event()
    waited: list[bool] = []

    class Waits:
        """Done on the row's answer; a second wrong answer waits for the consumer to have taken a chunk."""

        def reset(self, row):
            self.answer, self.turn = row["answer"], 0
            return []

        def step(self, message):
            self.turn += 1
            if self.turn == 2:
                waited.append(consumed.wait(10))
            done = message["content"] == self.answer or self.turn == 2
            return ([] if done else [{"role": "user", "content": "Try again."}]), float(done), done

    prompts = {}
    for i, answer in enumerate(("1", "2")):
        prompt = [{"role": "user", "content": f"Say {answer}."}]
        text = tok.render_chat(prompt)
        prompts[i] = Prompt(
            i, text, tuple(tok.encode(text, add_bos=False)), {"answer": answer}, tuple(prompt)
        )
    agent = AgentGenerator(
        Scripted(tok, ["1", "2"]), Waits, tok, prompts, sampling=SamplingConfig(), samples_per_prompt=1
    )
    batch = left_padded([list(p.token_ids) for p in prompts.values()], [0, 1], tok.pad_id)
    chunks = []
    for chunk in agent.generate(batch, iteration=1):
        chunks.append(chunk)
        consumed.set()  # the consumer (inference) has the first chunk while the second turn is being answered
    assert waited == [True]
    assert [c.prompt_index_B.tolist() for c in chunks] == [
        [0],
        [1],
    ]  # prompt 0 ended in turn 1, prompt 1 in 2
    assert [c.episodes_BE[:, 0].tolist() for c in chunks] == [[1.0], [2.0]]
    assert [c.env_reward_B.tolist() for c in chunks] == [[1.0], [1.0]]


def test_a_rows_tools_column_is_offered_beside_the_environments_tools() -> None:
    tok = byte_tokenizer(TEMPLATE)
    prompt = [{"role": "user", "content": "What is 7 + 5?"}]
    text = tok.render_chat(prompt)
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    prompts = {0: Prompt(0, text, tuple(tok.encode(text, add_bos=False)), {"answer": "12", "tools": [lookup]},
                         tuple(prompt))}  # fmt: skip
    agent = AgentGenerator(
        Scripted(tok, ["12"]), Calculator, tok, prompts, sampling=SamplingConfig(), samples_per_prompt=1
    )
    batch = PromptBatch(
        torch.tensor([prompts[0].token_ids]), torch.ones(1, len(text), dtype=torch.long), torch.tensor([0])
    )
    (rollout,) = agent.generate(batch, iteration=1)
    opened = tok.decode(
        rollout.prompt_ids_BP[0][rollout.prompt_mask_BP[0].bool()].tolist(), skip_special=False
    )
    system = opened.split("<|im_end|>")[0]
    assert (
        '"name": "lookup"' in system and '"name": "add"' in system
    )  # the row's schema, then the environment's
    assert system.index('"lookup"') < system.index('"add"')
