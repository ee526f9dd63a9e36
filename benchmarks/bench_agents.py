"""Multi-turn episodes' rollout (issue 43): episodes then inference, against the episodes' chunks inferred as they
end (with and without long-tail migration), on 2 generation instances as 2 gloo processes, with a long-tailed
environment.

Workload: the guessing game (`agent.env=guess`) behind a slow service: each `step` waits a log-normal time
(median `MEDIAN_S`, sigma `SIGMA`, capped at `CAP_S`; drawn from the row and the turn, so both settings wait the
same) before it answers. The model is a random tiny Transformer over a byte-level chat tokenizer
(`rlhfuse.testing.chat`) whose messages end at a few frequent bytes (stop tokens): turns of geometric, long-tailed
lengths, up to `MAX_TURNS` turns per episode. `AgentGenerator` over `EngineGenerator` (one instance per rank),
then the whole-model inference of the rollout (Actor, Ref, Critic and Reward: copies of the model) on each rank.

Settings, their order rotating round by round: `serial` (every episode played, then the whole rollout inferred),
`streamed` (each chunk of episodes inferred as `AgentGenerator` yields it: the episodes that ended in a turn come
out while the environments answer the next turn, so their inference runs during that latency; what the serial
rollout stage of a run does), `streamed+migrating` (the same, each turn's call also moving its tail to one
instance once `RT_FRACTION` of its samples are left) and `streamed+kept_kv` (streamed, each turn prefilling only
its new tokens after the KV its episode's previous turn left: `generator.prefix_cache`). Same samples in every
setting (checked per round). Per setting, the median over rounds of rank 0's `gen_inf_s` (the episodes and their
inference), `decode_share` (the turn calls' decoding over it: the rest is the environments' answers, inference
not overlapped with them, and the host work between turns), `slot_utilisation` (the decode slots busy over the
rollout: sum over decode steps of running samples x step seconds / (slots x `gen_inf_s`), slots = this rank's
share of the episodes) and `prefill_tokens` (the positions rank 0's engine prefilled: every turn's whole
conversation, or with kept KV only its new tokens); `speedup.<setting>` = serial gen_inf_s / the setting's
(paired per round).

What it shows about the agent loop (docs/agents.md): turns are synchronised across a batch's episodes, so every
turn waits for the slowest answer, and slots idle while the environment answers.

`make bench BENCH=agents` (or `python -m benchmarks.run agents [--quick]`).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import tempfile
import time
import zlib
from datetime import timedelta
from typing import Any

import torch

from rlhfuse.agents import GuessingGame
from rlhfuse.testing.processes import leave_after_success, spawn_ranks

MEDIAN_S, SIGMA, CAP_S = 0.02, 1.0, 0.5
MAX_TURNS, PER_PROMPT, RT_FRACTION = 4, 4, 0.25
SETTINGS = {
    "serial": (False, False, False),
    "streamed": (False, True, False),
    "streamed+migrating": (True, True, False),
    "streamed+kept_kv": (False, True, True),
}
"""Name -> (long-tail migration in each turn's call, each chunk of ended episodes inferred as it comes, each
turn prefilling only its new tokens after the kept KV of the previous: generator.prefix_cache)."""


class SlowGame(GuessingGame):
    """The guessing game behind a slow service: each answer waits a log-normal time (see the module)."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.rng = random.Random(zlib.crc32(json.dumps(row, sort_keys=True).encode()))
        return super().reset(row)

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
        time.sleep(min(self.rng.lognormvariate(math.log(MEDIAN_S), SIGMA), CAP_S))
        return super().step(message)


class _Timed:
    """The inner generator, adding up its calls' seconds, its engine's decode slot-seconds and prefilled tokens."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.decode_s, self.slot_s, self.prefill_tokens = inner, 0.0, 0.0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        chunks = list(self.inner.generate(*args, **kwargs))
        self.decode_s += time.perf_counter() - start
        for engine in self.inner.engines:  # each call's own statistics (the pool starts them afresh)
            stats = engine.stats
            self.prefill_tokens += stats.prefill_tokens
            self.slot_s += sum(b * s for b, s in zip(stats.batch_sizes, stats.step_seconds, strict=True))
        return iter(chunks)


def _workload(prompts_count: int) -> tuple[Any, Any, Any, dict[int, Any], Any, Any]:
    """(tokenizer, model, inferencer, prompts, sampling config, prompt batch) of the benchmark's episodes."""
    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.core.sampling_config import SamplingConfig
    from rlhfuse.data.collate import left_padded
    from rlhfuse.data.prompts import Prompt
    from rlhfuse.models import ModelConfig, Transformer
    from rlhfuse.testing.chat import byte_tokenizer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    config = ModelConfig.tiny(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_heads=4,
                              num_kv_heads=2, num_layers=2)  # fmt: skip
    model = Transformer(config, head="lm").eval()
    inferencer = ModelInferencer(
        InferencerConfig(truncated_score=None), actor=model, ref=Transformer(config).eval(),
        critic=Transformer(config, head="value").eval(), reward_model=Transformer(config, head="value").eval(),
        rewards=None, tokenizer=None, temperature=1.0,
    )  # fmt: skip
    prompts = {}
    for i in range(prompts_count):
        messages = ({"role": "user", "content": f"Guess my number, game {i}."},)
        text = tok.render_chat(list(messages))
        prompts[i] = Prompt(i, text, tuple(tok.encode(text, add_bos=False)), {"game": i}, messages)
    stops = [tok.eos_id, *(tok.encode(c, add_bos=False)[0] for c in "e .0123456789")]
    sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, stop_token_ids=stops)
    batch = left_padded([list(p.token_ids) for p in prompts.values()], list(prompts), tok.pad_id)
    return tok, model, inferencer, prompts, sampling, batch


def _worker(rank: int, port: int, out: str, rounds: int, prompts_count: int) -> None:
    import torch.distributed as dist

    from rlhfuse.agents.generator import AgentGenerator
    from rlhfuse.core.types import Experience, Rollout
    from rlhfuse.generation import (
        EngineGenerator,
        FixedThreshold,
        GenerationConfig,
        InstanceSetup,
        NoMigration,
    )
    from rlhfuse.generation.generator import EnginePool

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))  # fmt: skip
    tok, model, inferencer, prompts, sampling, batch = _workload(prompts_count)
    episodes = prompts_count * PER_PROMPT
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    identical: list[bool] = []
    for r in range(rounds + 1):  # round 0 warms up
        names = list(SETTINGS)[r % len(SETTINGS) :] + list(SETTINGS)[: r % len(SETTINGS)]
        ids = []
        for name in names:
            migrating, streamed, kept_kv = SETTINGS[name]
            policy = FixedThreshold(round(RT_FRACTION * episodes)) if migrating else NoMigration()
            gen_config = GenerationConfig(name="engine", sampling=sampling, instances=2)
            gen_config.engine.prefix_cache = episodes if kept_kv else 0
            setup = InstanceSetup(tok.eos_id, tok.pad_id, samples_per_prompt=PER_PROMPT, seed=r, policy=policy,
                                  bs_max=episodes)  # fmt: skip
            inner = _Timed(
                EngineGenerator(EnginePool(model, gen_config.engine), gen_config, setup, mechanism="kv")
            )
            agent = AgentGenerator(inner, SlowGame, tok, prompts, sampling=sampling, samples_per_prompt=PER_PROMPT,
                                   max_turns=MAX_TURNS)  # fmt: skip
            dist.barrier()
            start = time.perf_counter()
            if streamed:  # each chunk of ended episodes inferred as it comes (the serial rollout stage's way)
                parts = [inferencer.infer(chunk) for chunk in agent.generate(batch, iteration=r)]
                rollout = Experience.cat(parts, tok.pad_id).rollout
            else:  # every episode played, then the whole rollout inferred
                rollout = Rollout.cat(list(agent.generate(batch, iteration=r)), tok.pad_id)
                inferencer.infer(rollout)
            gen_inf_s = time.perf_counter() - start
            agent.close()
            order = torch.argsort(rollout.prompt_index_B * PER_PROMPT + rollout.sample_index_B)
            ids.append(rollout.select(order).response_ids_BR)
            if r > 0:
                rows[name].append({
                    "gen_inf_s": gen_inf_s,
                    "decode_share": inner.decode_s / gen_inf_s,
                    "slot_utilisation": inner.slot_s / (episodes / 2 * gen_inf_s),
                    "turns_mean": float(rollout.episodes_BE[:, 0].mean()),
                    "prefill_tokens": float(inner.prefill_tokens),
                    "tokens": float(rollout.response_mask_BR.sum()),
                })  # fmt: skip
        identical.append(all(torch.equal(ids[0], other) for other in ids[1:]))
    torch.save({"rows": rows, "identical": identical}, f"{out}.{rank}")
    leave_after_success()


def _one_process(rounds: int, prompts_count: int) -> dict[str, Any]:
    """In this process, one engine instance with kept KV: the episodes turn by turn, all at once (`AgentGenerator`)
    against each at its own pace over one open rollout (`OpenAgentGenerator`), each chunk of ended episodes
    inferred as it comes; the median over rounds of `gen_inf_s`, `speedup` (paired), `identical` samples."""
    from rlhfuse.agents.generator import AgentGenerator, OpenAgentGenerator
    from rlhfuse.core.types import Experience
    from rlhfuse.generation import EngineGenerator, GenerationConfig, InstanceSetup
    from rlhfuse.generation.generator import EnginePool

    torch.set_num_threads(1)
    tok, model, inferencer, prompts, sampling, batch = _workload(prompts_count)
    episodes = prompts_count * PER_PROMPT
    kinds = {"turn_by_turn": AgentGenerator, "own_pace": OpenAgentGenerator}
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    identical = []
    for r in range(rounds + 1):  # round 0 warms up
        ids = []
        for name in list(kinds)[r % 2 :] + list(kinds)[: r % 2]:
            gen_config = GenerationConfig(name="engine", sampling=sampling)
            gen_config.engine.prefix_cache = episodes
            setup = InstanceSetup(
                tok.eos_id, tok.pad_id, samples_per_prompt=PER_PROMPT, seed=r, bs_max=episodes
            )
            inner = EngineGenerator(EnginePool(model, gen_config.engine), gen_config, setup, mechanism="kv")
            agent = kinds[name](inner, SlowGame, tok, prompts, sampling=sampling, samples_per_prompt=PER_PROMPT,
                                max_turns=MAX_TURNS, max_response_tokens=4 * MAX_TURNS * 32)  # fmt: skip
            start = time.perf_counter()
            parts = [inferencer.infer(chunk) for chunk in agent.generate(batch, iteration=r)]
            elapsed = time.perf_counter() - start
            agent.close()
            rollout = Experience.cat(parts, tok.pad_id).rollout
            order = torch.argsort(rollout.prompt_index_B * PER_PROMPT + rollout.sample_index_B)
            ids.append(rollout.select(order).response_ids_BR)
            if r > 0:
                seconds[name].append(elapsed)
        identical.append(torch.equal(ids[0], ids[1]))
    figures: dict[str, Any] = {name: {"gen_inf_s": statistics.median(seconds[name])} for name in kinds}
    figures["speedup"] = statistics.median(
        a / b for a, b in zip(seconds["turn_by_turn"], seconds["own_pace"], strict=True)
    )
    figures["identical"] = all(identical)
    print(f"  one process, one instance with kept KV: turn by turn {figures['turn_by_turn']['gen_inf_s']:.2f} s, "
          f"each episode at its own pace {figures['own_pace']['gen_inf_s']:.2f} s "
          f"({figures['speedup']:.2f}x); samples identical: {figures['identical']}")  # fmt: skip
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: per setting (`SETTINGS`) the medians of `_worker`'s row keys; `speedup.<setting>` (paired median
    of serial / the setting's gen_inf_s), `identical` (every round's samples the same in all) and the workload."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rounds, prompts_count = (3, 8) if quick else (7, 16)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "agents")
        codes = spawn_ranks(_worker, out, rounds, prompts_count, timeout_s=1200)
        if codes != [0, 0]:
            raise RuntimeError(f"a worker failed: exit codes {codes}")
        result = torch.load(f"{out}.0", weights_only=False)
    rows = result["rows"]
    figures: dict[str, Any] = {
        name: {k: statistics.median(row[k] for row in rows[name]) for k in rows[name][0]} for name in rows
    }
    figures["speedup"] = {
        name: statistics.median(
            s["gen_inf_s"] / o["gen_inf_s"] for s, o in zip(rows["serial"], rows[name], strict=True)
        )
        for name in SETTINGS
        if name != "serial"
    }
    figures["identical"] = all(result["identical"])
    figures["workload"] = {"episodes": prompts_count * PER_PROMPT, "rounds": rounds, "max_turns": MAX_TURNS,
                           "env_median_s": MEDIAN_S, "env_sigma": SIGMA, "env_cap_s": CAP_S}  # fmt: skip
    print(f"multi-turn episodes + inference, 2 gloo processes, {prompts_count * PER_PROMPT} episodes of up to "
          f"{MAX_TURNS} turns, environment answers log-normal (median {MEDIAN_S * 1000:.0f} ms, sigma {SIGMA}), "
          f"median of {rounds} rounds")  # fmt: skip
    print(f"  {'setting':<20} {'gen+inf s':>10} {'vs serial':>10} {'decode share':>13} {'slot util':>10} "
          f"{'turns':>6} {'prefilled':>10}")  # fmt: skip
    for name in SETTINGS:
        f, ratio = figures[name], figures["speedup"].get(name, 1.0)
        print(f"  {name:<20} {f['gen_inf_s']:>10.2f} {ratio:>9.2f}x {f['decode_share']:>13.2f} "
              f"{f['slot_utilisation']:>10.2f} {f['turns_mean']:>6.2f} {f['prefill_tokens']:>10.0f}")  # fmt: skip
    print(f"  samples identical in every setting: {figures['identical']}; 1-minute load average: "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    figures["one_process"] = _one_process(rounds, prompts_count)
    return figures


if __name__ == "__main__":
    import sys

    run(quick="--quick" in sys.argv)
