"""pipeline=fsdp (FSDP2): over 2 gloo ranks the sharded update equals one process training on the whole
mini-batches (float64), with ranks running unequal micro-batch counts; each rank holds about half of the weights
and of the optimizer states; a non-finite loss on one rank stops both before any step; the weight sync gathers
the whole Actor; inference of each rank's share with the sharded models equals whole-model inference. From the command line: the default job's smoke preset trains, a run resumed from its sharded
checkpoint continues bit-identically, and the checkpoint loads on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.optim import OptimConfig
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import ModelConfig, Transformer, resident_bytes
from rlhfuse.testing.processes import gloo_rank, spawn_ranks
from rlhfuse.trainer import compose_config, validate

# the reductions as algorithm.loss_agg names them
AGG = {"token": "token-mean", "sequence": "seq-mean-token-mean"}

STEPS, MINI_BATCH, MICRO = 3, 7, 3  # 7 samples split 4 / 3: 2 micro-batches on one rank, 1 on the other


def _models() -> tuple[Transformer, Transformer, Transformer]:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    actor, critic = Transformer(cfg, head="lm").double(), Transformer(cfg, head="value").double()
    ref = Transformer(cfg, head="lm").double().eval().requires_grad_(False)
    return actor, critic, ref


def _batch(seed: int) -> TrainBatch:
    from test_trainer_data_parallel import _batch as batch

    return batch(seed, samples=MINI_BATCH)


def _optim_bytes(optimizers) -> int:
    from rlhfuse.distributed.fsdp import local_tensor

    return sum(
        local_tensor(t).numel() * t.element_size()
        for o in optimizers
        for state in o.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def _plain(reduction: str = "token"):
    from lightning.fabric import Fabric

    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    actor, critic, _ = _models()
    strategy = PlainStrategy(
        actor, critic, OptimConfig(warmup_steps=1, grad_clip=0.5), AlgorithmConfig(loss_agg=AGG[reduction]),
        fabric=Fabric(accelerator="cpu", devices=1), total_steps=STEPS, micro_batch_size=MICRO,
    )  # fmt: skip
    stats = [strategy.train_step(_batch(seed)).metrics() for seed in range(STEPS)]
    weights = {f"actor.{k}": v for k, v in actor.state_dict().items()}
    weights.update({f"critic.{k}": v for k, v in critic.state_dict().items()})
    return weights, stats, _optim_bytes(strategy.optimizers), resident_bytes(actor, critic)


def _fsdp(reduction: str = "token"):
    from lightning.fabric import Fabric

    from rlhfuse.distributed.fsdp import ShardingPolicy, full_state
    from rlhfuse.trainer.strategies.fsdp.training import ShardedStrategy

    actor, critic, ref = _models()
    strategy = ShardedStrategy(
        actor, critic, OptimConfig(warmup_steps=1, grad_clip=0.5), AlgorithmConfig(loss_agg=AGG[reduction]),
        frozen=[ref], policy=ShardingPolicy(), fabric=Fabric(accelerator="cpu", devices=1), total_steps=STEPS,
        micro_batch_size=MICRO,
    )  # fmt: skip
    stats = [strategy.train_step(_batch(seed)).metrics() for seed in range(STEPS)]
    memory = (_optim_bytes(strategy.optimizers_in_use()), resident_bytes(actor, critic), resident_bytes(ref))
    weights = {f"actor.{k}": v for k, v in strategy.actor_weights().items()}
    weights.update({f"critic.{k}": v for k, v in full_state(critic).items()})
    return strategy, weights, stats, memory


def _rollout():
    """5 rows (rows of different lengths): ranks infer unequal shares in unequal numbers of forward passes."""
    from rlhfuse.testing.data import two_row_rollout

    two = two_row_rollout(0)
    return two.select(torch.tensor([0, 1, 1, 0, 0]))


def _inference(sharded: bool):
    """Whole-model inference of `_rollout()` (one process), or `ShardedInference` over sharded models."""
    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    actor, critic, ref = _models()
    torch.manual_seed(1)
    reward = Transformer(critic.config, head="value").double().eval().requires_grad_(False)
    inferencer = ModelInferencer(
        InferencerConfig(micro_batch_size=1), actor=actor, ref=ref, critic=critic, reward_model=reward,
        rewards=None, tokenizer=build_tokenizer(), temperature=0.9,
    )  # fmt: skip
    if not sharded:
        return inferencer.infer(_rollout())
    import torch.distributed as dist

    from rlhfuse.distributed.fsdp import ShardingPolicy, shard_model
    from rlhfuse.trainer.strategies.fsdp.inference import ShardedInference

    for model in (actor, critic, ref, reward):
        shard_model(model, model.layers, ShardingPolicy(), device_type="cpu")
    return ShardedInference(inferencer, dist.group.WORLD).infer(_rollout())


def _streamed_sync(strategy):
    """The weight sync streamed in buckets of about two of the largest tensors: each bucket's names and bytes,
    whether the buckets joined equal the sync all at once, and the peak extra bytes of each."""
    whole = strategy.actor_weights()
    whole_peak = strategy.weight_sync_extra_bytes
    largest = max(t.numel() * t.element_size() for t in whole.values())
    strategy.config.weight_sync_bucket_mb = 2 * largest / (1 << 20)
    buckets = [dict(b) for b in strategy.actor_weight_buckets()]
    joined = {k: v for b in buckets for k, v in b.items()}
    equal = joined.keys() == whole.keys() and all(torch.equal(joined[k], whole[k]) for k in whole)
    sizes = [
        sum(t.numel() * t.element_size() for t in {id(t): t for t in b.values()}.values()) for b in buckets
    ]
    peak, received = strategy.weight_sync_extra_bytes, strategy.weight_sync_bytes
    # for a bf16 generator (pipeline.precision=bf16-mixed): the shards cast before the gather, bf16's bytes
    strategy.config.precision = "bf16-mixed"
    half = strategy.actor_weights()
    cast = half.keys() == whole.keys() and all(
        torch.equal(half[k], whole[k].to(torch.bfloat16)) for k in whole
    )
    size = next(iter(whole.values())).element_size()  # the trained dtype's (float64 here)
    halved = size * strategy.weight_sync_bytes == 2 * received  # bf16: 2 bytes an element
    return [list(b) for b in buckets], sizes, 2 * largest, equal, peak, whole_peak, cast, halved


def _worker(rank: int, port: int, out_dir: str) -> None:

    from rlhfuse.core.errors import NonFiniteError
    from rlhfuse.runtime.batch_split import karmarkar_karp, sample_costs

    with gloo_rank(rank, port, timeout_s=60):
        result: dict[str, object] = {}
        for reduction in ("token", "sequence"):
            strategy, weights, stats, memory = _fsdp(reduction)
            result[reduction] = (weights, stats, memory, strategy.weight_sync_bytes)
        # a NaN advantage in rank 1's share only: rank 0 stops too, before its optimizer step
        strategy, *_ = _fsdp()
        bad = _batch(7)
        costs = sample_costs(bad.attention_mask_BT.sum(dim=1).tolist())
        bad.advantages_BR[karmarkar_karp(costs, 2)[1]] = float("nan")
        before = {k: v.clone() for k, v in strategy.actor_weights().items()}
        try:
            strategy.train_step(bad)
            result["nonfinite"] = "no error"
        except NonFiniteError as err:
            after = strategy.actor_weights()
            result["nonfinite"] = (str(err), all(torch.equal(before[k], after[k]) for k in before))
        result["inference"] = _inference(sharded=True)
        result["buckets"] = _streamed_sync(strategy)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_rank_fsdp_update_equals_one_process_with_half_the_memory(tmp_path) -> None:
    assert spawn_ranks(_worker, str(tmp_path), timeout_s=200) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for reduction in ("token", "sequence"):
        want_weights, want_stats, plain_optim, plain_params = _plain(reduction)
        (w0, s0, mem0, sync0), (w1, s1, mem1, _) = ranks[0][reduction], ranks[1][reduction]
        for name, want in want_weights.items():
            assert torch.equal(w0[name], w1[name]), f"{reduction}: the gathered weights differ on {name}"
            # an update from one rank's share alone, or gradients averaged instead of summed, moves weights by
            # ~lr = 5e-4; reassociated float64 sums differ by ~1e-15
            assert torch.allclose(w0[name], want, rtol=0, atol=1e-12), f"{reduction}: {name}"
        assert s0 == s1
        for got, want in zip(s0, want_stats, strict=True):
            for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (reduction, key)
        for optim, params, ref in (mem0, mem1):
            # dim-0 shards: half of every tensor but the odd rows (within 10%)
            assert 0.45 * plain_optim <= optim <= 0.55 * plain_optim, (optim, plain_optim)
            assert 0.45 * plain_params <= params <= 0.55 * plain_params, (params, plain_params)
            assert ref < 0.55 * plain_params / 2
        # the sync received the other rank's half of the Actor
        actor_bytes = sum(v.numel() * v.element_size() for k, v in want_weights.items() if k[:6] == "actor.")
        assert sync0 == pytest.approx(actor_bytes / 2)
    # each rank inferred its share with the sharded models: every row equals whole-model inference
    want = _inference(sharded=False)
    for got in (ranks[0]["inference"], ranks[1]["inference"]):
        for field in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
            assert torch.allclose(getattr(got, field), getattr(want, field), rtol=0, atol=1e-12), field
    message0, unchanged0 = ranks[0]["nonfinite"]
    message1, unchanged1 = ranks[1]["nonfinite"]
    assert "another data-parallel rank" in message0 and "loss/policy is nan" in message1
    assert unchanged0 and unchanged1
    # the sync streamed in buckets: the same tensors, gathered a bucket at a time, the peak one bucket's
    names0, sizes, cap, equal, peak, whole_peak, cast, halved = ranks[0]["buckets"]
    assert cast and halved  # the sync in the generator's dtype
    assert ranks[1]["buckets"][0] == names0 and ranks[1]["buckets"][3]  # the same cut on both ranks
    assert equal and len(names0) > 3
    assert all(size <= cap or len(names) == 1 for size, names in zip(sizes, names0, strict=True))
    assert max(sizes) <= peak <= 1.1 * max(sizes) and peak < whole_peak / 3  # (gathered buffers are padded)


def _train(tmp: Path, run: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("rlhfuse-train")
    cmd = [
        str(exe),
        "experiment=smoke",
        "pipeline=fsdp",
        # constant LR: a 2-iteration run resumed to 3 equals a straight 3-iteration run
        "pipeline.lr_schedule=constant",
        "pipeline.warmup_steps=0",
        "distributed.timeout_s=60",
        "checkpoint.every=2",
        "checkpoint.export_hf=true",
        f"model.warmstart.cache_dir={tmp / 'cache'}",
        f"hydra.run.dir={tmp / run}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env, cwd=tmp)


def _rows(path: Path) -> list[dict[str, float]]:
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "generation/"))}
        for r in rows
    ]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp_job_resumes_bit_identically_and_its_checkpoint_loads_on_one_process(tmp_path: Path) -> None:
    two = "generator.instances=2"
    straight = _train(tmp_path, "a", two)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    first = _train(tmp_path, "b", two, "iterations=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ckpt = tmp_path / "b" / "checkpoints" / "iter_00000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["kind"] == "fsdp" and meta["world_size"] == 2 and meta["models"] == ["actor", "critic"]
    assert (ckpt / "dcp").is_dir() and (ckpt / "state.pt").is_file()
    resumed = _train(tmp_path, "b", two, "resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 iterations this run" in resumed.stdout + resumed.stderr
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["iteration"] for r in b] == [1, 2, 3] and a == b
    # the sync gathers the whole Actor on each rank, half of it received (and the padding of the shards that
    # do not divide evenly: the gathered buffers are allocated padded)
    for r in a:
        whole = 2 * r["weight_sync/bytes_per_rank"]
        assert 0 < whole <= r["weight_sync/peak_extra_bytes"] < 1.01 * whole
    export = "actor_hf/model.safetensors"
    wa = safetensors.torch.load_file(str(tmp_path / "a" / export))
    wb = safetensors.torch.load_file(str(tmp_path / "b" / export))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    (sft,) = [p for p in (tmp_path / "cache").rglob("model.safetensors") if "sft" in str(p)]
    assert any(not torch.equal(wa[k], v) for k, v in safetensors.torch.load_file(str(sft)).items())

    # the 2-rank checkpoint on one process: DCP reshards it; the same samples, the update up to reassociation
    one = _train(tmp_path, "c", f"resume={ckpt}", "checkpoint.every=0")
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "generator.instances: 2 -> 1" in one.stdout + one.stderr  # told, and applied
    (c,) = _rows(tmp_path / "c")
    assert c["iteration"] == 3 and c["reward/mean"] == a[2]["reward/mean"]
    assert c["loss/policy"] == pytest.approx(a[2]["loss/policy"], rel=1e-5, abs=1e-7)
    # the shards are half of each model but for the generation copy every instance holds whole
    assert a[0]["memory/optimizer_bytes"] < 0.55 * c["memory/optimizer_bytes"]


def test_fsdp_keys_are_validated_with_the_fix() -> None:
    validate(compose_config(["pipeline=fsdp", "generator.instances=2"]))
    cases = {
        "pipeline.cpu_offload=true": "pipeline.cpu_offload=true is read by pipeline=fsdp only",
        "pipeline=fsdp pipeline.cpu_offload=true device=cpu": "set pipeline.cpu_offload=false",
        "pipeline=fsdp pipeline.actor_tp=2": "pipeline.actor_tp=2 splits the model over ranks",
    }
    for overrides, expected in cases.items():
        with pytest.raises(ValueError) as err:
            validate(compose_config(overrides.split()))
        assert expected in str(err.value), str(err.value)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_lora_actor_under_fsdp_trains_as_under_plain_syncs_its_merged_projections_and_checkpoints_its_adapters(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    lora = (
        "generator.instances=2",
        "model.lora.rank=4",
        "model.lora.export_merged=true",
        "checkpoint.every=3",
    )
    sharded = _train(tmp_path, "fsdp", *lora)
    assert sharded.returncode == 0, sharded.stdout[-3000:] + sharded.stderr[-3000:]
    plain = _train(tmp_path, "plain", *lora, "pipeline=plain")
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    a, b = _rows(tmp_path / "fsdp"), _rows(tmp_path / "plain")
    for got, want in zip(a, b, strict=True):
        assert got["reward/mean"] == want["reward/mean"]
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-5, abs=1e-7)
        # the adapters' optimizer states and the frozen models' weights, halved
        assert got["memory/optimizer_bytes"] < 0.55 * want["memory/optimizer_bytes"]
        assert got["memory/param_bytes"] < 0.7 * want["memory/param_bytes"]
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        wa = safetensors.torch.load_file(str(tmp_path / "fsdp" / "actor_hf" / name))
        wb = safetensors.torch.load_file(str(tmp_path / "plain" / "actor_hf" / name))
        assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa), name
    # the weight sync gathers the adapted projections, merged on the shards, and nothing else: half of them
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    merged = sum(t.numel() * 4 for k, t in wa.items() if k.split(".")[-2] in projections)
    assert all(r["weight_sync/bytes_per_rank"] == merged / 2 for r in a)
    # each rank holds them all until its copy has loaded them, as a LoRA Actor's plain replica does
    assert all(r["weight_sync/peak_extra_bytes"] == merged for r in a + b)
    keys = dcp.FileSystemReader(
        str(tmp_path / "fsdp" / "checkpoints" / "iter_00000003" / "dcp")
    ).read_metadata()
    actor = [k for k in keys.state_dict_metadata if k.startswith("actor.")]
    assert actor and all(".lora_" in k for k in actor)  # the base is the SFT checkpoint, not saved again


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_mixture_of_experts_checkpoint_trains_under_fsdp_with_its_balancing_loss(
    tmp_path: Path, chat_checkpoint_of, hf_local_grpo
) -> None:
    transformers = pytest.importorskip("transformers")
    from test_trainer_architectures import FAMILIES

    sft = chat_checkpoint_of("qwen3_moe", **FAMILIES["qwen3_moe"]).path
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "7 + 5 ="}], "answer": "12"}] * 2
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = hf_local_grpo(
        sft, prompts, "data.micro_batch_size=2", "generator.max_new_tokens=8", "iterations=2",
        "pipeline=fsdp", "generator.instances=2", "pipeline.router_aux_loss_coef=0.01",
        "inferencer.reward_fn=rlhfuse_test_rewards:distinct_tokens", f"hydra.run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    exe = Path(sys.executable).with_name("rlhfuse-train")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [str(exe), *overrides], capture_output=True, text=True, timeout=250, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows_out = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows_out) == 2 and all(r["loss/router_aux"] > 0 and r["actor/grad_norm"] > 0 for r in rows_out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor_hf")
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
