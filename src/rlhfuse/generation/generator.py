"""`EngineGenerator`: the trainer's `Generator` (generator=engine) on top of `GenerationEngine` instances.

Samples come back in the iteration's canonical order (prompt-major, sample index minor: the order
`SamplingGenerator` yields), whatever instance finished them and whether they migrated, so that training (whose
mini-batches are shuffles of row indices) sees the same batch with or without migration. The per-sample
completion stream is `EngineGenerator.stream(prompts, iteration=...)`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from rlhfuse.generation.config import GenerationConfig
from rlhfuse.generation.coordinator import Coordinator, MigrationReport
from rlhfuse.generation.engine import (
    GenerationEngine,
    SampleRequest,
    SamplingParams,
    requests_for,
    to_rollout,
)
from rlhfuse.generation.migration import BatchObservation, MigrationPolicy, NoMigration
from rlhfuse.generation.tuning import AutoThreshold, CostProfile, SimResult
from rlhfuse.models import Transformer
from rlhfuse.trainer.types import PromptBatch, Rollout


class EngineGenerator:
    """`config.instances` engines, each with its own copy of the Actor, coordinated in this process."""

    def __init__(
        self,
        actor: Transformer,
        config: GenerationConfig,
        *,
        eos_token_id: int,
        pad_token_id: int,
        samples_per_prompt: int,
        seed: int,
        policy: MigrationPolicy | None = None,
        mechanism: str = "auto",
        bs_max: int = 32,
        link_bytes_per_s: float = 1e9,
    ) -> None:
        if config.instances < 1:
            raise ValueError(f"generator.instances={config.instances} must be >= 1")
        self.config = config
        self.params = SamplingParams(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            stop_token_ids=tuple(sorted({eos_token_id, *config.stop_token_ids})),
        )
        self.models = [copy.deepcopy(actor).eval().requires_grad_(False) for _ in range(config.instances)]
        self.pad_token_id = pad_token_id
        self.samples_per_prompt = samples_per_prompt
        self.seed = seed
        self.policy: MigrationPolicy = policy or NoMigration()
        self.coordinator = Coordinator(
            [], bs_max=bs_max, mechanism=mechanism, link_bytes_per_s=link_bytes_per_s
        )
        self.engines: list[GenerationEngine] = []
        self._predicted: tuple[object, object] | None = None

    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for model in self.models:
                model.load_state_dict(dict(named_tensors), strict=True)

    def _engines_for(self, prompt_width: int, batch: int) -> list[GenerationEngine]:
        max_len = prompt_width + self.params.max_new_tokens
        slots = self.config.num_slots or batch
        if (
            not self.engines
            or any(e.has_work() for e in self.engines)  # an earlier generate stopped part-way
            or self.engines[0].cache.max_len < max_len
            or self.engines[0].cache.num_slots != slots
        ):
            self.engines = [
                GenerationEngine(
                    model,
                    self.params,
                    num_slots=slots,
                    max_len=max_len,
                    prefix_sharing=self.config.prefix_sharing,
                )
                for model in self.models
            ]
        for engine in self.engines:
            engine.stats = type(engine.stats)()
        return self.engines

    def stream(self, prompts: PromptBatch, *, iteration: int) -> Iterator[tuple[int, SampleRequest]]:
        """(instance, finished sample) as each sample finishes."""
        requests = requests_for(
            prompts, samples_per_prompt=self.samples_per_prompt, seed=self.seed, iteration=iteration
        )
        width = max(len(r.prompt_P) for r in requests)
        self.coordinator.engines = self._engines_for(width, len(requests))
        yield from self.coordinator.run(requests, threshold=self.policy.threshold(len(requests)))

    def generate(self, prompts: PromptBatch, *, iteration: int) -> Iterator[Rollout]:
        # what migration=auto predicted for this batch's Rt (made from the previous batches)
        self._predicted = (
            (self.policy.predicted, self.policy.predicted_serial)
            if isinstance(self.policy, AutoThreshold)
            else None
        )
        done = sorted(
            (sample for _, sample in self.stream(prompts, iteration=iteration)), key=lambda r: r.row
        )
        self.policy.observe(
            BatchObservation(
                response_lengths=[len(r.tokens) for r in done],
                prompt_len=round(sum(len(r.prompt_P) for r in done) / len(done)),
                cap=self.params.max_new_tokens,
                slots=self.engines[0].cache.num_slots,
                profile=CostProfile.fit([e.stats for e in self.engines]),
            )
        )
        yield to_rollout(done, self.pad_token_id)

    @property
    def migration(self) -> MigrationReport:
        return self.coordinator.report

    def rollout_metrics(self) -> dict[str, float]:
        """Metrics of the last `generate`: migration, running batch size, engine tokens/s."""
        stats = [e.stats for e in self.engines]
        sizes = [b for s in stats for b in s.batch_sizes]
        busy = sum(s.busy_seconds for s in stats)
        report = self.coordinator.report
        predicted: dict[str, float] = {}
        if self._predicted is not None:
            fused, serial = self._predicted
            if isinstance(fused, SimResult) and isinstance(serial, SimResult):
                predicted = {
                    "migration/predicted_gen_inf_s": fused.gen_inf_s,
                    "migration/predicted_serial_s": serial.gen_inf_s,
                }
        return {
            **predicted,
            "migration/threshold": float(report.threshold),
            "migration/samples_moved": float(report.samples_moved),
            "migration/destinations": float(report.destinations),
            "generation/batch_size_p50": float(torch.tensor(sizes, dtype=torch.float64).quantile(0.5))
            if sizes
            else 0.0,
            "generation/tokens_per_s": sum(s.tokens for s in stats) / busy if busy > 0 else math.nan,
        }
