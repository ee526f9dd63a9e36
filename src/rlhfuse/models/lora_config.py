"""`model.lora.*`: LoRA adapters on the Actor (`rlhfuse.models.lora` applies them through peft). No torch, so that
the command line composes the configuration without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_TARGETS: tuple[LoraTarget, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass
class LoraConfig:
    # Adapter rank r; 0 = no adapter: the Actor trains all of its weights.
    rank: int = 0
    # Scale alpha: each adapted projection adds (alpha / rank) B A x.
    alpha: float = 16.0
    # Dropout on the adapters' input while training.
    dropout: float = 0.0
    # The projections adapted in every decoder layer (peft matches them by name).
    target_modules: list[LoraTarget] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    # Also export the merged model (base + adapter) as <run_dir>/actor_hf/merged, beside the adapter.
    export_merged: bool = False

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def merges(self, name: str) -> bool:
        """Whether a plain model's tensor `name` is an adapted projection's weight (a weight sync sends it merged;
        the rest of the model is frozen)."""
        module, _, leaf = name.rpartition(".")
        return self.enabled and leaf == "weight" and module.rpartition(".")[2] in self.target_modules

    def problems(self, prefix: str = "model.lora") -> list[str]:
        problems = []
        if not isinstance(self.rank, int) or self.rank < 0:
            problems.append(f"{prefix}.rank={self.rank!r} must be an integer >= 0 (0 = no adapter)")
        if not self.enabled:
            return problems
        if not self.alpha > 0:
            problems.append(f"{prefix}.alpha={self.alpha} must be > 0 (the adapter's scale is alpha / rank)")
        if not 0 <= self.dropout < 1:
            problems.append(f"{prefix}.dropout={self.dropout} must be in [0, 1)")
        unknown = [m for m in self.target_modules if m not in DEFAULT_TARGETS]
        if unknown or not self.target_modules:
            problems.append(
                f"{prefix}.target_modules={list(self.target_modules)}: name one or more of the decoder layers' "
                f"projections {list(DEFAULT_TARGETS)}"
            )
        return problems
