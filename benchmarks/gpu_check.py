"""`make gpu-check`: what only a CUDA device can check, as one table (`python -m benchmarks.gpu_check`).

Sections (each a PASS / FAIL / SKIP row with its figure or error):

- collectives: a one-rank NCCL group on `rlhfuse.distributed.rank_device()`; every helper of
  `rlhfuse.distributed` (in-place reductions, broadcast, gather, barrier, the tensor messages for batches,
  JSON, bytes and codec messages, the differentiable tensor-parallel pair through a tp=1 shard) on device
  tensors, and `check_device` refusing a CPU tensor;
- gae / logprobs kernels: the Triton kernels on CUDA against their PyTorch references (values and gradients);
- engine: the generation engine's greedy tokens on the GPU equal those on the CPU (a tiny random model);
- default job: `rlhfuse-train experiment=default` shortened to 2 iterations, on CUDA in bf16 (`device=cuda`,
  precision auto = bf16-mixed): finite metrics, the Triton GAE reached in training;
- vllm: the smoke job with generator=vllm (SKIP when vLLM is not installed).

Without CUDA it prints one line saying so and exits 0 (nothing was checked). Exit status 1 if any row FAILs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

Row = tuple[str, str, str]  # (check, PASS / FAIL / SKIP, detail)


def check_collectives(device: torch.device) -> str:
    """Every `rlhfuse.distributed` helper on `device` (a process group must be up). Returns a detail line."""
    from rlhfuse import distributed
    from rlhfuse.core.types import TrainBatch
    from rlhfuse.core.wire import pack_tensors, unpack_tensors
    from rlhfuse.models import ModelConfig, Transformer
    from rlhfuse.runtime.tensor_parallel import shard_transformer, vocab_parallel_logprobs

    x = torch.arange(4, dtype=torch.float32, device=device)
    distributed.all_reduce(x)
    distributed.all_reduce(x, op="max")
    distributed.broadcast(x, 0)
    assert [t.device for t in distributed.all_gather(x)] == [x.device]
    distributed.barrier(device)
    n = 3
    batch = TrainBatch(*(torch.ones(n, 4, device=device) for _ in range(7)))
    got = distributed.broadcast_dataclass(batch, TrainBatch, 0, device)
    assert got.ref_logprobs_BR is None and got.advantages_BR.device.type == device.type
    assert distributed.broadcast_json({"a": 1}, 0, device) == {"a": 1}
    assert distributed.all_gather_json([1, "x"], device) == [[1, "x"]]
    assert distributed.all_gather_bytes(b"abc", device) == [b"abc"]
    (msg,) = distributed.all_gather_packed(pack_tensors([7], [torch.ones(2, device=device)]), device)
    assert unpack_tensors(msg)[0] == [7]
    (bf,) = distributed.broadcast_tensors([torch.ones(3, dtype=torch.bfloat16, device=device)], 0, device)
    assert bf.dtype == torch.bfloat16 and bf.device.type == device.type
    if device.type == "cuda":
        try:
            distributed.all_reduce(torch.zeros(1))
        except ValueError as refused:
            assert "NCCL" in str(refused)
        else:
            raise AssertionError("a CPU tensor on the NCCL group was not refused")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny()).to(device)
    tp = shard_transformer(model, 0, 1)
    ids = torch.randint(0, 128, (2, 5), device=device)
    lp = vocab_parallel_logprobs(tp(ids), ids, tp.vocab_shard)
    want = torch.log_softmax(model(ids).float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    err = float((lp.float() - want).abs().max())
    assert err < 1e-4, err
    lp.sum().backward()
    return f"backend {distributed.backend()}, device {device}: all helpers; tp=1 log-prob error {err:.1e}"


def check_gae(device: torch.device) -> str:
    from rlhfuse.algorithms.gae import compute_gae, compute_gae_loop

    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(16, 300, generator=g), torch.randn(16, 300, generator=g)
    m = (torch.rand(16, 300, generator=g) < 0.9).float()
    a_ref, ret_ref = compute_gae_loop(r.double(), v.double(), m.double(), 0.99, 0.95)
    a, ret = compute_gae(r.to(device), v.to(device), m.to(device), 0.99, 0.95, backend="triton")
    err = max(
        float((a.cpu().double() - a_ref).abs().max()), float((ret.cpu().double() - ret_ref).abs().max())
    )
    assert err < 1e-3, err
    return f"Triton GAE on {device} vs the fp64 loop: max error {err:.1e}"


def check_logprobs(device: torch.device) -> str:
    from rlhfuse.algorithms.logits import chosen_logprobs_torch
    from rlhfuse.algorithms.ops import chosen_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 32000, generator=g).to(device).requires_grad_(True)
    labels = torch.randint(0, 32000, (64,), generator=g).to(device)
    got = chosen_logprobs(logits, labels, 0.7, backend="triton")
    (grad,) = torch.autograd.grad(got.sum(), logits)
    ref = chosen_logprobs_torch(logits, labels, 0.7)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    err = float((got - ref).abs().max())
    gerr = float((grad - ref_grad).abs().max())
    assert err < 1e-4 and gerr < 1e-5, (err, gerr)
    return f"Triton chosen log-probs on {device} vs PyTorch: value {err:.1e}, gradient {gerr:.1e}"


def check_engine(device: torch.device) -> str:
    from rlhfuse.core.types import PromptBatch
    from rlhfuse.generation.config import GenerationConfig
    from rlhfuse.generation.generator import EngineGenerator, InstanceSetup
    from rlhfuse.models import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny())
    config = GenerationConfig()
    config.sampling.temperature = 0.0  # greedy
    config.sampling.max_new_tokens = 12
    prompts = PromptBatch(torch.randint(3, 128, (4, 6)), torch.ones(4, 6, dtype=torch.long), torch.arange(4))
    out = {}
    for where in (torch.device("cpu"), device):
        gen = EngineGenerator(model.to(where), config, InstanceSetup(eos_token_id=1, pad_token_id=0,
                              samples_per_prompt=1, seed=0))  # fmt: skip
        (rollout,) = gen.generate(prompts.to(where), iteration=1)
        out[where.type] = rollout.response_ids_BR.cpu()
    assert torch.equal(out["cpu"], out[device.type]), out
    return f"engine greedy tokens on {device} equal the CPU's ({tuple(out['cpu'].shape)})"


def _train(overrides: list[str]) -> dict[str, float]:
    from rlhfuse.trainer.build import build_trainer
    from rlhfuse.trainer.hydra import compose_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_config([*overrides, f"model.warmstart.cache_dir={tmp}/cache"])
        history = build_trainer(cfg, run_dir=f"{tmp}/run", log=lambda _: None).fit()
    last = history[-1]
    bad = [k for k, v in last.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, bad
    return last


def check_default_job(device: torch.device) -> str:
    import rlhfuse.algorithms.ops as ops

    calls = {"triton": 0}
    original = ops._use_triton

    def counting(backend: str | None, *tensors: torch.Tensor) -> bool:
        used = original(backend, *tensors)
        calls["triton"] += int(used)
        return used

    ops._use_triton = counting  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        last = _train(
            ["experiment=default", "iterations=2", f"device={device}", "checkpoint.export_hf=false"]
        )
    finally:
        ops._use_triton = original  # type: ignore[assignment]
    assert calls["triton"] > 0, "no Triton kernel ran in training"
    return (
        f"2 iterations in {time.perf_counter() - start:.0f} s, bf16-mixed, reward/mean {last['reward/mean']:.3f}, "
        f"{calls['triton']} Triton kernel calls"
    )


def check_vllm(device: torch.device) -> str:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ModuleNotFoundError("SKIP: vLLM is not installed here")
    last = _train(["experiment=smoke", "generator=vllm", "iterations=1", f"device={device}"])
    return f"smoke job with generator=vllm: reward/mean {last['reward/mean']:.3f}"


CHECKS: dict[str, Callable[[torch.device], str]] = {
    "collectives": check_collectives,
    "gae kernel": check_gae,
    "logprobs kernel": check_logprobs,
    "engine": check_engine,
    "default job": check_default_job,
    "vllm": check_vllm,
}


def init_one_rank(backend: str, device: torch.device, init_file: str) -> None:
    """A one-rank process group (the collectives' check needs one)."""
    import torch.distributed as dist  # gpu_check is a script, outside rlhfuse: group set-up only

    os.environ.setdefault("LOCAL_RANK", "0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )


def run_checks(device: torch.device, names: list[str]) -> list[Row]:
    rows: list[Row] = []
    for name in names:
        try:
            rows.append((name, "PASS", CHECKS[name](device)))
        except ModuleNotFoundError as err:
            rows.append((name, "SKIP", str(err).removeprefix("SKIP: ")))
        except Exception as err:  # a row, not a crash: the other checks still run
            last = traceback.format_exception_only(type(err), err)[-1].strip()
            rows.append((name, "FAIL", last[:300]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checks", nargs="*", help=f"checks to run (default: all of {list(CHECKS)})")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing was checked")
        return 0
    names = args.checks or list(CHECKS)
    from rlhfuse import distributed

    device = distributed.rank_device("nccl")
    with tempfile.TemporaryDirectory() as tmp:
        init_one_rank("nccl", device, os.path.join(tmp, "init"))
        rows = run_checks(device, names)
    width = max(len(r[0]) for r in rows)
    print(f"gpu-check on {torch.cuda.get_device_name(device)} (torch {torch.__version__})")
    for name, status, detail in rows:
        print(f"{name:<{width}}  {status:<4}  {detail}")
    return 1 if any(status == "FAIL" for _, status, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
