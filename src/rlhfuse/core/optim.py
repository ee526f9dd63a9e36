"""Optimizers and micro-batching shared by every training strategy: AdamW with warmup + decay, and the split
of a mini-batch into micro-batches (by samples, or packed up to a token budget)."""

from __future__ import annotations

import math
from typing import Any

import torch

from rlhfuse.core.optim_config import OptimConfig as OptimConfig  # importable from here too
from rlhfuse.core.types import TrainBatch


def resolve_precision(precision: str, device_type: str) -> str:
    """pipeline.precision with `auto` resolved for the device: bf16-mixed on CUDA, 32-true elsewhere."""
    if precision == "auto":
        return "bf16-mixed" if device_type == "cuda" else "32-true"
    return precision


def generation_dtype(precision: str) -> torch.dtype:
    """The dtype the generator's Actor copy and its KV cache hold under a resolved pipeline.precision: bf16 under
    both bf16 precisions (decoding is memory-bound: half the bytes of weights and cache per token; the training
    weights of bf16-mixed stay fp32), fp32 under 32-true."""
    return torch.bfloat16 if precision.startswith("bf16") else torch.float32


def cast_to(have: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of dtype `have` is sent in when the receiver wants `want` (None: as it is): floating
    point is cast, integers and booleans go as they are."""
    return want if want is not None and have.is_floating_point else have


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of low-precision (bf16) parameters (precision=bf16-true).

    `step` reads each parameter's gradient into its master (as fp32), steps the masters (fp32 moments) and
    writes the rounded weights back into the parameters; updates smaller than a bf16 ulp accumulate in the
    masters instead of being lost. The masters are part of the state dict (`master_weights`), so a resume
    continues from the same fp32 values.
    """

    def __init__(self, params: Any, **kwargs: Any) -> None:
        self.model_params: list[torch.nn.Parameter] = list(params)
        masters = [p.detach().float().clone() for p in self.model_params]
        super().__init__(masters, **kwargs)

    @property
    def masters(self) -> list[torch.Tensor]:
        return list(self.param_groups[0]["params"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for p, master in zip(self.model_params, self.masters, strict=True):
            master.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, master in zip(self.model_params, self.masters, strict=True):
            p.copy_(master)
            master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master_weights"] = [m.detach().clone() for m in self.masters]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved = state.pop("master_weights", None)
        super().load_state_dict(state)
        with torch.no_grad():
            for p, master, value in zip(
                self.model_params, self.masters, saved or [None] * len(self.model_params), strict=True
            ):
                # without saved masters (a checkpoint of another precision): start from the loaded weights
                master.copy_(p.float() if value is None else value)
                p.copy_(master)


def build_optimizer(
    params: Any, lr: float, config: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` at peak `lr`, with the config's warmup + decay schedule over `total_steps`; over
    bf16/fp16 parameters, `MasterWeightAdamW` (fp32 master weights and optimizer states)."""
    params = list(params)
    kwargs: dict[str, Any] = dict(
        lr=lr, betas=(config.betas[0], config.betas[1]), weight_decay=config.weight_decay
    )
    if params and all(p.device.type == "cpu" for p in params):
        # torch picks the foreach (multi-tensor) step only for CUDA parameters; on the CPU it computes the same
        # bits as the per-tensor loop (tests/core/test_optim.py) with one op per group of tensors, not per tensor
        kwargs["foreach"] = True
    if any(p.dtype in LOW_PRECISION for p in params):
        optim: torch.optim.AdamW = MasterWeightAdamW(params, **kwargs)
    else:
        optim = torch.optim.AdamW(params, **kwargs)

    def schedule(step: int) -> float:
        return lr_lambda(
            step,
            warmup=config.warmup_steps,
            total=total_steps,
            schedule=config.lr_schedule,
            min_ratio=config.min_lr_ratio,
        )

    return optim, torch.optim.lr_scheduler.LambdaLR(optim, schedule)


def set_peak_lr(optim: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """Make `lr` the peak learning rate of `optim` and its schedule `sched`, keeping the schedule's step: called
    after a checkpoint's optimizer and schedule states are loaded, whose peak (`base_lrs`, each group's
    `initial_lr` and current `lr`) would otherwise override the configured one (a resume may change it). With
    the checkpoint's own peak this changes nothing."""
    sched.base_lrs = [lr] * len(optim.param_groups)
    for group, factor in zip(optim.param_groups, sched.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in optim.param_groups]  # what get_last_lr() reports until a step


def micro_batches(batch: TrainBatch, *, samples: int, tokens: int) -> list[TrainBatch]:
    """Split a mini-batch by sample count, or, with a token budget (`data.micro_batch_tokens`), into the fewest
    micro-batches that each hold at most `tokens` real tokens: sequences dealt by Karmarkar-Karp over their
    lengths (`rlhfuse.core.balance`) into ceil(total / budget) parts of near-equal tokens, one part more while
    some part overflows (consecutive greedy filling is the fallback that always fits)."""
    if tokens <= 0:
        return [
            batch.select(torch.arange(s, min(s + samples, len(batch)))) for s in range(0, len(batch), samples)
        ]
    return [batch.select(torch.tensor(g)) for g in token_groups(batch.host_lengths(), tokens)]


def micro_batch_count(lengths: list[int], *, samples: int, tokens: int) -> int:
    """How many micro-batches `micro_batches` makes of rows of these lengths (without making them)."""
    if tokens <= 0:
        return math.ceil(len(lengths) / samples)
    return len(token_groups(lengths, tokens))


def token_groups(lengths: list[int], tokens: int) -> list[list[int]]:
    """Index groups of `lengths` with at most `tokens` in each, as few as found (see `micro_batches`)."""
    from rlhfuse.core.balance import karmarkar_karp

    if lengths and max(lengths) > tokens:
        raise ValueError(
            f"data.micro_batch_tokens={tokens} cannot hold a sequence of {max(lengths)} tokens: raise "
            f"data.micro_batch_tokens to >= {max(lengths)} (or 0 for micro-batches of data.micro_batch_size samples)"
        )
    greedy: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if greedy[-1] and used + n > tokens:
            greedy.append([])
            used = 0
        greedy[-1].append(i)
        used += n
    for parts in range(max(1, math.ceil(sum(lengths) / tokens)), len(greedy)):
        groups = karmarkar_karp([float(n) for n in lengths], parts)
        if all(sum(lengths[i] for i in g) <= tokens for g in groups):
            return groups
    return greedy
