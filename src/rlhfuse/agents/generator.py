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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhfuse.agents.environment import ENV_KEY, environment_tools, load_environment
from rlhfuse.agents.episode import EpisodeRun
from rlhfuse.agents.tokens import answer_tokens, chat_encoder
from rlhfuse.agents.tools import Message, ToolRunner, tool_schemas
from rlhfuse.core.protocols import Generator
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.sampling_config import SamplingConfig
from rlhfuse.core.stats import GenerationStats
from rlhfuse.core.types import PromptBatch, Rollout
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
    ) -> None:
        self.inner, self.tokenizer, self.prompts = inner, tokenizer, prompts
        self.environment = load_environment(environment)
        self.sampling, self.samples_per_prompt = sampling, samples_per_prompt
        self.max_turns, self.tool_timeout_s = max_turns, tool_timeout_s
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
        """One episode per prompt and sample, played to its end; yields them as one Rollout."""
        config = self.sampling if sampling is None else sampling.config
        per_prompt = self.samples_per_prompt if sampling is None else sampling.samples_per_prompt
        one = Sampling(config, 1)  # each episode's turn is its own prompt
        keys = [(int(p), k) for p in prompts.prompt_ids_B.tolist() for k in range(per_prompt)]
        runs, schemas = [], []
        for prompt_id, _ in keys:
            env = self.environment()
            tools = environment_tools(env)
            runner = ToolRunner(tools, timeout_s=self.tool_timeout_s) if tools else None
            prompt = self.prompts[prompt_id]
            runs.append(
                EpisodeRun(env, prompt.fields, prompt.messages, max_turns=self.max_turns, tools_runner=runner)
            )
            schemas.append(tool_schemas(tools) if tools else None)
        opened = [self._encode(run.messages, schemas[i], prompt=True) for i, run in enumerate(runs)]
        response: list[list[int]] = [[] for _ in runs]
        trainable: list[list[int]] = [[] for _ in runs]
        logprobs: list[list[float]] = [[] for _ in runs]
        finished = [False] * len(runs)
        active = list(range(len(runs)))
        for turn in range(self.max_turns):
            if not active:
                break
            sampled = self._turn(
                active, keys, [opened[i] + response[i] for i in active], turn, iteration, one
            )
            texts = {i: self.tokenizer.decode(sampled[i][0]) for i in active}
            jobs = [(runs[i], texts[i], sampled[i][2]) for i in active]
            # the episodes answer at once: their tools run concurrently
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(active)) as pool:
                answers = dict(zip(active, pool.map(lambda job: self._answer(*job), jobs), strict=True))
            still = []
            for i in active:
                ids, lps, done_turn = sampled[i]
                response[i] += ids
                trainable[i] += [1] * len(ids)
                logprobs[i] += lps
                finished[i] = done_turn
                answer = answers[i]
                if answer is None:
                    continue
                tokens = answer_tokens(self.chat, runs[i].messages, len(answer), schemas[i] or [])
                response[i] += tokens
                trainable[i] += [0] * len(tokens)
                logprobs[i] += [0.0] * len(tokens)
                still.append(i)
            active = still
        yield self._rollout(keys, runs, opened, response, trainable, logprobs, finished)

    def _answer(self, run: EpisodeRun, text: str, finished: bool) -> list[Message] | None:
        if not finished:
            run.cut(text)
            return None
        return run.answer(text)

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

    def _encode(
        self, messages: Sequence[Message], schemas: list[dict[str, Any]] | None, *, prompt: bool
    ) -> list[int]:
        return self.chat.encode(messages, tools=schemas or [], add_generation_prompt=prompt)

    def _rollout(
        self,
        keys: list[tuple[int, int]],
        runs: list[EpisodeRun],
        opened: list[list[int]],
        response: list[list[int]],
        trainable: list[list[int]],
        logprobs: list[list[float]],
        finished: list[bool],
    ) -> Rollout:
        pad = self.tokenizer.pad_id
        prompt = left_padded(opened, [k[0] for k in keys], pad)
        b, width_r = len(runs), max(max(map(len, response)), 1)
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
            env_reward_B=torch.tensor([run.episode().total_reward for run in runs], dtype=torch.float32),
        )
