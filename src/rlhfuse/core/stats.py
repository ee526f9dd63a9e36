"""Typed statistics of the stages, summed generically (as torchtune's `PPOStats(*map(sum, zip(*stats)))`).

Every stats type is a NamedTuple of floats (or of nested stats tuples, or None where a part did not run);
`metrics()` flattens it into the logged metric names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from rlhfuse.core.types import EPISODE_COLUMNS

if TYPE_CHECKING:
    from rlhfuse.core.types import Experience, Rollout

S = TypeVar("S", bound=tuple[Any, ...])


def _combine(stats: Sequence[Any], scale: float) -> Any:
    first = stats[0]
    if first is None:
        return None
    if isinstance(first, tuple):
        return type(first)(*(_combine(col, scale) for col in zip(*stats, strict=True)))
    return sum(stats) * scale


def sum_stats(stats: Sequence[S]) -> S:
    """Field-wise sum of stats tuples of one type (nested tuples summed too; None stays None)."""
    if not stats:
        raise ValueError("sum_stats needs at least one stats tuple")
    return _combine(stats, 1.0)  # type: ignore[no-any-return]


def mean_stats(stats: Sequence[S]) -> S:
    """Field-wise mean of stats tuples of one type."""
    if not stats:
        raise ValueError("mean_stats needs at least one stats tuple")
    return _combine(stats, 1.0 / len(stats))  # type: ignore[no-any-return]


def scale_stats(stats: S, weight: float) -> S:
    """Every field of `stats` multiplied by `weight` (a micro-batch's share of its mini-batch)."""
    return _combine([stats], weight)  # type: ignore[no-any-return]


class LossStats(NamedTuple):
    """A micro-batch's loss statistics; weighted by its share, they sum to the mini-batch's. The Actor's loss
    fills the policy fields (and `kl_loss`, the KL term before its coefficient, when the KL is a loss term), the
    Critic's the value field (the other fields are 0). `metrics()` leaves `kl_loss`, `router_aux_loss` and the
    clip fractions by side out: the trainer logs them (loss/kl, loss/router_aux, policy/clip_fraction_low and
    _high) only when the run has the term."""

    policy_loss: float = 0.0
    clip_fraction: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    value_loss: float = 0.0
    kl_loss: float = 0.0
    router_aux_loss: float = 0.0
    """A mixture-of-experts Actor's load-balancing loss before its coefficient (logged as loss/router_aux when
    pipeline.router_aux_loss_coef > 0)."""
    clip_fraction_low: float = 0.0
    clip_fraction_high: float = 0.0
    """`clip_fraction` split by the side of the clip range (`rlhfuse.algorithms.PolicyLossStats`); logged as
    policy/clip_fraction_low and _high when the run sets the high side of the range (algorithm.clip_eps_high)."""
    is_weight_mean: float = 0.0
    corrected_fraction: float = 0.0
    """With an off-policy correction (algorithm.off_policy_correction, `rlhfuse.algorithms.off_policy`): the mean
    importance weight on the tokens (0 for one left out) and the fraction of tokens it truncated or left out;
    logged as off_policy/is_weight_mean and off_policy/corrected_fraction."""

    def metrics(self) -> dict[str, float]:
        return {
            "loss/policy": self.policy_loss,
            "policy/clip_fraction": self.clip_fraction,
            "policy/approx_kl": self.approx_kl,
            "policy/entropy": self.entropy,
            "loss/value": self.value_loss,
        }


class LossTensors(NamedTuple):
    """`LossStats` as 0-dim tensors on the loss's device, as the losses return them: computing a loss makes no
    host sync, and a step reads all its statistics at once (`vector`, then `LossStats(*values)`)."""

    policy_loss: Tensor
    clip_fraction: Tensor
    approx_kl: Tensor
    entropy: Tensor
    value_loss: Tensor
    kl_loss: Tensor
    router_aux_loss: Tensor
    clip_fraction_low: Tensor
    clip_fraction_high: Tensor
    is_weight_mean: Tensor
    corrected_fraction: Tensor

    @classmethod
    def of(cls, like: Tensor, **fields: Tensor) -> LossTensors:
        """The named fields (detached), zeros of `like`'s device elsewhere."""
        zero = like.detach().new_zeros((), dtype=torch.float64)
        return cls(
            **{name: fields[name].detach().double() if name in fields else zero for name in cls._fields}
        )

    def vector(self) -> Tensor:
        """The fields as one float64 vector in `LossStats` order (still on the device)."""
        return torch.stack([t.double() for t in self])

    def host(self) -> LossStats:
        """The statistics as floats: one host sync for all of them."""
        return LossStats(*self.vector().tolist())

    def metrics(self) -> dict[str, float]:
        return self.host().metrics()


class PipelineStats(NamedTuple):
    """What a pipelined training step measured: the planner's prediction against the executed makespan."""

    predicted_makespan_s: float
    measured_makespan_s: float
    bubble_ratio: float
    dp_imbalance: float
    microbatches: float
    microbatch_imbalance: float

    def metrics(self) -> dict[str, float]:
        return {f"train/{name}": float(value) for name, value in self._asdict().items()}


class TrainStats(NamedTuple):
    """One optimizer step of the Actor and the Critic on one mini-batch (`Strategy.train_step`); without a
    Critic (critic-free algorithms) `critic_grad_norm` is None and neither loss/value nor critic/grad_norm is
    logged."""

    loss: LossStats
    actor_grad_norm: float
    critic_grad_norm: float | None
    lr: float
    # pipelined strategies only
    pipeline: PipelineStats | None = None

    def metrics(self) -> dict[str, float]:
        loss = self.loss.metrics()
        critic = {}
        if self.critic_grad_norm is None:
            del loss["loss/value"]
        else:
            critic["critic/grad_norm"] = self.critic_grad_norm
        return {
            **loss,
            "actor/grad_norm": self.actor_grad_norm,
            **critic,
            "lr": self.lr,
            **(self.pipeline.metrics() if self.pipeline is not None else {}),
        }


class GenerationStats(NamedTuple):
    """What a multi-instance generator measured in its last rollout: the migration it did (Rt, samples moved,
    destination instances), the running decode batch size and token rate over every instance, what
    migration=auto predicted for this batch before generating it (None for other policies), and with
    generator.speculative=ngram|auto (None when off, so not logged): the fraction of drafted tokens accepted
    and the tokens a running sample gained per decode step (1.0 = no gain)."""

    threshold: float
    samples_moved: float
    destinations: float
    batch_size_p50: float
    tokens_per_s: float
    predicted_gen_inf_s: float | None = None
    predicted_serial_s: float | None = None
    spec_accept_rate: float | None = None
    spec_tokens_per_step: float | None = None
    # migration=auto's check against measurement after this batch: the median measured seconds over the
    # simulator's serial prediction of migrating (Rt > 0) and of Rt = 0 batches (None until measured)
    measured_migrating: float | None = None
    measured_serial: float | None = None

    def metrics(self) -> dict[str, float]:
        predicted = {}
        if self.predicted_gen_inf_s is not None and self.predicted_serial_s is not None:
            predicted = {
                "migration/predicted_gen_inf_s": self.predicted_gen_inf_s,
                "migration/predicted_serial_s": self.predicted_serial_s,
            }
        for key, value in (
            ("migration/measured_migrating", self.measured_migrating),
            ("migration/measured_serial", self.measured_serial),
        ):
            if value is not None:
                predicted[key] = value
        speculative = {}
        if self.spec_accept_rate is not None and self.spec_tokens_per_step is not None:
            speculative = {
                "generation/spec_accept_rate": self.spec_accept_rate,
                "generation/spec_tokens_per_step": self.spec_tokens_per_step,
            }
        return {
            **predicted,
            **speculative,
            "migration/threshold": self.threshold,
            "migration/samples_moved": self.samples_moved,
            "migration/destinations": self.destinations,
            "generation/batch_size_p50": self.batch_size_p50,
            "generation/tokens_per_s": self.tokens_per_s,
        }


class DynamicSamplingStats(NamedTuple):
    """What dynamic sampling (`data.oversample`, `rlhfuse.trainer.rollout.DynamicSampling`) did in one rollout:
    the prompt groups it generated, those it dropped (every sample scored alike), the tokens it generated for
    them (the price of the full batch, on top of the batch's own), and its rounds of generation."""

    groups_sampled: float
    groups_dropped: float
    extra_tokens: float
    rounds: float

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/groups_sampled": self.groups_sampled,
            "rollout/groups_dropped": self.groups_dropped,
            "rollout/extra_tokens": self.extra_tokens,
            "rollout/sampling_rounds": self.rounds,
        }


class RolloutStats(NamedTuple):
    """One rollout (generation + inference, `RolloutStage.run`): seconds spent generating and inferring, the
    span from the first decode step to the last inference output (the span inter-stage fusion shortens; None
    for a generator without instances), the generator's own statistics, and dynamic sampling's (None when
    off, so not logged). Generated ahead (asynchronous RL), `generation_s` is the background generation's
    seconds, overlapped with training."""

    generation_s: float
    inference_s: float
    generation_inference_s: float | None = None
    generation: GenerationStats | None = None
    sampling: DynamicSamplingStats | None = None
    wait_s: float | None = None
    """Generated ahead of training (asynchronous RL): the seconds the trainer waited for the batch (None when
    generation does not run ahead)."""

    def metrics(self) -> dict[str, float]:
        out = {"time/generation": self.generation_s, "time/inference": self.inference_s}
        if self.wait_s is not None:
            out["async/wait_s"] = self.wait_s
        if self.generation_inference_s is not None:
            out["time/generation_inference"] = self.generation_inference_s
        if self.generation is not None:
            out.update(self.generation.metrics())
        if self.sampling is not None:
            out.update(self.sampling.metrics())
        return out


def sampler_mismatch(experience: Experience) -> dict[str, float]:
    """How far the trainer's log-probs of the rollout's tokens (`experience.logprobs_BR`, the Actor's
    recomputation) are from the sampler's (`rollout.sampler_logprobs_BR`), over every response token:
    `rollout/logprob_abs_diff` (mean) and `rollout/logprob_abs_diff_max` of |sampler - trainer|, and
    `rollout/mismatch_kl`, the k3 estimate of KL(sampler || trainer) from the sampled tokens, mean of
    exp(-d) - 1 + d with d = sampler - trainer (>= 0; 0 when they agree bit for bit). Empty when the generator
    recorded no log-probs. One host read."""
    sampled_BR = experience.rollout.sampler_logprobs_BR
    if sampled_BR is None:
        return {}
    device = experience.logprobs_BR.device
    d_BR = sampled_BR.to(device) - experience.logprobs_BR
    d_N = d_BR[experience.rollout.loss_mask_BR.to(device).bool()].double()
    if d_N.numel() == 0:
        return {}
    mean, most, kl = torch.stack(
        (d_N.abs().mean(), d_N.abs().max(), (torch.expm1(-d_N) + d_N).mean())
    ).tolist()
    return {"rollout/logprob_abs_diff": mean, "rollout/logprob_abs_diff_max": most, "rollout/mismatch_kl": kl}


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """What a rollout's multi-turn episodes did (`Rollout.episodes_BE`, `rlhfuse.agents`), per episode:
    `agent/turns_mean` and `agent/turns_p99` (assistant turns), `agent/tool_calls` and `agent/tool_errors` (tool
    calls answered, and those answered with an error; mean), `agent/tool_seconds` (seconds its tool calls ran,
    mean), `agent/truncated` (the share ended at the trajectory's token bound), `agent/model_tokens` and
    `agent/env_tokens` (the trajectory's response tokens the model sampled, and those the environment and its
    tools wrote; mean). Empty without episodes. One host read."""
    if rollout.episodes_BE is None:
        return {}
    model_B = rollout.loss_mask_BR.sum(dim=1)
    env_B = rollout.response_mask_BR.sum(dim=1) - model_B
    table_BE = torch.cat(
        (rollout.episodes_BE.double().cpu(), torch.stack((model_B, env_B), dim=1).double().cpu()), dim=1
    )
    column = dict(zip((*EPISODE_COLUMNS, "model_tokens", "env_tokens"), table_BE.unbind(dim=1), strict=True))
    means = {f"agent/{name}": float(values.mean()) for name, values in column.items() if name != "turns"}
    turns_B = column["turns"]
    return {
        "agent/turns_mean": float(turns_B.mean()),
        "agent/turns_p99": float(torch.quantile(turns_B, 0.99)),
        **means,
    }


def staleness(experience: Experience, trained_version: int, bound: int) -> dict[str, float]:
    """How many Actor versions behind the trained one (`trained_version`: iterations trained before this one)
    the rollout's tokens were sampled (`rollout.versions_BR`), over every response token: `async/staleness_mean`,
    `async/staleness_max`, and `async/staleness_<s>`, the share of tokens `s` versions old, for s = 0..`bound`
    (the histogram). Empty when the rollout records no versions (a synchronous run). One host read."""
    versions_BR = experience.rollout.versions_BR
    if versions_BR is None:
        return {}
    mask_BR = experience.rollout.loss_mask_BR.to(versions_BR.device).bool()
    age_N = (trained_version - versions_BR[mask_BR]).double().cpu()
    if age_N.numel() == 0:
        return {}
    out = {"async/staleness_mean": float(age_N.mean()), "async/staleness_max": float(age_N.max())}
    for s in range(bound + 1):
        out[f"async/staleness_{s}"] = float((age_N == s).double().mean())
    return out
