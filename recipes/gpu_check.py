"""`make gpu-check`: what rlhfuse does on one CUDA device, checked against its CPU references, as one table.

Run it on a machine with a CUDA GPU (`make gpu-check`, or `python recipes/gpu_check.py` with `src/` on the path).
Each row is one check: PASS (measured and within tolerance), FAIL (measured and wrong, or it raised), or SKIP (a
package it needs is not installed: the row names it). Where there is no CUDA device it prints one line and exits
with status 3 (a check that did not run is not a pass); otherwise the status is 1 if any row failed, else 0.

Checks:
1. the Triton GAE kernel against `compute_gae_scan` (fp32, masked, long rows);
2. the Triton chosen-token log-prob kernel against `chosen_logprobs_torch` (values and gradients, fp32 and bf16);
3. the generation engine on CUDA against the same engine on the CPU (float64, greedy and sampled tokens equal);
4. a one-rank NCCL process group: every helper of `rlhfuse.distributed` it can exercise with one GPU, with the
   tensors on the device;
5. the default RLHF job on CUDA in bf16 (`device=cuda pipeline.precision=bf16-mixed`, a few iterations): exits 0
   with finite losses;
6. the vLLM generator on the GPU (`generator=vllm`, a few iterations), where vllm is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    seconds: float


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def check_gae() -> str:
    import torch

    from rlhfuse.algorithms.gae import compute_gae_scan
    from rlhfuse.algorithms.ops import gae

    generator = torch.Generator(device="cuda").manual_seed(0)
    rewards = torch.randn(64, 2048, device="cuda", generator=generator)
    values = torch.randn(64, 2048, device="cuda", generator=generator)
    mask = (torch.rand(64, 2048, device="cuda", generator=generator) > 0.2).float()
    adv, ret = gae(rewards, values, mask, 1.0, 0.95, backend="triton")
    ref_adv, ref_ret = compute_gae_scan(rewards.double(), values.double(), mask.double(), 1.0, 0.95)
    err = max(float((adv.double() - ref_adv).abs().max()), float((ret.double() - ref_ret).abs().max()))
    scale = float(ref_adv.abs().max())
    if not err <= 1e-4 * max(scale, 1.0):
        raise AssertionError(f"max |Δ| {err:.3g} against the float64 reference (scale {scale:.3g})")
    return f"64x2048, max |Δ| {err:.2e} vs float64 reference"


def check_logprobs() -> str:
    import torch

    from rlhfuse.algorithms.logits import chosen_logprobs_torch
    from rlhfuse.algorithms.ops import chosen_logprobs

    details = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        generator = torch.Generator(device="cuda").manual_seed(1)
        logits = (3 * torch.randn(2048, 49152, device="cuda", generator=generator)).to(dtype)
        labels = torch.randint(0, 49152, (2048,), device="cuda", generator=generator)
        ours = logits.clone().requires_grad_(True)
        ref = logits.clone().requires_grad_(True)
        out = chosen_logprobs(ours, labels, 0.7, backend="triton")
        expected = chosen_logprobs_torch(ref.float(), labels, 0.7)
        grad_out = torch.randn(out.shape, device="cuda", generator=generator)
        out.backward(grad_out)
        expected.backward(grad_out)
        assert ours.grad is not None and ref.grad is not None
        err = float((out.float() - expected).abs().max())
        grad_err = float((ours.grad.float() - ref.grad.float()).abs().max())
        if not (err <= tol and grad_err <= tol):
            raise AssertionError(f"{dtype}: max |Δ| {err:.3g}, grad {grad_err:.3g} (tolerance {tol})")
        details.append(f"{str(dtype).removeprefix('torch.')} |Δ| {err:.1e} grad {grad_err:.1e}")
    return "2048x49152, " + ", ".join(details)


def check_engine() -> str:
    import torch

    from rlhfuse.core.types import PromptBatch
    from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
    from rlhfuse.models import ModelConfig, Transformer

    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2
    )
    cpu_model = Transformer(config, head="lm").double().eval()
    cuda_model = Transformer(config, head="lm").double().eval()
    cuda_model.load_state_dict(cpu_model.state_dict())
    cuda_model.cuda()
    prompts = PromptBatch(
        torch.tensor([[0, 1, 5, 6, 7], [1, 9, 10, 11, 12], [0, 0, 0, 1, 13]]),
        torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]),
        torch.tensor([0, 1, 2]),
    )
    compared = 0
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=24, stop_token_ids=(2,), temperature=temperature)
        tokens = []
        for model in (cpu_model, cuda_model):
            engine = GenerationEngine(model, params, num_slots=4, max_len=64)
            engine.add(requests_for(prompts, samples_per_prompt=3, seed=7, iteration=0))
            finished = []
            with torch.no_grad():
                while engine.has_work():
                    finished += engine.step()
            tokens.append({(r.prompt_index, r.sample_index): r.tokens for r in finished})
        if tokens[0] != tokens[1]:
            raise AssertionError(f"temperature {temperature}: CUDA tokens differ from the CPU engine's")
        compared += sum(len(t) for t in tokens[0].values())
    return f"greedy and sampled, {compared} tokens equal to the CPU engine (float64)"


def check_collectives() -> str:
    import torch
    import torch.distributed as dist

    from rlhfuse import distributed as rd

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        exercised = rd.self_check(torch.device("cuda:0"))
    finally:
        dist.destroy_process_group()
    return f"one-rank NCCL group: {', '.join(exercised)}"


def _train(overrides: list[str], seconds: int) -> str:
    with tempfile.TemporaryDirectory() as run_dir:
        env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
        env.pop("TRITON_INTERPRET", None)
        command = [
            sys.executable,
            "-m",
            "rlhfuse.trainer.cli",
            f"run_dir={run_dir}",
            "logger=quiet",
            *overrides,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds, cwd=ROOT)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise AssertionError(f"exit {done.returncode}: {' | '.join(tail)}")
        metrics = Path(run_dir) / "metrics.jsonl"
        if not metrics.exists():
            raise AssertionError(f"no {metrics.name} written")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        losses = {k: v for k, v in rows[-1].items() if "loss" in k and isinstance(v, float)}
        bad = [k for k, v in losses.items() if v != v or abs(v) == float("inf")]
        if not losses or bad:
            raise AssertionError(f"losses {bad or 'missing'} in the last iteration")
        return f"{len(rows)} iterations, " + ", ".join(f"{k}={v:.3g}" for k, v in sorted(losses.items())[:3])


def check_default_job() -> str:
    return _train(["device=cuda", "pipeline.precision=bf16-mixed", "iterations=3"], 600)


def check_vllm() -> str:
    return _train(["device=cuda", "generator=vllm", "iterations=2"], 900)


CHECKS: list[tuple[str, tuple[str, ...], Callable[[], str]]] = [
    ("triton GAE kernel", ("triton",), check_gae),
    ("triton log-prob kernel", ("triton",), check_logprobs),
    ("generation engine", (), check_engine),
    ("collectives (NCCL)", (), check_collectives),
    ("default job, bf16", ("hydra", "omegaconf", "lightning"), check_default_job),
    ("vLLM generator", ("vllm", "hydra", "omegaconf", "lightning"), check_vllm),
]


def main() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.pop(
        "TRITON_INTERPRET", None
    )  # the kernels must compile for the GPU, not run in the interpreter
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing was checked")
        return 3
    print(f"gpu-check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    rows = []
    for name, needs, check in CHECKS:
        missing = _missing(*needs)
        start = time.perf_counter()
        if missing:
            rows.append(Row(name, "SKIP", f"not installed: {', '.join(missing)}", 0.0))
            continue
        try:
            detail, status = check(), "PASS"
        except Exception as err:  # a check that raises is a failed row; the others still run
            detail, status = f"{type(err).__name__}: {err}"[:160], "FAIL"
            if os.environ.get("RLHFUSE_DEBUG"):
                traceback.print_exc()
        rows.append(Row(name, status, detail, time.perf_counter() - start))
    width = max(len(r.name) for r in rows)
    print(f"{'check':<{width}}  status  seconds  detail")
    for r in rows:
        print(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.1f}  {r.detail}")
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
