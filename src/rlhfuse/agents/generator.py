"""`AgentGenerator`: multi-turn episodes over any generator (`agent.env`).

Each prompt's samples are episodes of the environment (`EpisodeRun`). The episodes advance turn by turn, all at
once: one call of the wrapped generator decodes every running episode's next assistant message (its whole
conversation so far as the prompt, one sample each), then each episode answers it (the tools, concurrently, or
`env.step`), and the answer's tokens are appended to its context for the next turn. The wrapped generator's
engine, migration and fusion run inside each turn's call unchanged.

What a sample's Rollout row holds: the prompt as the episode opened it (the dataset prompt, with the tools'
schemas and the environment's opening messages rendered by the chat template) and, as its response, every
assistant message's sampled tokens followed by the tokens of the messages answering it. `trainable_mask_BR` is
1 on the sampled tokens only, so environment and tool tokens carry no loss and no KL; `sampler_logprobs_BR` is
the sampler's on those tokens, 0 elsewhere; `env_reward_B` is the episode's reward (the sum of its turns'),
added to the inferencer's score; `finished_B` says the last message ended with a stop token.

An answer's tokens are what the chat template writes for those messages after the assistant's message
(`tokens.answer_tokens`: the conversation rendered with them and the next generation prompt, minus the
conversation rendered up to the assistant message's end token); a template for which the second is not a prefix
of the first is refused (`ChatTemplateError`), as `episode_tokens` does.

Episodes are yielded in chunks as they end, while the environments answer the next turn; `fused_rollout` infers
each chunk as it comes (`core.streamed_rollout`). Over several processes the environments run on rank 0, which
shares each turn's answers. Each turn's prompt is the whole conversation: rlhfuse's engine with
`generator.prefix_cache` prefills only its new tokens (vLLM's prefix caching likewise).

The turns of a batch are synchronised here (a sample waiting on a slow tool holds up the next turn of all).
`OpenAgentGenerator`, what a run in one process builds, is the generator-level loop: each episode at its own
pace over one open rollout of the wrapped generator, holding no decode slot while it waits for its answer.

Legend: B episodes (prompts x samples per prompt), P prompt tokens, R response tokens.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.agents.agent_config import MAX_TURNS, trajectory_tokens
from rlhfuse.agents.environment import ENV_KEY, AgentEnvError, environment_tools, load_environment
from rlhfuse.agents.episode import EpisodeRun
from rlhfuse.agents.tokens import answer_tokens, chat_encoder
from rlhfuse.agents.tools import ToolRunner, tool_schemas
from rlhfuse.core.protocols import Generator, Inferencer, OpeningGenerator
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.sampling_config import SamplingConfig
from rlhfuse.core.stats import GenerationStats, RolloutStats
from rlhfuse.core.streamed_rollout import streamed_rollout
from rlhfuse.core.types import EPISODE_COLUMNS, Experience, PromptBatch, Rollout
from rlhfuse.data.collate import left_padded
from rlhfuse.data.prompts import TOOLS_KEY, Prompt
from rlhfuse.data.tokenizer import ChatTemplateError, Tokenizer

_SAMPLES, _TURNS = 1 << 12, MAX_TURNS  # an episode's turn id: `_turn_id`


class AgentGenerator:
    """A `Generator` whose samples are multi-turn episodes of `environment` (a class, or `agent.env`'s
    'module:Class'), each turn decoded by `inner`.

    prompts: every prompt by dataset id (training and held-out), with the chat messages it was rendered from;
    sampling / samples_per_prompt: the run's own (a `generate` call's `sampling` replaces both, as for any
    generator); max_turns, tool_timeout_s: `agent.*`.
    """

    def __init__(
        self,
        inner: Generator,
        environment: type | str,
        tokenizer: Tokenizer,
        prompts: Mapping[int, Prompt],
        *,
        sampling: SamplingConfig,
        samples_per_prompt: int,
        max_turns: int = 4,
        tool_timeout_s: float = 10.0,
        max_response_tokens: int = 0,
    ) -> None:
        self.inner, self.tokenizer, self.prompts = inner, tokenizer, prompts
        self.environment = load_environment(environment)
        self.sampling, self.samples_per_prompt = sampling, samples_per_prompt
        self.max_turns, self.tool_timeout_s = max_turns, tool_timeout_s
        self.max_response_tokens = max_response_tokens
        missing = [p.id for p in prompts.values() if not p.messages][:3]
        if missing:
            raise ChatTemplateError(
                f"{ENV_KEY}: prompts {missing} were not rendered by a chat template: a multi-turn episode continues "
                "a chat; use a tokenizer with a chat template and data.chat_template=auto"
            )
        self.chat = chat_encoder(tokenizer)
        # the environments' answers run here, beside the consumer of the episodes already ended (`generate`)
        self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlhfuse-episodes")

    # --- the Generator protocol: weights and the rest are the wrapped generator's ------------------------------
    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        self.inner.load_weights(named_tensors)

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, Tensor]]) -> None:
        self.inner.load_weight_buckets(buckets)

    def generation_stats(self) -> GenerationStats | None:
        """The wrapped generator's, for the last turn's call."""
        return self.inner.generation_stats()

    def actor_copies(self) -> Sequence[torch.nn.Module]:
        return self.inner.actor_copies()

    def close(self) -> None:
        self._background.shutdown()
        self.inner.close()

    def fused_rollout(
        self,
        prompts: PromptBatch,
        *,
        iteration: int,
        inferencer: Inferencer,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        """The episodes with their inference fused in (`FusingGenerator`, asked for where each rank is a generation
        instance): each chunk of ended episodes inferred as `generate` yields it, while the environments answer the
        next turn, as the serial rollout stage does (each turn's call migrates its own tail; freed instances do not
        infer other ranks' episodes)."""
        return streamed_rollout(
            self,
            inferencer,
            prompts,
            iteration=iteration,
            pad_token_id=self.tokenizer.pad_id,
            sampling=sampling,
        )

    # --- episodes ----------------------------------------------------------------------------------------------
    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        """One episode per prompt and sample, played to its end, yielded in chunks as the episodes end: those that
        ended in a turn's answers are yielded while the environments answer the next turn (a consumer inferring
        each chunk as it comes, as the serial rollout stage does, infers them during the environments' latency),
        the last ones after the last turn. The same chunks on every rank: the episodes run on rank 0, which shares
        each turn's answers."""
        config = self.sampling if sampling is None else sampling.config
        per_prompt = self.samples_per_prompt if sampling is None else sampling.samples_per_prompt
        one = Sampling(config, 1)  # each episode's turn is its own prompt
        keys = [(int(p), k) for p in prompts.prompt_ids_B.tolist() for k in range(per_prompt)]
        episodes = _Episodes(self, keys) if distributed.rank() == 0 else None
        opened: list[list[int]] = self._shared(lambda: episodes.opened())  # type: ignore[union-attr]
        paths = _Trajectories(opened)
        ended: dict[int, list[float]] = {}  # episode -> its summary (`_Episodes.summary`), not yet yielded
        active = list(range(len(keys)))
        for turn in range(self.max_turns):
            if not active:
                break
            sampled = self._turn(active, keys, [paths.context(i) for i in active], turn, iteration, one)
            for i in active:
                paths.sampled(i, *sampled[i])
            room = [self._room(len(paths.response[i]), config.max_new_tokens) for i in active]
            answering = self._share(
                lambda: episodes.answer(active, sampled, room)  # type: ignore[union-attr]  # noqa: B023
            )
            if ended:  # inferred by the consumer while the environments answer
                yield paths.rollout(keys, ended, self.tokenizer.pad_id)
                ended = {}
            still = []
            for i, answer in zip(active, answering(), strict=True):
                if "summary" in answer:
                    ended[i] = answer["summary"]
                else:
                    paths.answered(i, answer["tokens"])
                    still.append(i)
            active = still
        if ended:
            yield paths.rollout(keys, ended, self.tokenizer.pad_id)

    def _room(self, length: int, max_new_tokens: int, bound: int = 0) -> int | None:
        """How many answer tokens a trajectory whose response holds `length` tokens may take and still have room for
        a whole next turn under `bound`, else `max_response_tokens` (None: neither bounds it)."""
        bound = bound or self.max_response_tokens
        if not bound:
            return None
        return bound - length - max_new_tokens

    def _share(self, compute: Callable[[], Any]) -> Callable[[], Any]:
        """Start `compute()` on rank 0, in the background; the function returned waits for it and gives its JSON
        value on every rank: the environments and the tools run once, where the episodes live, and every rank
        continues the same conversations (each turn's generate call is collective). An environment's error on
        rank 0 is raised on every rank."""
        future = self._background.submit(compute) if distributed.rank() == 0 else None

        def join() -> Any:
            value: dict[str, Any] | None = None
            failure: AgentEnvError | None = None
            if future is not None:
                try:
                    value = {"value": future.result()}
                except AgentEnvError as err:
                    failure, value = err, {"error": str(err)}
            if distributed.world_size() > 1:
                value = distributed.broadcast_json(
                    value, 0, torch.device("cpu"), group=distributed.cpu_group()
                )
            if failure is not None:
                raise failure
            assert value is not None
            if "error" in value:
                raise AgentEnvError(f"on rank 0: {value['error']}")
            return value["value"]

        return join

    def _shared(self, compute: Callable[[], Any]) -> Any:
        """`_share(compute)`, waited for."""
        return self._share(compute)()

    def _turn(
        self,
        active: list[int],
        keys: list[tuple[int, int]],
        contexts: list[list[int]],
        turn: int,
        iteration: int,
        one: Sampling,
    ) -> dict[int, tuple[list[int], list[float], bool]]:
        """Each active episode's next assistant message: (its sampled ids, their log-probs, ended with a stop
        token)."""
        ids = [_turn_id(keys[i], turn) for i in active]
        of = dict(zip(ids, active, strict=True))
        batch = left_padded(contexts, ids, self.tokenizer.pad_id)
        out: dict[int, tuple[list[int], list[float], bool]] = {}
        for chunk in self.inner.generate(batch, iteration=iteration, sampling=one):
            for turn_id, message in _messages(chunk):
                out[of[turn_id]] = message
        return out


def _turn_id(key: tuple[int, int], turn: int) -> int:
    """Episode `key` (prompt id, sample index)'s id in turn `turn`'s prompt batch (what the wrapped generator seeds
    its sample from): unique per prompt, sample and turn."""
    return (key[0] * _SAMPLES + key[1]) * _TURNS + turn


def _messages(chunk: Rollout) -> Iterator[tuple[int, tuple[list[int], list[float], bool]]]:
    """Each row of a turn's decoded chunk: (its turn id, (the sampled ids, their log-probs, ended with a stop
    token))."""
    lengths = chunk.response_mask_BR.sum(dim=1).tolist()
    for row, turn_id in enumerate(chunk.prompt_index_B.tolist()):
        n = int(lengths[row])
        lps = (
            [0.0] * n
            if chunk.sampler_logprobs_BR is None
            else chunk.sampler_logprobs_BR[row, :n].float().tolist()
        )
        yield int(turn_id), (chunk.response_ids_BR[row, :n].tolist(), lps, bool(chunk.finished_B[row]))


class OpenAgentGenerator(AgentGenerator):
    """`AgentGenerator` whose episodes run at their own pace, over one open rollout of `inner` (an
    `OpeningGenerator` whose instances are all in this process: `rlhfuse.generation.open_rollout`).

    An episode's next turn starts decoding as soon as its answer is ready, beside the other episodes' turns, and
    while its environment or tools answer it holds no decode slot: a slow tool delays its own episode only. The
    samples are the ones `AgentGenerator` plays (each turn's tokens from its own stream, keyed by prompt, sample
    and turn). The KV cache is sized for the longest opened prompt plus the trajectory bound: agent.
    max_response_tokens, or 2 x max_turns x max_new_tokens when that is 0; a trajectory whose next turn could
    pass it ends there, truncated (`Episode.ended` "context"). Ended episodes are yielded (and so inferred by the
    consumer, while the environments go on answering) once an eighth of the batch has ended, whenever no episode is
    decoding, and at the end.
    """

    inner: OpeningGenerator

    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        config = self.sampling if sampling is None else sampling.config
        per_prompt = self.samples_per_prompt if sampling is None else sampling.samples_per_prompt
        keys = [(int(p), k) for p in prompts.prompt_ids_B.tolist() for k in range(per_prompt)]
        if not keys:
            return
        episodes = _Episodes(self, keys)
        paths = _Trajectories(episodes.opened())
        bound = trajectory_tokens(self.max_response_tokens, self.max_turns, config.max_new_tokens)
        batch = self.inner.open_rollout(
            iteration=iteration,
            capacity=len(keys),
            prompt_width=max(map(len, paths.opened)) + bound,
            sampling=Sampling(config, 1),  # each episode's turn is its own prompt
        )
        turns = [0] * len(keys)
        decoding: dict[int, int] = {}  # turn id -> episode
        answering: dict[concurrent.futures.Future[dict[str, list[Any]]], int] = {}
        ended: dict[int, list[float]] = {}  # episode -> its summary (`_Episodes.summary`), not yet yielded
        pool = concurrent.futures.ThreadPoolExecutor(len(keys), thread_name_prefix="rlhfuse-answers")
        chunk = max(1, len(keys) // 8)  # ended episodes yielded together (fewer, larger inference calls)

        def start(started: list[int]) -> None:
            ids = [_turn_id(keys[i], turns[i]) for i in started]
            decoding.update(zip(ids, started, strict=True))
            batch.add(left_padded([paths.context(i) for i in started], ids, self.tokenizer.pad_id))

        try:
            start(list(range(len(keys))))
            while decoding or answering:
                if len(ended) >= chunk or (ended and not decoding):
                    yield paths.rollout(keys, ended, self.tokenizer.pad_id)
                    ended = {}
                if decoding:
                    done = batch.step()
                    for turn_id, message in _messages(done[1]) if done is not None else ():
                        i = decoding.pop(turn_id)
                        paths.sampled(i, *message)
                        turns[i] += 1
                        room = self._room(len(paths.response[i]), config.max_new_tokens, bound)
                        answering[pool.submit(episodes.answer_one, i, message, room)] = i
                else:  # every episode waits on its environment
                    concurrent.futures.wait(answering, return_when=concurrent.futures.FIRST_COMPLETED)
                again = []
                for future in [f for f in answering if f.done()]:
                    i = answering.pop(future)
                    answer = future.result()  # an environment's error ends the rollout here
                    if "summary" in answer:
                        ended[i] = answer["summary"]
                    else:
                        paths.answered(i, answer["tokens"])
                        again.append(i)
                if again:
                    start(sorted(again))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            batch.close()  # nothing left on success; after an error, the instances freed for the next batch
        if ended:
            yield paths.rollout(keys, ended, self.tokenizer.pad_id)


class _Episodes:
    """The episodes of one `generate` call, on the rank they run on: their environments, tools and conversations.
    Each method returns JSON values (what `AgentGenerator._shared` sends the other ranks)."""

    def __init__(self, agent: AgentGenerator, keys: list[tuple[int, int]]) -> None:
        self.agent = agent
        self.runs: list[EpisodeRun] = []
        self.schemas: list[list[dict[str, Any]]] = []
        for prompt_id, _ in keys:
            env = agent.environment()
            tools = environment_tools(env)
            runner = ToolRunner(tools, timeout_s=agent.tool_timeout_s) if tools else None
            prompt = agent.prompts[prompt_id]
            self.runs.append(
                EpisodeRun(
                    env, prompt.fields, prompt.messages, max_turns=agent.max_turns, tools_runner=runner
                )
            )
            # the row's own schemas (a `tools` column, rendered into its prompt too), then the environment's
            self.schemas.append(
                [*(prompt.fields.get(TOOLS_KEY) or []), *(tool_schemas(tools) if tools else [])]
            )

    def opened(self) -> list[list[int]]:
        """Each episode's prompt: the conversation so far with the generation prompt, the tools' schemas given."""
        return [
            self.agent.chat.encode(run.messages, tools=schemas, add_generation_prompt=True)
            for run, schemas in zip(self.runs, self.schemas, strict=True)
        ]

    def answer(
        self,
        active: list[int],
        sampled: Mapping[int, tuple[list[int], list[float], bool]],
        room: list[int | None],
    ) -> list[dict[str, list[Any]]]:
        """Each active episode's answer to its new message (`answer_one`), in `active`'s order. The episodes answer
        at once (their tools run concurrently)."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(active)) as pool:
            return list(pool.map(self.answer_one, active, [sampled[i] for i in active], room))

    def answer_one(
        self, i: int, sampled: tuple[list[int], list[float], bool], room: int | None
    ) -> dict[str, list[Any]]:
        """Episode `i`'s answer to its new message (`sampled`: its ids, log-probs, whether it ended with its end
        token): `{"tokens": the answer's tokens}`, or `{"summary": `summary(i)`}` when the episode ended (an
        answer longer than its `room` ends it, truncated: `AgentGenerator._room`)."""
        ids, _, ended_with_stop = sampled
        run, text = self.runs[i], self.agent.tokenizer.decode(ids)
        if not ended_with_stop:
            run.cut(text)
            return {"summary": self.summary(i)}
        answer = run.answer(text)
        if answer is None:
            return {"summary": self.summary(i)}
        tokens = answer_tokens(self.agent.chat, run.messages, len(answer), self.schemas[i])
        if room is not None and len(tokens) > room:
            run.truncate()
            return {"summary": self.summary(i)}
        return {"tokens": tokens}

    def summary(self, i: int) -> list[float]:
        """Ended episode `i`'s reward (the sum of its turns'), then its `EPISODE_COLUMNS`."""
        e = self.runs[i].episode()
        return [
            e.total_reward,
            e.turns,
            e.tool_calls,
            e.tool_errors,
            e.tool_seconds,
            float(e.ended == "context"),
        ]


class _Trajectories:
    """Every episode's response so far, token by token: the sampled tokens (trainable, with their sampler
    log-probs) and the answers' (not trainable, log-prob 0), after its opened prompt."""

    def __init__(self, opened: list[list[int]]) -> None:
        self.opened = opened
        self.response: list[list[int]] = [[] for _ in opened]
        self.trainable: list[list[int]] = [[] for _ in opened]
        self.logprobs: list[list[float]] = [[] for _ in opened]
        self.finished = [False] * len(opened)

    def context(self, i: int) -> list[int]:
        return self.opened[i] + self.response[i]

    def sampled(self, i: int, ids: list[int], logprobs: list[float], ended_with_stop: bool) -> None:
        self.response[i] += ids
        self.trainable[i] += [1] * len(ids)
        self.logprobs[i] += logprobs
        self.finished[i] = ended_with_stop

    def answered(self, i: int, tokens: list[int]) -> None:
        self.response[i] += tokens
        self.trainable[i] += [0] * len(tokens)
        self.logprobs[i] += [0.0] * len(tokens)

    def rollout(self, keys: list[tuple[int, int]], ended: Mapping[int, list[float]], pad: int) -> Rollout:
        """The ended episodes' Rollout (`ended`: episode -> `_Episodes.summary`), in episode order."""
        rows = sorted(ended)
        prompt = left_padded([self.opened[i] for i in rows], [keys[i][0] for i in rows], pad)
        b, width_r = len(rows), max(max(len(self.response[i]) for i in rows), 1)
        ids, mask = torch.full((b, width_r), pad), torch.zeros(b, width_r, dtype=torch.long)
        train, lps = torch.zeros(b, width_r, dtype=torch.long), torch.zeros(b, width_r)
        for row, i in enumerate(rows):
            r = len(self.response[i])
            if r:
                ids[row, :r], mask[row, :r] = torch.tensor(self.response[i]), 1
                train[row, :r], lps[row, :r] = torch.tensor(self.trainable[i]), torch.tensor(self.logprobs[i])
        summaries = torch.tensor([ended[i] for i in rows], dtype=torch.float32).reshape(
            b, 1 + len(EPISODE_COLUMNS)
        )
        return Rollout(
            prompt_ids_BP=prompt.input_ids_BP,
            prompt_mask_BP=prompt.attention_mask_BP,
            response_ids_BR=ids,
            response_mask_BR=mask,
            prompt_index_B=prompt.prompt_ids_B,
            sample_index_B=torch.tensor([keys[i][1] for i in rows]),
            finished_B=torch.tensor([self.finished[i] for i in rows]),
            sampler_logprobs_BR=lps,
            trainable_mask_BR=train,
            env_reward_B=summaries[:, 0].contiguous(),
            episodes_BE=summaries[:, 1:].contiguous(),
        )
