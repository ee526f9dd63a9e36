"""LoRA adapters through peft on the project's own `Transformer` (rlhfuse.models.lora), against transformers +
peft in float64: the adapter folder `save_adapter` writes loads with `peft.PeftModel.from_pretrained` onto the
base checkpoint and computes the same logits; the merged model equals the adapted one; the adapters switched off
give the base model back. Legend: B batch rows, T tokens, V vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import HF_COMMON, exact_norms_, float64_softmax, randomize_, write_hf

from rlhfuse.models import CheckpointError, from_pretrained, save_pretrained
from rlhfuse.models.lora import (
    ADAPTER_WEIGHTS,
    LoraConfig,
    adapter_state,
    adapters_disabled,
    apply_lora,
    load_trained_state,
    merged_model,
    merged_state,
    merged_weights,
    save_adapter,
    trained_state,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SMALL = {**HF_COMMON, "max_position_embeddings": 32}
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attention_bias=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=4)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=4, query_pre_attn_scalar=16)
    ),
}


def _checkpoint(tmp_path, family: str):
    torch.manual_seed(0)
    hf = FAMILIES[family]().double().eval()
    randomize_(hf, seed=1)
    return write_hf(hf, tmp_path / family)


def _random_adapters_(model: torch.nn.Module, seed: int) -> None:
    """B starts at 0 (the adapted model is the base); a trained adapter has B != 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))


IDS_BT = torch.tensor([[1, 5, 9, 2, 7, 3, 3, 8, 4, 6], [4, 4, 8, 1, 2, 9, 5, 7, 6, 2]])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_adapter_folder_loads_with_peft_and_computes_the_same_logits(tmp_path, family):
    path = _checkpoint(tmp_path, family)
    # Gemma 2's soft-capped scores need transformers' eager attention (as in test_architectures)
    attn = "eager" if family == "gemma2" else "sdpa"
    ours = from_pretrained(path, dtype=torch.float64).eval()
    base_BTV = ours(IDS_BT)
    config = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    apply_lora(ours, config)
    assert torch.equal(ours(IDS_BT), base_BTV), "B = 0 at the start: the adapted model is the base"
    _random_adapters_(ours, seed=2)
    adapted_BTV = ours(IDS_BT)
    assert (adapted_BTV - base_BTV).abs().max() > 1e-3

    folder = tmp_path / "adapter"
    save_adapter(adapter_state(ours), ours.config, config, folder, base=str(path))
    written = json.loads((folder / "adapter_config.json").read_text())
    assert (
        written["r"] == 4 and written["lora_alpha"] == 8.0 and written["base_model_name_or_path"] == str(path)
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation=attn
    )
    exact_norms_(hf)
    reference = peft.PeftModel.from_pretrained(hf.eval(), folder).eval()
    with torch.no_grad(), float64_softmax():
        hf_BTV = reference(IDS_BT).logits
    assert (adapted_BTV - hf_BTV).abs().max() <= 1e-10

    with adapters_disabled(ours):  # the Reference of a LoRA Actor
        assert (ours(IDS_BT) - base_BTV).abs().max() <= 1e-12
    merged = merged_model(ours)
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    assert (merged(IDS_BT) - adapted_BTV).abs().max() <= 1e-10
    # the same merge from the adapted model's tensors alone (what a sharded Actor's gathered state gives)
    from_tensors = merged_state(ours.state_dict(), config)
    assert from_tensors.keys() == merged.state_dict().keys()
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(from_tensors[name], tensor, rtol=0, atol=1e-14), name
    save_pretrained(merged, tmp_path / "merged")  # the merged export transformers loads as a plain model
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float64, attn_implementation=attn
    )
    exact_norms_(reloaded)
    with torch.no_grad(), float64_softmax():
        assert (reloaded.eval()(IDS_BT).logits - adapted_BTV).abs().max() <= 1e-10


def test_only_the_adapters_train_and_a_checkpoint_holds_only_them(tmp_path):
    ours = from_pretrained(_checkpoint(tmp_path, "llama"), dtype=torch.float64)
    apply_lora(ours, LoraConfig(rank=2))
    trained = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # 2 layers x 7 projections x (A, B)
    assert len(trained) == 2 * 7 * 2
    state = trained_state(ours)
    assert set(state) == set(trained)
    _random_adapters_(ours, seed=3)
    merged = merged_weights(ours)
    assert len(merged) == 14 and all(n.endswith("_proj.weight") and ".base_layer" not in n for n in merged)
    fresh = from_pretrained(tmp_path / "llama", dtype=torch.float64)
    apply_lora(fresh, LoraConfig(rank=2))
    load_trained_state(fresh, trained_state(ours))
    assert torch.equal(fresh(IDS_BT), ours(IDS_BT))
    with pytest.raises(CheckpointError, match=r"no LoRA adapter tensors.*model\.lora"):
        load_trained_state(fresh, from_pretrained(tmp_path / "llama").state_dict())


def test_a_model_without_adapters_passes_through():
    from rlhfuse.models import ModelConfig, Transformer

    model = Transformer(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16))
    assert trained_state(model).keys() == model.state_dict().keys()
    assert merged_weights(model).keys() == model.state_dict().keys()
    with adapters_disabled(model):
        pass
    with pytest.raises(ValueError, match="no LoRA adapters"):
        adapter_state(model)


def test_the_adapter_folder_is_written_whole(tmp_path):
    ours = from_pretrained(_checkpoint(tmp_path, "llama"))
    config = LoraConfig(rank=2)
    apply_lora(ours, config)
    folder = tmp_path / "out"
    save_adapter(adapter_state(ours), ours.config, config, folder, base="b")
    save_adapter(
        adapter_state(ours), ours.config, config, folder, base="b"
    )  # replaced whole, no temporary folder left beside it
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", ADAPTER_WEIGHTS]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_config_problems_and_refused_families():
    assert LoraConfig().problems() == []  # rank 0: off
    problems = LoraConfig(rank=-1).problems()
    assert problems and "model.lora.rank=-1" in problems[0]
    bad = LoraConfig(rank=4, alpha=0, dropout=1.0, target_modules=["qkv_proj"]).problems()  # type: ignore[list-item]
    assert len(bad) == 3 and "model.lora.target_modules=['qkv_proj']" in bad[2]
    from rlhfuse.models import ModelConfig, Transformer

    moe = ModelConfig(architecture="qwen3_moe", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"mixture-of-experts.*model\.lora\.rank=0"):
        apply_lora(Transformer(moe), LoraConfig(rank=2))
