"""Activation checkpointing (pipeline.activation_checkpointing=none|full|selective): identical gradients, padded
and packed, whole model and chained stages; less memory saved for backward; unknown modes name the key."""

from __future__ import annotations

import pytest
import torch

from rlhfuse.core.optim import OptimConfig
from rlhfuse.models import ModelConfig, Transformer, split_stages
from rlhfuse.models.packing import packed_forward
from rlhfuse.models.transformer import AttentionContext, run_layers

MODES = ("none", "full", "selective")


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(num_layers=3, vocab_size=64), head="lm").double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [1] * 8, [0, 0, 0, 0, 0, 1, 1, 1]])
    return ids, mask


def _grads_and_saved_bytes(model, mode, packing):
    model.zero_grad()
    model.activation_checkpointing = mode
    ids, mask = _batch()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size() if not isinstance(t, torch.nn.Parameter) else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = packed_forward(model, ids, mask) if packing else model(ids, attention_mask_BT=mask)
        loss = (out * mask[..., None]).square().sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("packing", [False, True])
def test_every_mode_gives_identical_gradients_and_saves_less(packing):
    model = _model()
    grads, saved = {}, {}
    for mode in MODES:
        grads[mode], saved[mode] = _grads_and_saved_bytes(model, mode, packing)
    for mode in ("full", "selective"):
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], grad, atol=0, rtol=0, msg=f"{mode}: {name}")
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_selective_recomputes_attention_and_mlp_but_not_projections():
    model = _model()
    model.activation_checkpointing = "selective"
    calls = {"mlp": 0, "q_proj": 0}
    layer = model.layers[1]
    layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
    layer.self_attn.q_proj.register_forward_pre_hook(
        lambda *_: calls.__setitem__("q_proj", calls["q_proj"] + 1)
    )
    ids, mask = _batch()
    model(ids, attention_mask_BT=mask).sum().backward()
    assert calls == {"mlp": 2, "q_proj": 1}
    with torch.no_grad():  # inference: nothing recomputed
        model(ids, attention_mask_BT=mask)
    assert calls == {"mlp": 3, "q_proj": 2}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_chained_stages_checkpoint_like_the_model(mode):
    model = _model()
    ids, mask = _batch()
    expected, _ = _grads_and_saved_bytes(model, "none", packing=False)
    model.zero_grad()
    model.activation_checkpointing = mode
    x = ids
    for stage in split_stages(model, 2):
        x = stage(x, attention_mask_BT=mask)
    (x * mask[..., None]).square().sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], atol=0, rtol=0, msg=name)


def test_an_unknown_mode_names_the_key():
    problems = OptimConfig(activation_checkpointing="everything").problems()  # type: ignore[arg-type]
    assert any("pipeline.activation_checkpointing" in p and "selective" in p for p in problems), problems
    ctx = AttentionContext(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), None)
    with pytest.raises(ValueError, match=r"activation_checkpointing='everything' is unknown.*selective"):
        run_layers(torch.nn.ModuleList(), torch.zeros(1, 1, 4), ctx, checkpointed="everything")  # type: ignore[arg-type]


def test_the_trainer_config_refuses_an_unknown_mode():
    from rlhfuse.trainer import compose_config, validate

    with pytest.raises(ValueError, match=r"pipeline\.activation_checkpointing='bogus' is not one of"):
        validate(compose_config(["pipeline.activation_checkpointing=bogus"]))
