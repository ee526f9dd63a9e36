"""Checkpoints of the families past LLaMA, made with transformers' own classes (random weights), train GRPO from
the CLI's `experiment=hf_local` and export an `actor_hf/` folder transformers loads with the family's class."""

import json

import pytest
import torch

from rlhfuse.models import from_pretrained
from rlhfuse.models.config import ARCHITECTURES
from rlhfuse.trainer import build_trainer, compose_config

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "qwen3": {"head_dim": 16},
    # the prompt and response (~12 tokens) run past the window: the windowed mask is exercised in training,
    # inference and generation
    "mistral": {"sliding_window": 4},
    "qwen2": {
        "num_hidden_layers": 2,
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 1,
    },
    # fused qkv / gate_up weights split on load and joined on export; half the channels rotated
    "phi3": {"partial_rotary_factor": 0.5, "head_dim": 16},
    # GeGLU, sandwich norms, scaled embeddings, soft-capped scores and logits, alternating windowed layers
    "gemma2": {
        "head_dim": 16,
        "num_hidden_layers": 2,
        "sliding_window": 4,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 10.0,
    },
    # q/k norms, a local rope base on the windowed layer, linear scaling on the global one
    "gemma3_text": {
        "head_dim": 16,
        "num_hidden_layers": 2,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    # mixtures of 4 experts, 2 per token; Qwen3-MoE's second layer dense
    "qwen3_moe": {
        "head_dim": 16,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
}


def distinct_tokens(samples):
    """A score that differs between a random model's samples: the share of distinct tokens in the response."""
    return [len(set(s.response_ids)) / max(len(s.response_ids), 1) for s in samples]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_checkpoint_trains_grpo_and_exports(tmp_path, chat_checkpoint_of, family):
    sft = chat_checkpoint_of(family, **FAMILIES[family]).path
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "7 + 5 ="}], "answer": "12"}] * 2
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_config(
        [
            "experiment=hf_local",
            "algorithm=grpo",
            f"model.sft_path={sft}",
            f"data.path={prompts}",
            "data.max_prompt_length=16",
            "data.prompts_per_iteration=2",
            "data.samples_per_prompt=2",
            "data.mini_batch_size=4",
            "data.micro_batch_size=2",
            "inferencer.use_reward_model=false",
            "generator.max_new_tokens=8",
            "checkpoint.export_hf=true",
            "iterations=2",
            "logger=quiet",
        ]
    )
    cfg.inferencer.reward_fn = distinct_tokens
    trainer = build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)
    rows_out = trainer.fit()
    assert len(rows_out) == 2 and all(r["actor/grad_norm"] > 0 for r in rows_out)
    folder = tmp_path / "run" / "actor_hf"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf_model).__name__ == f"{ARCHITECTURES[family].hf_prefix}ForCausalLM"
    exported = from_pretrained(folder).eval()
    assert exported.config.architecture == family
    assert exported.config.windows == ({4} if "sliding_window" in FAMILIES[family] else set())
    trained = {n: p for n, p in exported.named_parameters()}
    start = dict(from_pretrained(sft).named_parameters())
    assert any(not torch.equal(trained[n], start[n]) for n in start), "two GRPO iterations moved the weights"
    ids_BT = torch.randint(0, exported.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids_BT), hf_model(ids_BT).logits, atol=1e-5, rtol=0)
