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

Weaker than a generator-level loop (docs/agents.md): each turn re-prefills the whole conversation (no KV cache
kept between turns), and the turns of a batch are synchronised (a sample waiting on a slow tool holds up the next
turn of all; decode slots are not released while tools run).

Legend: B episodes (prompts x samples per prompt), P prompt tokens, R response tokens.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.agents.environment import ENV_KEY, AgentEnvError, environment_tools, load_environment
from rlhfuse.agents.episode import EpisodeRun
from rlhfuse.agents.tokens import answer_tokens, chat_encoder
from rlhfuse.agents.tools import ToolRunner, tool_schemas
from rlhfuse.core.protocols import Generator
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.sampling_config import SamplingConfig
from rlhfuse.core.stats import GenerationStats
from rlhfuse.core.types import EPISODE_COLUMNS, PromptBatch, Rollout
from rlhfuse.data.collate import left_padded
from rlhfuse.data.prompts import Prompt
from rlhfuse.data.tokenizer import ChatTemplateError, Tokenizer

# An episode's id in a turn's prompt batch (what the wrapped generator seeds its sample from): unique per prompt,
# sample and turn.
_SAMPLES, _TURNS = 1 << 12, 1 << 6


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
        self.inner.close()

    # --- episodes ----------------------------------------------------------------------------------------------
    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        """One episode per prompt and sample, played to its end; yields them as one Rollout (the same on every
        rank: the episodes run on rank 0, which shares each turn's answers)."""
        config = self.sampling if sampling is None else sampling.config
        per_prompt = self.samples_per_prompt if sampling is None else sampling.samples_per_prompt
        one = Sampling(config, 1)  # each episode's turn is its own prompt
        keys = [(int(p), k) for p in prompts.prompt_ids_B.tolist() for k in range(per_prompt)]
        episodes = _Episodes(self, keys) if distributed.rank() == 0 else None
        opened: list[list[int]] = self._shared(lambda: episodes.opened())  # type: ignore[union-attr]
        response: list[list[int]] = [[] for _ in keys]
        trainable: list[list[int]] = [[] for _ in keys]
        logprobs: list[list[float]] = [[] for _ in keys]
        finished = [False] * len(keys)
        active = list(range(len(keys)))
        for turn in range(self.max_turns):
            if not active:
                break
            sampled = self._turn(
                active, keys, [opened[i] + response[i] for i in active], turn, iteration, one
            )
            room = [self._room(len(response[i]) + len(sampled[i][0]), config.max_new_tokens) for i in active]
            answers: list[list[int] | None] = self._shared(
                lambda: episodes.answer(active, sampled, room)  # type: ignore[union-attr]  # noqa: B023
            )
            still = []
            for i, answer in zip(active, answers, strict=True):
                ids, lps, done_turn = sampled[i]
                response[i] += ids
                trainable[i] += [1] * len(ids)
                logprobs[i] += lps
                finished[i] = done_turn
                if answer is None:
                    continue
                response[i] += answer
                trainable[i] += [0] * len(answer)
                logprobs[i] += [0.0] * len(answer)
                still.append(i)
            active = still
        summary: dict[str, list[Any]] = self._shared(lambda: episodes.summary())  # type: ignore[union-attr]
        yield self._rollout(keys, summary, opened, response, trainable, logprobs, finished)

    def _room(self, length: int, max_new_tokens: int) -> int | None:
        """How many answer tokens a trajectory whose response holds `length` tokens may take and still have room for
        a whole next turn under `max_response_tokens` (None: no bound)."""
        if not self.max_response_tokens:
            return None
        return self.max_response_tokens - length - max_new_tokens

    @staticmethod
    def _shared(compute: Callable[[], Any]) -> Any:
        """`compute()` on rank 0, its JSON value on every rank: the environments and the tools run once, where the
        episodes live, and every rank continues the same conversations (each turn's generate call is collective).
        An environment's error on rank 0 is raised on every rank."""
        if distributed.world_size() == 1:
            return compute()
        value: dict[str, Any] | None = None
        failure: AgentEnvError | None = None
        if distributed.rank() == 0:
            try:
                value = {"value": compute()}
            except AgentEnvError as err:
                failure, value = err, {"error": str(err)}
        shared = distributed.broadcast_json(value, 0, torch.device("cpu"), group=distributed.cpu_group())
        if failure is not None:
            raise failure
        if "error" in shared:
            raise AgentEnvError(f"on rank 0: {shared['error']}")
        return shared["value"]

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
        ids = [(keys[i][0] * _SAMPLES + keys[i][1]) * _TURNS + turn for i in active]
        of = dict(zip(ids, active, strict=True))
        batch = left_padded(contexts, ids, self.tokenizer.pad_id)
        out: dict[int, tuple[list[int], list[float], bool]] = {}
        for chunk in self.inner.generate(batch, iteration=iteration, sampling=one):
            lengths = chunk.response_mask_BR.sum(dim=1).tolist()
            for row, episode_id in enumerate(chunk.prompt_index_B.tolist()):
                n = int(lengths[row])
                lps = (
                    [0.0] * n
                    if chunk.sampler_logprobs_BR is None
                    else chunk.sampler_logprobs_BR[row, :n].float().tolist()
                )
                out[of[int(episode_id)]] = (
                    chunk.response_ids_BR[row, :n].tolist(),
                    lps,
                    bool(chunk.finished_B[row]),
                )
        return out

    def _rollout(
        self,
        keys: list[tuple[int, int]],
        summary: dict[str, list[Any]],
        opened: list[list[int]],
        response: list[list[int]],
        trainable: list[list[int]],
        logprobs: list[list[float]],
        finished: list[bool],
    ) -> Rollout:
        pad = self.tokenizer.pad_id
        prompt = left_padded(opened, [k[0] for k in keys], pad)
        b, width_r = len(keys), max(max(map(len, response)), 1)
        ids, mask = torch.full((b, width_r), pad), torch.zeros(b, width_r, dtype=torch.long)
        train, lps = torch.zeros(b, width_r, dtype=torch.long), torch.zeros(b, width_r)
        for i in range(b):
            r = len(response[i])
            if r:
                ids[i, :r], mask[i, :r] = torch.tensor(response[i]), 1
                train[i, :r], lps[i, :r] = torch.tensor(trainable[i]), torch.tensor(logprobs[i])
        return Rollout(
            prompt_ids_BP=prompt.input_ids_BP,
            prompt_mask_BP=prompt.attention_mask_BP,
            response_ids_BR=ids,
            response_mask_BR=mask,
            prompt_index_B=prompt.prompt_ids_B,
            sample_index_B=torch.tensor([k[1] for k in keys]),
            finished_B=torch.tensor(finished),
            sampler_logprobs_BR=lps,
            trainable_mask_BR=train,
            env_reward_B=torch.tensor(summary["rewards"], dtype=torch.float32),
            episodes_BE=torch.tensor(summary["columns"], dtype=torch.float32).reshape(
                b, len(EPISODE_COLUMNS)
            ),
        )


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
            self.schemas.append(tool_schemas(tools) if tools else [])

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
    ) -> list[list[int] | None]:
        """Each active episode's answer to its new message (`sampled[i]`: its ids, log-probs, whether it ended with
        its end token), in `active`'s order: the answer's tokens, or None when the episode ended (an answer longer
        than its `room` ends it, truncated: `AgentGenerator._room`). The episodes answer at once (their tools run
        concurrently)."""
        rooms = dict(zip(active, room, strict=True))

        def one(i: int) -> list[int] | None:
            ids, _, ended_with_stop = sampled[i]
            run, text = self.runs[i], self.agent.tokenizer.decode(ids)
            if not ended_with_stop:
                run.cut(text)
                return None
            answer = run.answer(text)
            if answer is None:
                return None
            tokens = answer_tokens(self.agent.chat, run.messages, len(answer), self.schemas[i])
            limit = rooms[i]
            if limit is not None and len(tokens) > limit:
                run.truncate()
                return None
            return tokens

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(active)) as pool:
            return list(pool.map(one, active))

    def summary(self) -> dict[str, list[Any]]:
        """Each episode's reward (the sum of its turns') and its `EPISODE_COLUMNS`."""
        done = [run.episode() for run in self.runs]
        return {
            "rewards": [e.total_reward for e in done],
            "columns": [
                [e.turns, e.tool_calls, e.tool_errors, e.tool_seconds, float(e.ended == "context")]
                for e in done
            ],
        }
