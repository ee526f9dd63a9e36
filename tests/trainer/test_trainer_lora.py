"""LoRA (model.lora) in the trainer: the Actor trains its adapters only, the Reference is the Actor with them
switched off (no Ref copy), the generators' plain copy holds the merged weights, a checkpoint holds the adapters
and resumes bit-identically, and `actor_hf/` is a PEFT adapter folder that peft loads onto the SFT checkpoint
(with the merged model beside it on request). On the Actor pipeline (serial_1f1b, fused; 2 gloo ranks) the
adapters ride on the stages and train as under plain, the weight sync sends the merged projections, the stage
shards hold the adapters and resume bit-identically. Refused, with the key, where it does not run."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhfuse.models.convert import is_converted, real_model_dir
from rlhfuse.models.lora import merged_model
from rlhfuse.trainer import build_trainer, compose_config, validate

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "pipeline.actor_lr=1e-2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warm")


def smoke(cache, *extra):
    return compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache}", *extra])


def quiet(_: str) -> None:
    pass


def test_a_lora_actor_trains_its_adapters_against_itself_as_the_reference(tmp_path, cache):
    full = build_trainer(smoke(cache, "iterations=1"), run_dir=tmp_path / "full", log=quiet)
    full_row = full.fit()[-1]
    cfg = smoke(cache, *LORA, "iterations=2", "checkpoint.export_hf=true", "model.lora.export_merged=true")
    trainer = build_trainer(cfg, run_dir=tmp_path / "run", log=quiet)
    actor = trainer.strategy.actor
    assert trainer.inferencer.ref is actor  # no Ref copy: the Actor with its adapters off
    base = {n: p.detach().clone() for n, p in actor.named_parameters() if ".lora_" not in n}
    rows = trainer.fit()
    assert len(rows) == 2 and all(r["actor/grad_norm"] > 0 for r in rows)
    # the first iteration's Actor is the SFT model (B = 0): its log-probs equal the Reference's, KL is 0
    assert rows[0]["kl/mean"] == 0.0 and rows[1]["kl/mean"] != 0.0
    for name, param in actor.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(param, base[name]), f"{name} is frozen"
    assert any(p.abs().max() > 0 for n, p in actor.named_parameters() if ".lora_B" in n)
    # the generator's plain copy holds the merged weights after the last weight sync
    merged = merged_model(actor).state_dict()
    copy = trainer.generator.actor_copies()[0].state_dict()
    assert copy.keys() == merged.keys() and all(torch.equal(copy[k], merged[k]) for k in copy)
    # one Actor copy fewer than full fine-tuning (no Ref); optimizer states for the adapters only
    last = rows[-1]
    assert last["memory/param_bytes"] < full_row["memory/param_bytes"]
    # the sync hands a full Actor's own tensors on, and allocates a LoRA Actor's merged projections
    assert full_row["weight_sync/peak_extra_bytes"] == 0
    projections = [p for n, p in actor.named_parameters() if n.endswith(".base_layer.weight")]
    assert last["weight_sync/peak_extra_bytes"] == sum(p.numel() * p.element_size() for p in projections)
    assert last["memory/optimizer_bytes"] < full_row["memory/optimizer_bytes"]

    folder = tmp_path / "run" / "actor_hf"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }
    sft = trainer.generator.actor_copies()[0]  # only for the shape of the inputs
    ids_BT = torch.randint(3, sft.config.vocab_size, (2, 9))
    with torch.no_grad():
        ours_BTV = actor.eval()(ids_BT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(cfg_sft_path(trainer)).eval()
    with torch.no_grad():
        peft_BTV = peft.PeftModel.from_pretrained(hf, folder).eval()(ids_BT).logits
        merged_BTV = (
            transformers.AutoModelForCausalLM.from_pretrained(folder / "merged").eval()(ids_BT).logits
        )
    assert (peft_BTV - ours_BTV).abs().max() <= 1e-4
    assert (merged_BTV - ours_BTV).abs().max() <= 1e-4


def cfg_sft_path(trainer) -> str:
    """The SFT checkpoint the adapter folder names as its base."""

    adapter = trainer.run_dir / "actor_hf" / "adapter_config.json"
    return json.loads(adapter.read_text())["base_model_name_or_path"]


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_identically(tmp_path, cache, crash_after):
    common = [*LORA, "iterations=3", "checkpoint.every=2"]
    straight = build_trainer(smoke(cache, *common), run_dir=tmp_path / "a", log=quiet).fit()
    first = build_trainer(smoke(cache, *common), run_dir=tmp_path / "b", log=quiet)
    first.callbacks.append(crash_after(at=2))
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    saved = load_file(tmp_path / "b" / "checkpoints" / "iter_00000002" / "actor.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    rows = build_trainer(smoke(cache, *common, "resume=auto"), run_dir=tmp_path / "b", log=quiet).fit()
    assert len(rows) == 1
    skip = ("time/", "throughput/")
    assert {k: v for k, v in rows[0].items() if not k.startswith(skip)} == {
        k: v for k, v in straight[-1].items() if not k.startswith(skip)
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["pipeline=serial_1f1b", "distributed.nproc_per_node=2", "pipeline.actor_tp=2"],
            "model.lora.rank=4 with pipeline.actor_tp=2: the adapters of tensor-parallel shards",
        ),
        (
            ["pipeline=fused", "distributed.nproc_per_node=2", "generator.tp=2"],
            "set generator.tp=1",
        ),
        (
            [
                "pipeline=serial_1f1b",
                "distributed.nproc_per_node=2",
                "generator=engine",
                "generator.instances=2",
            ],
            "needs the pipeline inferencer .* set generator.instances=1",
        ),
        (["model.lora.target_modules=[qkv_proj]"], r"model.lora.target_modules=\['qkv_proj'\]"),
        (["model.architecture=phi3"], "model.lora on phi3 is not supported"),
    ],
)
def test_lora_is_refused_with_the_key_where_it_does_not_run(cache, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(smoke(cache, "model.lora.rank=4", *overrides))


def _cli(train_cli, tmp_path: Path, run: str, *overrides: str) -> list[dict[str, float]]:
    """`rlhfuse-train` of the smoke job with a LoRA Actor (2 layers, constant LR); its metric rows, less those
    read off the clock (the pipeline's makespans and bubble ratio among them)."""
    rows = train_cli(
        tmp_path / run,
        "experiment=smoke",
        "model.num_layers=2",
        *LORA,
        "model.lora.export_merged=true",
        "pipeline.lr_schedule=constant",
        "pipeline.warmup_steps=0",
        "distributed.nproc_per_node=2",
        "distributed.timeout_s=60",
        "checkpoint.every=2",
        "checkpoint.export_hf=true",
        f"model.warmstart.cache_dir={tmp_path / 'cache'}",
        *overrides,
        timeout=300,
    )
    timed = (
        "time/",
        "throughput/",
        "train/predicted_makespan_s",
        "train/measured_makespan_s",
        "train/bubble_ratio",
    )
    return [{k: v for k, v in row.items() if not k.startswith(timed)} for row in rows]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_lora_actor_on_the_actor_pipeline_trains_as_under_plain_and_resumes_from_its_adapters(
    tmp_path, train_cli
):
    pp = ("pipeline=serial_1f1b", "pipeline.actor_pp=2", "pipeline.critic_pp=2", "pipeline.microbatches=2")
    piped = _cli(train_cli, tmp_path, "pp", *pp)
    plain = _cli(train_cli, tmp_path, "plain", "pipeline=plain", "generator.instances=2")
    assert len(piped) == len(plain) == 3
    for got, want in zip(piped, plain, strict=True):
        assert got["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-5, abs=1e-7)
        assert got["kl/mean"] == pytest.approx(want["kl/mean"], rel=1e-5, abs=1e-7)
        # each rank steps the adapters of its stage only, and holds no Ref copy
        assert got["memory/optimizer_bytes"] < 0.6 * want["memory/optimizer_bytes"]
        # the weight sync sends the other stage's merged projections, not the whole model, stage by stage: a
        # rank holds one stage's (its own merged, or the other's received) at a time, half of what plain's
        # replicas merge in their one bucket (two equal layers, one a stage)
        assert 0 < got["weight_sync/bytes_per_rank"] < 0.2 * got["memory/param_bytes"]
        assert 2 * got["weight_sync/peak_extra_bytes"] == want["weight_sync/peak_extra_bytes"] > 0
    assert piped[0]["kl/mean"] == 0.0  # the Reference is the Actor with its adapters off (B = 0 at first)
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        wa = load_file(tmp_path / "pp" / "actor_hf" / name)
        wb = load_file(tmp_path / "plain" / "actor_hf" / name)
        assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa), name
    for rank in range(2):  # a stage shard holds its adapters: the base is the SFT checkpoint
        shard = load_file(
            tmp_path / "pp" / "checkpoints" / "iter_00000002" / f"rank_{rank:05d}" / "stages.safetensors"
        )
        actor = [k for k in shard if k.startswith("actor.")]
        assert actor and all(".lora_" in k for k in actor), actor

    # 3 iterations straight == 2, then resumed from the adapters' checkpoint for a third (the fused schedule)
    fused = ("pipeline=fused", "pipeline.actor_pp=2", "pipeline.critic_pp=2", "pipeline.microbatches=2")
    straight = _cli(train_cli, tmp_path, "a", *fused, "iterations=3")
    _cli(train_cli, tmp_path, "b", *fused, "iterations=2")
    resumed = _cli(train_cli, tmp_path, "b", *fused, "iterations=3", "resume=auto")
    assert [r["iteration"] for r in resumed] == [1, 2, 3] and resumed == straight


@pytest.mark.slow
@pytest.mark.skipif(not is_converted(), reason=f"{real_model_dir()} is not converted: run `make real-model`")
def test_lora_grpo_on_smollm2_builds_no_ref_copy_and_its_adapter_loads_with_peft(tmp_path):
    small = ["data.prompts_per_iteration=2", "data.samples_per_prompt=2", "data.mini_batch_size=4",
             "data.micro_batch_size=4", "generator.max_new_tokens=8", "iterations=1", "logger=quiet"]  # fmt: skip
    lora = ["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]", "checkpoint.export_hf=true"]
    full = build_trainer(
        compose_config(["experiment=smollm2_arith", *small]), run_dir=tmp_path / "f", log=quiet
    )
    full_bytes = full.fit()[-1]["memory/param_bytes"]
    cfg = compose_config(["experiment=smollm2_arith", *small, *lora])
    trainer = build_trainer(cfg, run_dir=tmp_path / "run", log=quiet)
    assert trainer.inferencer.ref is trainer.strategy.actor
    row = trainer.fit()[-1]
    # SmolLM2-135M in fp32 is ~0.54 GB: full fine-tuning holds Actor, Ref and the generator's copy, LoRA two
    assert full_bytes - row["memory/param_bytes"] > 0.4e9
    hf = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir()).eval()
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "run" / "actor_hf").eval()
    ids_BT = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2]])
    with torch.no_grad():
        assert (adapted(ids_BT).logits - trainer.strategy.actor.eval()(ids_BT)).abs().max() <= 1e-3
