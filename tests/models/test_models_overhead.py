"""The overhead cuts of the forward (issue 46) give the same bits as the code they replace: the rotary tables
laid out once per call (`apply_rotary`) against `apply_rope`, forward and backward; the packing's windows and the
rotary frequencies made once; the KV cache's block reads by index_select."""

from __future__ import annotations

import pytest
import torch

from rlhfuse.models.cache import KVCache
from rlhfuse.models.model_config import ModelConfig
from rlhfuse.models.packing import pack_rows, packed_forward
from rlhfuse.models.transformer import Transformer, apply_rope, apply_rotary, rotary_tables


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rotary", [32, 24])
def test_apply_rotary_matches_apply_rope_bit_for_bit(dtype: torch.dtype, rotary: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x_BTHE = (torch.randn(3, 7, 4, 32, generator=gen) * 3).to(dtype)
    x_BTHE[0, 0] = 0.0
    x_BTHE[0, 1] = -0.0
    angles_BTe = torch.randn(3, 7, rotary // 2, generator=gen) * 40
    angles_BTe[1, :2] = 0.0
    cos_BTe, sin_BTe = angles_BTe.cos().to(dtype), angles_BTe.sin().to(dtype)
    grad_BTHE = torch.randn(3, 7, 4, 32, generator=gen).to(dtype)

    outs, grads = [], []
    for rotate in (
        lambda x: apply_rope(x, cos_BTe[:, :, None], sin_BTe[:, :, None]),
        lambda x: apply_rotary(x, *rotary_tables(cos_BTe, sin_BTe)),
    ):
        leaf = x_BTHE.clone().requires_grad_(True)
        out = rotate(leaf * 1)  # a non-leaf input, as the projections' outputs are
        out.backward(grad_BTHE)
        outs.append(out)
        grads.append(leaf.grad)
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))
    assert grads[0] is not None and grads[1] is not None
    assert torch.equal(_bits(grads[0]), _bits(grads[1]))


def test_a_packing_answers_each_window_once_and_stays_itself_on_its_device() -> None:
    packed = pack_rows(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]))
    first = packed.window(1, 3)
    assert packed.window(1, 3) is first
    assert packed.to("cpu") is packed
    with torch.inference_mode():
        made_in_inference = packed.window(1, 3)
    assert made_in_inference is not first  # autograd cannot save inference tensors: grad mode keeps its own
    assert all(torch.equal(a, b) for a, b in zip(first[:2], made_in_inference[:2], strict=True))


def test_a_model_first_run_under_inference_mode_still_trains() -> None:
    """The cached rotary frequencies and windows made under inference_mode do not reach autograd."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny())
    ids_BT = torch.randint(0, 128, (2, 6))
    mask_BT = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    packed = pack_rows(mask_BT)
    with torch.inference_mode():
        expected = packed_forward(model, ids_BT, mask_BT, start=1, stop=5, packed=packed)
    out = packed_forward(model, ids_BT, mask_BT, start=1, stop=5, packed=packed)
    out.square().sum().backward()
    assert torch.equal(out.detach(), expected)
    assert model.embed_tokens.weight.grad is not None


def test_kv_cache_reads_the_blocks_advanced_indexing_reads() -> None:
    config = ModelConfig.tiny()
    cache = KVCache.allocate(config, num_slots=3, max_len=20, block_size=4)
    gen = torch.Generator().manual_seed(0)
    for pools in (cache.k_layers, cache.v_layers):
        for pool in pools:
            pool.copy_(torch.randn(pool.shape, generator=gen))
    call = cache.begin([2, 0], 9)
    k_BHSD, v_BHSD = cache.keys_values(1, call)
    for got, pool in ((k_BHSD, cache.k_layers[1]), (v_BHSD, cache.v_layers[1])):
        x_BMKHD = pool[call.read_blocks_BM]
        want = x_BMKHD.reshape(2, -1, *x_BMKHD.shape[3:])[:, : call.num_keys].transpose(1, 2)
        assert torch.equal(got, want) and got.stride() == want.stride()
