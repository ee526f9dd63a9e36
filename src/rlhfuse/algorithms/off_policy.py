"""Off-policy corrections: the gap between the policy that sampled a rollout (the behaviour policy, whose
log-probs the generator recorded: `Rollout.sampler_logprobs_BR`) and the one the trainer's old log-probs come
from (π_old, recomputed by the Actor before training: the proximal policy of decoupled PPO, Hilton et al. 2022).
The gap is the sampler's numerics (another kernel, batch or precision: vLLM against the trainer), and, once
generation runs ahead of training, the policy versions the samples are behind.

Each correction turns the per-token importance ratio ρ_t = π_old(y_t) / π_behaviour(y_t) into a weight w_t ≥ 0
on the token's loss and a keep mask (tokens that leave the loss). The weight is detached and multiplies the
token's advantage: every registered policy loss is positively homogeneous in the advantage (the clipped
surrogate max(−A r, −A clip(r)) and its dual-clip bound min(·, −c A), CISPO's −sg(clip(r)) A log π), so w·A is
w times the token's loss, gradient included.

- `none`: w = 1, every token kept (`auto`, the default: `tis` when generation runs ahead of training, else
  `none`);
- `tis`: truncated importance sampling, w = min(ρ_t, is_cap) (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"; decoupled PPO's behaviour weight, truncated);
- `token_mask`: masked importance sampling (IcePop): w = ρ_t where is_low <= ρ_t <= is_high, the token leaves the
  loss elsewhere;
- `sequence_mask`: the same bounds on each response's geometric-mean ratio exp(mean_t log ρ_t): the whole response
  leaves the loss outside them, w = 1 inside.

Legend: B rows, R response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlhfuse.algorithms.masked import masked_mean


@dataclass(frozen=True)
class Bounds:
    """The corrections' settings: the truncation cap of `tis`, the kept range [low, high] of the masks."""

    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0


class Correction(Protocol):
    corrects: bool
    """Whether it reads the sampler's log-probs (`none` does not: the training batch then carries none)."""

    def weights(
        self, log_ratio_BR: Tensor, valid_BR: Tensor, bounds: Bounds
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(w_BR, keep_BR, changed_BR) from log ρ = log π_old − log π_behaviour: each token's weight (>= 0),
        whether it stays in the loss, and whether the correction changed it (truncated, or left out)."""
        ...


class NoCorrection:
    corrects = False

    def weights(
        self, log_ratio_BR: Tensor, valid_BR: Tensor, bounds: Bounds
    ) -> tuple[Tensor, Tensor, Tensor]:
        return torch.ones_like(log_ratio_BR), torch.ones_like(valid_BR), torch.zeros_like(valid_BR)


class TruncatedIS:
    corrects = True

    def weights(
        self, log_ratio_BR: Tensor, valid_BR: Tensor, bounds: Bounds
    ) -> tuple[Tensor, Tensor, Tensor]:
        ratio_BR = log_ratio_BR.exp()
        return ratio_BR.clamp(max=bounds.cap), torch.ones_like(valid_BR), ratio_BR > bounds.cap


class TokenMask:
    corrects = True

    def weights(
        self, log_ratio_BR: Tensor, valid_BR: Tensor, bounds: Bounds
    ) -> tuple[Tensor, Tensor, Tensor]:
        ratio_BR = log_ratio_BR.exp()
        keep_BR = (ratio_BR >= bounds.low) & (ratio_BR <= bounds.high)
        return torch.where(keep_BR, ratio_BR, torch.zeros_like(ratio_BR)), keep_BR, ~keep_BR


class SequenceMask:
    corrects = True

    def weights(
        self, log_ratio_BR: Tensor, valid_BR: Tensor, bounds: Bounds
    ) -> tuple[Tensor, Tensor, Tensor]:
        ratio_B = masked_mean(log_ratio_BR, valid_BR, dim=-1).exp()
        keep_B = (ratio_B >= bounds.low) & (ratio_B <= bounds.high)
        keep_BR = keep_B[:, None].expand_as(valid_BR)
        return keep_BR.to(log_ratio_BR.dtype), keep_BR, ~keep_BR


OFF_POLICY_CORRECTIONS: dict[str, Correction] = {
    # the run resolves auto before it trains (`rlhfuse.trainer.run_config.resolve_components`: tis when
    # generation runs ahead of training, async.max_staleness > 0, else none); read unresolved, it is none
    "auto": NoCorrection(),
    "none": NoCorrection(),
    "tis": TruncatedIS(),
    "token_mask": TokenMask(),
    "sequence_mask": SequenceMask(),
}


def correct(
    name: str, old_logprobs_BR: Tensor, behaviour_logprobs_BR: Tensor, mask_BR: Tensor, bounds: Bounds
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Correction `name` for the tokens `mask_BR` marks: (w_BR, keep_BR, the mean weight over the valid tokens
    (0 for one left out), the fraction of them the correction changed: truncated, or left out of the loss)."""
    valid_BR = mask_BR != 0
    log_ratio_BR = (old_logprobs_BR - behaviour_logprobs_BR.to(old_logprobs_BR)).detach()
    log_ratio_BR = torch.where(valid_BR, log_ratio_BR, torch.zeros_like(log_ratio_BR))
    weight_BR, keep_BR, changed_BR = OFF_POLICY_CORRECTIONS[name].weights(log_ratio_BR, valid_BR, bounds)
    return (
        weight_BR,
        keep_BR,
        masked_mean(weight_BR * keep_BR, valid_BR),
        masked_mean(changed_BR.to(weight_BR.dtype), valid_BR),
    )
