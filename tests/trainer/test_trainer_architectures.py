"""Checkpoints of the families past LLaMA, made with transformers' own classes (random weights), train GRPO from
the CLI's `experiment=hf_local` and export an `actor_hf/` folder transformers loads with the family's class."""

import json
from pathlib import Path

import pytest
import torch
from rlhfuse_test_rewards import distinct_tokens

from rlhfuse.models import from_pretrained
from rlhfuse.models.model_config import ARCHITECTURES
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_checkpoint_trains_grpo_and_exports(tmp_path, chat_checkpoint_of, hf_local_grpo, family):
    sft = chat_checkpoint_of(family, **FAMILIES[family]).path
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "7 + 5 ="}], "answer": "12"}] * 2
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = ["data.micro_batch_size=2", "generator.max_new_tokens=8", "iterations=2"]
    cfg = compose_config(hf_local_grpo(sft, prompts, *overrides))
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


def test_the_load_balancing_loss_trains_a_mixture_of_experts_actor(tmp_path, chat_checkpoint_of):
    """pipeline.router_aux_loss_coef adds the load-balancing loss to the Actor's: logged as loss/router_aux
    (2 when 2-of-4 routing is uniform), and it changes the router's update."""
    sft = chat_checkpoint_of("qwen3_moe", **FAMILIES["qwen3_moe"]).path
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "7 + 5 ="}], "answer": "12"}) + "\n"
    )
    routers = {}
    for coef in (0.0, 5.0):
        cfg = compose_config(
            [
                "experiment=hf_local", "algorithm=grpo", f"model.sft_path={sft}", f"data.path={prompts}",
                "data.max_prompt_length=16", "data.prompts_per_iteration=1", "data.samples_per_prompt=4",
                "data.mini_batch_size=4", "data.micro_batch_size=2", "inferencer.use_reward_model=false",
                "generator.max_new_tokens=6", "iterations=1", "logger=quiet", "pipeline.actor_lr=1e-2",
                f"pipeline.router_aux_loss_coef={coef}",
            ]
        )  # fmt: skip
        cfg.inferencer.reward_fn = distinct_tokens
        trainer = build_trainer(cfg, run_dir=tmp_path / f"run{coef}", log=lambda _: None)
        (row,) = trainer.fit()
        assert ("loss/router_aux" in row) == (coef > 0)
        if coef > 0:
            assert 1.0 < row["loss/router_aux"] < 8.0
        routers[coef] = trainer.strategy.actor.layers[0].mlp.gate.weight.detach().clone()
    assert not torch.equal(routers[0.0], routers[5.0])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["pipeline=fused"], r"pipeline.router_aux_loss_coef=0.01: the load-balancing loss is added under"),
        (
            [],
            r"pipeline.router_aux_loss_coef=0.01: the Actor \(the embedded model\) has no mixture-of-experts",
        ),
    ],
)
def test_a_load_balancing_loss_it_cannot_add_is_refused_naming_the_key(overrides, message):
    from rlhfuse.trainer.validate import validate

    with pytest.raises(ValueError, match=message):
        validate(compose_config(["pipeline.router_aux_loss_coef=0.01", *overrides]))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_mixture_of_experts_trains_tensor_parallel_from_the_cli(
    tmp_path, chat_checkpoint_of, hf_local_grpo
):
    """Qwen3-MoE under pipeline=serial_1f1b with actor_tp=2 and generator.tp=2 on 2 processes: every expert split
    over its width (training, pipeline inference, tp-sharded generation), sharded checkpoints, and the export
    reassembled from the shards, loadable by transformers."""
    import os
    import subprocess
    import sys

    # an untied LM head: a tied one is not split tensor-parallel
    sft = chat_checkpoint_of("qwen3_moe", **FAMILIES["qwen3_moe"], tie_word_embeddings=False).path
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(2 * (json.dumps({"prompt": "7 + 5 =", "answer": "12"}) + "\n"))
    layout = ["pipeline=serial_1f1b", "pipeline.actor_tp=2", "pipeline.actor_pp=1", "generator.tp=2",
              "distributed.nproc_per_node=2", "distributed.timeout_s=60", "checkpoint.every=2"]  # fmt: skip
    job = hf_local_grpo(sft, prompts, "data.micro_batch_size=2", "generator.max_new_tokens=6", "iterations=2")
    job += [
        "inferencer.reward_fn=rlhfuse_test_rewards:distinct_tokens",
        f"run_dir={tmp_path / 'run'}",
        *layout,
    ]
    here = str(Path(__file__).parent)  # rlhfuse_test_rewards
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", *job]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["actor/grad_norm"] > 0 for r in rows)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "iter_00000002").iterdir()) == [
        "meta.json", "rank_00000", "rank_00001"
    ]  # fmt: skip
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor_hf")
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    start = dict(from_pretrained(sft).named_parameters())
    trained = dict(from_pretrained(tmp_path / "run" / "actor_hf").named_parameters())
    moved = [n for n in start if not torch.equal(trained[n], start[n])]
    assert any(".experts." in n for n in moved) and any(".mlp.gate." in n for n in moved)
