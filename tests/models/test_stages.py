"""split_stages: chained stages equal the whole model, share its parameters, and balance layer costs.

Legend: B batch rows, T tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from rlhfuse.models import ModelConfig, Transformer, split_stages
from rlhfuse.models.stages import balanced_ranges


def chain(stages, input_ids_BT, mask_BT):
    x = input_ids_BT
    for stage in stages:
        x = stage(x, attention_mask_BT=mask_BT)
    return x


# Qwen3 with q/k norms and windows of 2 keys on layers 1 and 3: each stage builds its windowed masks itself
QWEN3_WINDOWED = dict(
    architecture="qwen3", sliding_window=2, layer_types=("full_attention", "sliding_attention") * 2
)


# Qwen3-MoE: 4 experts, 2 per token, in layers 0 and 2 (1 and 3 dense)
QWEN3_MOE = dict(architecture="qwen3_moe", num_experts=4, moe_intermediate_size=32, decoder_sparse_step=2)
QWEN3_MOE["mlp_only_layers"] = (1, 3)


@pytest.mark.parametrize(
    "head,checkpointed,family",
    [
        ("lm", False, {}),
        ("value", False, {}),
        ("lm", True, {}),
        ("lm", "selective", QWEN3_WINDOWED),
        ("lm", True, QWEN3_MOE),
    ],
)
def test_chained_stages_equal_model_outputs_and_gradients(head, checkpointed, family):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(num_layers=4, **family), head=head)
    input_ids_BT = torch.randint(0, 128, (2, 6))
    mask_BT = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    stages = split_stages(model, 3)
    assert [s.layer_range for s in stages] == [(0, 2), (2, 3), (3, 4)]
    expected = model(input_ids_BT, attention_mask_BT=mask_BT)
    expected.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # activation checkpointing recomputes the same layers in backward: same outputs, same gradients
    model.activation_checkpointing = checkpointed
    calls = []
    # the first op of a layer: recomputation may stop early, before a later op or the layer itself returns
    model.layers[2].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    got = chain(stages, input_ids_BT, mask_BT)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    got.square().sum().backward()
    assert len(calls) == (2 if checkpointed is True else 1), "checkpointed layers run again in backward"
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=0, rtol=0, msg=name)


def test_stages_share_parameters_and_cover_model_once():
    model = Transformer(ModelConfig.tiny(num_layers=5, tie_word_embeddings=True))
    stages = split_stages(model, 2)
    model_ptrs = {p.data_ptr() for p in model.parameters()}
    stage_ptrs = [p.data_ptr() for s in stages for p in s.parameters()]
    assert set(stage_ptrs) == model_ptrs
    assert stages[0].layer_range[0] == 0 and stages[-1].layer_range[1] == 5
    assert stages[0].layer_range[1] == stages[1].layer_range[0]
    assert stages[0].embed_tokens is model.embed_tokens and stages[1].embed_tokens is None
    assert stages[1].norm is model.norm and stages[0].norm is None


def test_layer_costs_balance_ranges():
    # the heavy last layer gets a stage of its own; equal costs split evenly, leftovers to the earlier stages
    assert balanced_ranges([1] * 5, 2) == [(0, 3), (3, 5)]
    assert balanced_ranges([1, 1, 1, 1, 4], 2) == [(0, 4), (4, 5)]
    assert balanced_ranges([1] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert balanced_ranges([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    model = Transformer(ModelConfig.tiny(num_layers=4))
    assert [s.layer_range for s in split_stages(model, 2, layer_costs=[3, 1, 1, 1])] == [(0, 1), (1, 4)]


def test_bad_stage_counts_are_refused():
    model = Transformer(ModelConfig.tiny())
    with pytest.raises(ValueError, match="num_stages=3 must be between 1 and the model's num_layers=2"):
        split_stages(model, 3)
    with pytest.raises(ValueError, match="layer_costs needs 2 non-negative numbers"):
        split_stages(model, 2, layer_costs=[1.0])
