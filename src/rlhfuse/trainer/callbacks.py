"""Callbacks shipped with the trainer: a task-score metric, the samples table and the Hugging Face export of the
trained Actor."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhfuse.core.protocols import Callback
from rlhfuse.core.rewards import RuleReward, reward_samples
from rlhfuse.core.types import Experience
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import ModelConfig, Transformer, resident_bytes, save_pretrained
from rlhfuse.models.lora import LoraConfig, merged_state, plain_model, save_adapter


class TaskScore(Callback):
    """Logs `task/score` (or `key`): the mean of a rule (the synthetic task's hidden topic rule, the arithmetic
    task's numeric match) over the rollout, whatever reward the run optimises; the honest measure of whether RLHF
    improved the policy."""

    def __init__(
        self,
        rule: RuleReward,
        tokenizer: Tokenizer,
        key: str = "task/score",
        rows: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.rule, self.tokenizer, self.key, self.rows = rule, tokenizer, key, rows

    def on_rollout_end(self, trainer: Any, experience: Experience, metrics: dict[str, float]) -> None:
        scores_B = self.rule(reward_samples(experience.rollout, self.tokenizer, self.rows))
        metrics[self.key] = float(scores_B.sum()) / max(1, len(scores_B))


class RewardMetrics(Callback):
    """Logs each rule-based reward function's mean, unweighted, as `reward/<name>/mean` (TRL's
    `rewards/<name>/mean`), and `reward/truncated_fraction`: the share of samples whose score
    `inferencer.truncated_score` replaced (0 when it replaces nothing)."""

    def __init__(self, names: Sequence[str], replaces_truncated: bool) -> None:
        self.names, self.replaces_truncated = tuple(names), replaces_truncated

    def on_rollout_end(self, trainer: Any, experience: Experience, metrics: dict[str, float]) -> None:
        rules_BK = experience.rule_scores_BK
        if self.names:
            if rules_BK is None or rules_BK.shape[1] != len(self.names):
                raise ValueError(
                    f"the rollout carries no per-function scores for the reward functions {list(self.names)}: "
                    "its inferencer dropped Experience.rule_scores_BK"
                )
            for name, mean in zip(self.names, rules_BK.float().mean(dim=0).tolist(), strict=True):
                metrics[f"reward/{name}/mean"] = mean
        truncated_B = ~experience.rollout.finished_B
        metrics["reward/truncated_fraction"] = (
            float(truncated_B.float().mean()) if self.replaces_truncated else 0.0
        )


class ExportActor(Callback):
    """At the end of `fit`, write the trained Actor as a complete Hugging Face checkpoint: config.json and
    model.safetensors, tokenizer.json, tokenizer_config.json (special tokens, chat template) and
    generation_config.json (stop tokens), loadable with transformers' AutoTokenizer / AutoModelForCausalLM."""

    def __init__(self, actor: Transformer, tokenizer: Tokenizer, path: str | Path) -> None:
        self.actor, self.tokenizer, self.path = actor, tokenizer, Path(path)

    def on_fit_end(self, trainer: Any) -> None:
        save_pretrained(self.actor, self.path)  # replaces the folder as a whole, then the text files join it
        self.tokenizer.save(self.path)
        self.tokenizer.save_generation_config(self.path)


class ExportAdapter(Callback):
    """`ExportActor` for a LoRA Actor (model.lora): at the end of `fit`, write its adapters as a PEFT adapter
    folder (adapter_config.json + adapter_model.safetensors, `base_model_name_or_path` = the SFT checkpoint) with
    the tokenizer files, which `peft.PeftModel.from_pretrained(<the SFT model>, path)` loads; with
    model.lora.export_merged, also the merged model (base + adapter) as a complete checkpoint in `path/merged`.
    `whole_state` gives the adapted Actor's tensors whole (collective for a sharded Actor: every rank calls it,
    the writing rank writes)."""

    def __init__(
        self,
        whole_state: Callable[[], Mapping[str, torch.Tensor]],
        model_config: ModelConfig,
        config: LoraConfig,
        tokenizer: Tokenizer,
        path: str | Path,
        *,
        base: Path,
        write: bool = True,
    ) -> None:
        self.whole_state, self.model_config, self.config = whole_state, model_config, config
        self.tokenizer, self.path, self.base, self.write = tokenizer, Path(path), base, write

    def on_fit_end(self, trainer: Any) -> None:
        state = self.whole_state()
        if not self.write:
            return
        save_adapter(state, self.model_config, self.config, self.path, base=str(self.base))
        self.tokenizer.save(self.path)
        if self.config.export_merged:
            merged = plain_model(merged_state(state, self.config), self.model_config, head="lm")
            ExportActor(merged, self.tokenizer, self.path / "merged").on_fit_end(trainer)


class ExportShardedActor(Callback):
    """`ExportActor` when the generation copy is a tensor-parallel shard (generator.tp > 1): at the end of `fit`
    every rank joins the collective that reassembles the Actor's whole tensors (`whole_state`), and the writing
    rank (rank 0) saves them as one Hugging Face checkpoint. Every rank must have this callback."""

    def __init__(
        self,
        whole_state: Callable[[], Mapping[str, torch.Tensor]],
        config: ModelConfig,
        tokenizer: Tokenizer,
        path: str | Path,
        *,
        write: bool,
    ) -> None:
        self.whole_state, self.config, self.tokenizer = whole_state, config, tokenizer
        self.path, self.write = Path(path), write

    def on_fit_end(self, trainer: Any) -> None:
        state = self.whole_state()
        if not self.write:
            return
        dtype = next(iter(state.values())).dtype
        model = Transformer(self.config, head="lm").to(dtype)
        model.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, strict=True)
        save_pretrained(model, self.path)
        self.tokenizer.save(self.path)


class MemoryMetrics(Callback):
    """Adds `memory/param_bytes` (the most parameter + buffer bytes any rank holds: the four models, only their
    materialised stages, and the generation copies), `memory/optimizer_bytes` (the same for optimizer
    states) and `weight_sync/peak_extra_bytes` (the most memory any rank took for the iteration's weight sync
    beside its resident models: `RLHFTrainer.sync_weights`). `collective` (several training ranks): the figures
    are the most over the world, so every rank must have this callback."""

    def __init__(
        self,
        modules: Callable[[], Sequence[Any]],
        optimizers: Callable[[], Sequence[Any]],
        *,
        collective: bool = True,
    ) -> None:
        self.modules, self.optimizers, self.collective = modules, optimizers, collective

    def on_metrics(self, trainer: Any, metrics: dict[str, float]) -> None:
        from rlhfuse import distributed
        from rlhfuse.distributed.fsdp import local_tensor  # torch's FSDP: a second to import

        mods = [m for m in self.modules() if m is not None]
        param = resident_bytes(*mods)
        optim = sum(
            local_tensor(t).numel() * t.element_size()  # of a sharded state (pipeline=fsdp): its shard
            for o in self.optimizers()
            for state in o.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
        device = next((p.device for m in mods for p in m.parameters() if not p.is_meta), torch.device("cpu"))
        sync = 0.0 if trainer is None else float(trainer.sync_extra_bytes)  # None: read outside a run
        figures = torch.tensor([float(param), float(optim), sync], dtype=torch.float64, device=device)
        if self.collective and distributed.is_initialized():
            figures = figures.to(distributed.group_device(None, device))
            distributed.all_reduce(figures, op="max")
        param_bytes, optimizer_bytes, sync_bytes = figures.tolist()
        metrics["memory/param_bytes"], metrics["memory/optimizer_bytes"] = param_bytes, optimizer_bytes
        metrics["weight_sync/peak_extra_bytes"] = sync_bytes


class TableSink(Protocol):
    """Where a samples table also goes: Lightning's WandbLogger has this method (a W&B Table)."""

    def log_table(
        self, key: str, columns: list[str], data: list[list[Any]], step: int | None = None
    ) -> None: ...


SAMPLE_COLUMNS = [
    "iteration",
    "prompt_id",
    "sample_index",
    "prompt",
    "response",
    "score",
    "finished",
    "length",
]


class SampleTable(Callback):
    """Every `every` iterations, the first `count` samples (0 = all) of the rollout — prompt, response, score,
    finished flag, length — appended to `path` (samples.jsonl, one object per sample) and logged to each table
    sink as the Table `samples`. A resumed run drops the rows after its checkpoint's iteration."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        *,
        every: int,
        count: int = 16,
        sinks: Sequence[TableSink] = (),
    ) -> None:
        self.path, self.tokenizer, self.every, self.count = Path(path), tokenizer, every, count
        self.sinks = list(sinks)

    def on_fit_start(self, trainer: Any) -> None:
        if self.path.is_file():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line)["iteration"] <= trainer.iteration]
            self.path.write_text("".join(line + "\n" for line in kept))

    def on_rollout_end(self, trainer: Any, experience: Experience, metrics: dict[str, float]) -> None:
        iteration = trainer.iteration + 1  # the iteration whose rollout this is
        if self.every <= 0 or iteration % self.every != 0:
            return
        samples = reward_samples(experience.rollout, self.tokenizer)
        shown = samples[: self.count] if self.count > 0 else samples
        scores = experience.scores_B.tolist()
        data = [
            [
                iteration,
                s.prompt_id,
                s.sample_index,
                s.prompt,
                s.response,
                scores[i],
                s.finished,
                len(s.response_ids),
            ]
            for i, s in enumerate(shown)
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            for row in data:
                handle.write(json.dumps(dict(zip(SAMPLE_COLUMNS, row, strict=True)), allow_nan=True) + "\n")
        for sink in self.sinks:
            sink.log_table(key="samples", columns=SAMPLE_COLUMNS, data=data, step=iteration)
