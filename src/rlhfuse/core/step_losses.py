"""The losses of one micro-batch (policy: every algorithm; value: those with a Critic), shared by every Strategy (single-process and pipelined).

Both take a model's output over the whole sequence (prompt + response) and score the response positions:
the logits at position t predict token t+1, so the response's R tokens are predicted by positions
[T-R-1, T-1). Half-precision outputs are promoted to fp32; float64 stays float64 (exact parity tests).

Legend: B batch rows, T tokens (prompt + response), R response tokens, V vocabulary, M real tokens of a packed
micro-batch's response window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhfuse.algorithms import (
    entropy_from_logits,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    reduce_loss,
    value_loss,
)
from rlhfuse.algorithms.off_policy import Bounds, correct
from rlhfuse.core.advantages import POLICY_LOSSES, AlgorithmConfig
from rlhfuse.core.stats import LossTensors
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import Transformer
from rlhfuse.models.masks import MaskLayout
from rlhfuse.models.packing import pack_rows, packed_forward, scatter_rows


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def response_outputs(out_BT_: Tensor, micro: TrainBatch) -> Tensor:
    """The outputs at the positions that predict (logits) or value (values) the response tokens, in ≥ fp32."""
    start = micro.input_ids_BT.shape[1] - micro.response_length - 1
    return _at_least_fp32(out_BT_[:, start:-1])


def model_response_outputs(
    model: Transformer, micro: TrainBatch, *, packing: bool, layout: MaskLayout | None = None
) -> Tensor:
    """`response_outputs(model(micro), micro)`: logits_BRV or values_BR at the response-predicting positions.
    packing=True runs the model on the micro-batch's packed real tokens (and the head on those of the
    response window only); padded entries are then 0 instead of the padded forward's meaningless values.
    layout: the micro-batch's mask layout on the model's device, worked out on the host (`mask_layout`): the
    forward then reads no mask value; None: it reads them."""
    if not packing:
        padding = None if layout is None else layout.padding
        logits = model(micro.input_ids_BT, attention_mask_BT=micro.attention_mask_BT, padding=padding)
        return response_outputs(logits, micro)
    width = micro.input_ids_BT.shape[1]
    out = packed_forward(
        model,
        micro.input_ids_BT,
        micro.attention_mask_BT,
        start=width - micro.response_length - 1,
        stop=width - 1,
        packed=None if layout is None else layout.packed,
    )
    return _at_least_fp32(out)


def packed_response_rows(
    model: Transformer, micro: TrainBatch, layout: MaskLayout | None = None
) -> tuple[Tensor, Tensor]:
    """`model_response_outputs(packing=True)` left packed: the outputs (logits_MV or values_M, in ≥ fp32) at the
    M real tokens of the response-predicting window, and their flat index b·R + r in [B, R] (`dest_M`); nothing
    of size B·R·V is made. layout: as for `model_response_outputs`."""
    width = micro.input_ids_BT.shape[1]
    packed = pack_rows(micro.attention_mask_BT) if layout is None or layout.packed is None else layout.packed
    picked_M, dest_M, _ = packed.window(width - micro.response_length - 1, width - 1)
    return _at_least_fp32(model.packed_outputs(packed.pack(micro.input_ids_BT), packed, picked_M)), dest_M


LogprobsFn = Callable[[Tensor, Tensor, float], Tensor]  # (logits, ids, temperature) -> log-probs
EntropyFn = Callable[[Tensor], Tensor]  # logits -> entropy per position


def actor_loss(
    logits_BTV: Tensor,
    micro: TrainBatch,
    algorithm: AlgorithmConfig,
    temperature: float = 1.0,
    *,
    logprobs_fn: LogprobsFn | None = None,
    entropy_fn: EntropyFn | None = None,
) -> tuple[Tensor, LossTensors]:
    """The configured policy loss (`algorithm.policy_loss`: `POLICY_LOSSES`) (+ entropy bonus when
    `algorithm.entropy_coef`, + β·KL(π_θ ‖ π_ref) when `algorithm.kl_loss_coef` = β > 0, the KL estimated per
    token and reduced like the policy loss) and its statistics. logprobs_fn / entropy_fn replace the read-outs of
    the full logits (the tensor-parallel runtime passes vocabulary-parallel ones over its slice of the logits)."""
    return response_actor_loss(
        response_outputs(logits_BTV, micro),
        micro,
        algorithm,
        temperature,
        logprobs_fn=logprobs_fn,
        entropy_fn=entropy_fn,
    )


def response_actor_loss(
    logits_BRV: Tensor,
    micro: TrainBatch,
    algorithm: AlgorithmConfig,
    temperature: float = 1.0,
    *,
    logprobs_fn: LogprobsFn | None = None,
    entropy_fn: EntropyFn | None = None,
    dest_M: Tensor | None = None,
) -> tuple[Tensor, LossTensors]:
    """`actor_loss` from the response-predicting logits [B, R, V] alone (`model_response_outputs`), or, with
    dest_M, from a packed forward's logits [M, V] at the real rows of the response window alone
    (`packed_response_rows`): the log-probs and entropies are then worked out on those M rows and placed in
    [B, R] (0 at padding, which every term masks out), never on the padded B·R rows."""
    logits_BRV = _at_least_fp32(logits_BRV)  # [M, V] with dest_M
    response_ids_BR = micro.input_ids_BT[:, micro.input_ids_BT.shape[1] - micro.response_length :]
    entropy_from = entropy_fn or entropy_from_logits

    def placed(x: Tensor) -> Tensor:
        return x if dest_M is None else scatter_rows(x, dest_M, *response_ids_BR.shape)

    ids = response_ids_BR if dest_M is None else response_ids_BR.reshape(-1)[dest_M]
    if logprobs_fn is None:
        logprobs_BR = placed(logprobs_from_logits(logits_BRV, ids, temperature=temperature))
    else:
        logprobs_BR = placed(logprobs_fn(logits_BRV, ids, temperature))
    advantages_BR, mask_BR, corrected = micro.advantages_BR, micro.response_mask_BR, {}
    if micro.behaviour_logprobs_BR is not None:  # the sampler's policy corrected for (off_policy_correction)
        weight_BR, keep_BR, weight, changed = correct(
            algorithm.off_policy_correction, micro.old_logprobs_BR, micro.behaviour_logprobs_BR, mask_BR,
            Bounds(algorithm.is_cap, algorithm.is_low, algorithm.is_high),
        )  # fmt: skip
        advantages_BR, mask_BR = advantages_BR * weight_BR, mask_BR * keep_BR
        corrected = {"is_weight_mean": weight, "corrected_fraction": changed}
    loss, pstats = POLICY_LOSSES[algorithm.policy_loss].loss(
        logprobs_BR, micro.old_logprobs_BR, advantages_BR, mask_BR, algorithm
    )
    kl_loss: dict[str, Tensor] = {}
    if algorithm.kl_loss_coef > 0:
        assert micro.ref_logprobs_BR is not None, (
            "compute_train_batch keeps ref log-probs when kl_loss_coef > 0"
        )
        kl_BR = kl_estimate(logprobs_BR, micro.ref_logprobs_BR, kind=algorithm.kl_loss_estimator)
        kl_term = reduce_loss(
            kl_BR, micro.response_mask_BR != 0, algorithm.loss_reduction, algorithm.constant_length
        )
        loss = loss + algorithm.kl_loss_coef * kl_term
        kl_loss = {"kl_loss": kl_term}
    # one entropy pass: with the bonus its values are the statistic's too
    entropy_BR = placed(entropy_from(logits_BRV if algorithm.entropy_coef else logits_BRV.detach()))
    entropy = masked_mean(entropy_BR.detach(), micro.response_mask_BR)
    if algorithm.entropy_coef:
        loss = loss - algorithm.entropy_coef * masked_mean(entropy_BR, micro.response_mask_BR)
    # statistics stay on the device (no host sync per micro-batch): the step reads them once
    return loss, LossTensors.of(
        loss,
        policy_loss=loss,
        clip_fraction=pstats.clip_fraction,
        clip_fraction_low=pstats.clip_fraction_low,
        clip_fraction_high=pstats.clip_fraction_high,
        approx_kl=pstats.approx_kl,
        entropy=entropy,
        **kl_loss,
        **corrected,
    )


def critic_loss(
    values_BT: Tensor, micro: TrainBatch, algorithm: AlgorithmConfig
) -> tuple[Tensor, LossTensors]:
    """Clipped value loss on the response positions."""
    return response_critic_loss(response_outputs(values_BT, micro), micro, algorithm)


def response_critic_loss(
    values_BR: Tensor, micro: TrainBatch, algorithm: AlgorithmConfig
) -> tuple[Tensor, LossTensors]:
    """`critic_loss` from the values at the response positions [B, R] alone (`model_response_outputs`)."""
    loss, _ = value_loss(
        _at_least_fp32(values_BR),
        micro.old_values_BR,
        micro.returns_BR,
        micro.response_mask_BR,
        clip_eps=algorithm.value_clip_eps,
        reduction=algorithm.loss_reduction,
        constant_length=algorithm.constant_length,
    )
    return loss, LossTensors.of(loss, value_loss=loss)
