"""`make gpu-check`: what only a CUDA device can check, as one table (`python -m benchmarks.gpu_check`).

Each row is a function `row(device, backend) -> Outcome` that sizes itself by the device (real sizes on CUDA,
tiny ones on the CPU, where the same code runs with gloo and the Triton interpreter). `make gpu-check` runs the
rows of a tier, each in its own subprocess with its own time limit (`Check.limit_s`), so a hang, a CUDA crash or
an NCCL abort is a FAIL row, not a stuck or dead check: TIER=quick (the default; what a first GPU run most needs,
its limits within `QUICK_TIER_S` = 9 minutes, so it fits a 10-minute session) or TIER=full (every row). The
check's budget is the sum of its rows' limits: no row is left unrun for lack of time.

`make gpu-check-dry` (`--dry-run`) runs every row's code on the CPU in one process (gloo, tiny sizes, the Triton
interpreter) and prints the same table; rows that need CUDA-only things (flash-attn, Transformer Engine, vLLM,
a CUDA device for the setting, the converted real model) SKIP saying why. The test suite runs it
(tests/test_gpu_check.py), so a row whose call no longer matches the code it calls fails there, not on the first
GPU run. Its multi-rank rows fork their ranks from one server that imported torch, Lightning and rlhfuse once
(`rank_context`); on CUDA every rank is a fresh spawned interpreter.

The performance rows hold their figures to `TARGETS` (per device type; the CPU's exercise the comparisons):
decode syncs at most 1 per step (and at least 1 on CUDA), a decode tokens/s floor, the KV pool's allocated /
most-in-use fraction and, on CUDA, the allocator's peak while decoding / what was allocated before. Rows:

- dependencies: CUDA, NCCL, triton and the other core imports (missing = FAIL); the GPU extras (flash-attn,
  Transformer Engine, vLLM) listed as installed or not;
- collectives: every `rlhfuse.distributed` helper on a one-rank group on `rank_device()` (a CPU tensor refused
  under NCCL);
- nccl 2 ranks: two processes on the one GPU over NCCL (each rank its own `NCCL_HOSTID`, sockets on loopback:
  `TWO_RANKS_ON_ONE_GPU`), an all-reduce and a point-to-point message checked, all-reduce bus bandwidth;
- pp=2 train step / pp=2 inference / reshard / migration: on those 2 ranks, `PipelineStrategy` (profiling
  step, then the searched fused schedule) against `PlainStrategy` on the same models; `PipelineInferencer`
  against `ModelInferencer`; the trained pp-sharded Actor resharded to generator.tp=2 and 1
  (`rlhfuse.runtime.reshard`) against the trained weights' slices; two engine instances migrating their long tail
  (`DistributedCoordinator`, migration=fixed) against one instance;
- pp=3 train step: the same comparison with pp=3 on 3 ranks sharing the GPU (a middle stage, which receives and
  sends in both directions);
- gqa attention: a grouped-query model in bf16 under `sdpa_kernel` restricted to flash / efficient / cudnn (a
  fall-back to the math kernel fails the row), unmasked (causal) and padded, against the math kernel in fp32;
- engine: the engine's greedy tokens on the device equal the CPU's; engine decode: bf16 decode step time at batch
  sizes 1, 8, 32, 128, tokens/s (a floor), prefill throughput, the memory fractions; decode syncs: device syncs
  per decode step (`rlhfuse.core.syncs.SyncCounter`, a FAIL naming it where it is missing), at most 1;
- flash backend / te backend: `attention_backend=flash|te` with fp32 weights under bf16 autocast, a Llama and a
  Qwen3 (q/k RMSNorm) model: q, k, v reach the kernel in one dtype and the logits match sdpa within bf16
  tolerance (SKIP: not installed, or not on CUDA);
- logprobs kernel (N=8192 tokens, V=152064, bf16) and gae kernel (256 x 4096): the Triton kernels against their
  PyTorch references, ms each and the ratio, values (and log-prob gradients) within tolerance;
- bf16-true, micro_batch_tokens, offload, speculative, trainer migration: one iteration of the smoke job through
  the trainer on the device with pipeline.precision=bf16-true / data.micro_batch_tokens=48 /
  inferencer.offload_frozen=true / generator=engine generator.speculative=ngram / generator.instances=2
  generator.in_process=true migration=fixed; finite metrics and the ones that show the setting acted;
- fused job: the smoke job with pipeline=fused through the trainer on 2 ranks, launched as `torchrun --nnodes=2
  --nproc-per-node=1` would (`torchrun_env`: Fabric's launcher wants a GPU per process), both on the one GPU;
  finite metrics, a bubble ratio in [0, 1), weights synced;
- real checkpoint: SmolLM2-135M-Instruct from `make real-model` (SKIP where it is not converted): the engine's
  greedy tokens scored again by the trainer's forward, log-probs equal in fp32; on CUDA the bf16 engine against
  the bf16-mixed forward as figures;
- default job: the default job for 2 iterations in bf16-mixed (1 in the CPU dry run), the Triton GAE reached in
  training;
- vllm: the smoke job with generator=vllm (SKIP: not installed).

The measured figures (decode step time per batch size, prefill and training throughput, all-reduce bandwidth,
kernel times) go to a JSON file (`--out`, default `$OUT/gpu_check.json` when OUT is set, else ./gpu_check.json)
that `rlhfuse-plan calibrate --from` reads. Without CUDA it prints one line saying nothing was checked and exits 0;
`--device cpu` runs the rows on the CPU anyway (gloo, tiny sizes, each in its subprocess). Exit status 1 if any
row FAILs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import importlib
import json
import math
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESERVE_S = 10.0  # kept back from the budget for the table and the JSON file
QUICK_TIER_S = 540.0
"""The most the quick tier's row limits may add up to: with the check's own start-up and a setup step, it fits
a 10-minute session (tests/test_gpu_check.py holds it)."""


class Skip(Exception):
    """The row does not apply here: an optional extra is not installed, or the part needs CUDA."""


class MissingDependency(RuntimeError):
    """Something the core needs is not importable (a FAIL row, never a SKIP)."""


@dataclass
class Outcome:
    """What a passing row returns: one line for the table and the figures for the JSON file."""

    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    check: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


RowFn = Callable[[torch.device, str], Outcome]


# --- dependencies ---------------------------------------------------------------------------------------------------
# import name -> pip name. Core: what the rows below (and rlhfuse itself) import; extras: the GPU extras.
CORE_MODULES = {
    "triton": "triton",
    "lightning": "lightning",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "rich": "rich",
}
EXTRA_MODULES = {"flash_attn": "flash-attn", "transformer_engine": "transformer-engine", "vllm": "vllm"}


def core(module: str) -> ModuleType:
    """Import a core dependency; missing is a FAIL naming the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        pip = CORE_MODULES.get(module.split(".")[0], module)
        raise MissingDependency(
            f"{pip} is not installed ({err}): a core dependency, pip install {pip}"
        ) from err


def extra(module: str) -> ModuleType:
    """Import an optional GPU extra; missing is a SKIP saying so, installed but broken (built against another
    torch or CUDA, say) a FAIL."""
    pip = EXTRA_MODULES.get(module.split(".")[0], module)
    if not installed(module.split(".")[0]):
        raise Skip(f"{pip} not installed")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise RuntimeError(f"{pip} is installed but `import {module}` fails: {err}") from err


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (None in sys.modules: made unimportable)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version_of(pip: str, module: ModuleType) -> str:
    from importlib import metadata

    try:
        return metadata.version(pip)
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "?"))


def row_dependencies(device: torch.device, backend: str) -> Outcome:
    problems, facts = [], [f"torch {torch.__version__}"]
    if device.type == "cuda":
        if not torch.cuda.is_available():
            problems.append("CUDA (torch.cuda.is_available() is False: a CUDA build of torch is needed)")
        else:
            major, minor = torch.cuda.get_device_capability(device)
            facts.append(f"CUDA {torch.version.cuda} sm_{major}{minor}")
    if backend == "nccl":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()):
            problems.append("NCCL (torch.distributed.is_nccl_available() is False)")
        else:
            version = torch.cuda.nccl.version()  # a tuple, or an int in older builds
            facts.append(
                "NCCL " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version))
            )
    for module, pip in CORE_MODULES.items():
        try:
            found = importlib.import_module(module)
        except ImportError as err:
            problems.append(f"{pip} ({err})")
        else:
            facts.append(f"{pip} {version_of(pip, found)}")
    extras = ", ".join(
        f"{pip} {'yes' if installed(m) else 'not installed'}" for m, pip in EXTRA_MODULES.items()
    )
    if problems:
        raise MissingDependency(
            "missing core dependencies: " + "; ".join(problems) + " (install them, or carry their wheels to "
            "the machine: docs/distributed.md)"
        )
    return Outcome(", ".join(facts) + f"; extras: {extras}")


# --- targets --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Targets:
    """What the performance rows hold their figures to, per device type (a FAIL names the figure, the target and
    the device). The CPU's are the dry run's: its tiny sizes exercise the same comparisons, not a CPU's speed."""

    decode_syncs_per_step: float
    """At most, `decode syncs` at every batch size: the step's one read of its sampled tokens."""
    decode_tokens_per_s: float
    """At least, `engine decode` at its largest batch (CUDA: 128 samples of the width-1024, 8-layer bf16 model;
    an eager decode step of it is expected at ~20-40k tokens/s on an A100 or H100, not yet measured: the floor
    catches a 5x loss, such as a sync per layer or attention falling to the math kernel)."""
    kv_pool_fraction: float
    """At most: the blocks the KV pool allocated / the most in use at once (it grows by a quarter when full)."""
    decode_memory_fraction: float | None
    """At most: the allocator's peak while decoding / what was allocated when decoding started (weights, KV
    pool): transients of a decode step (logits, the sampling passes, a pool growth). None: not measurable
    (the CPU has no allocator statistics)."""


TARGETS = {
    "cuda": Targets(decode_syncs_per_step=1.0, decode_tokens_per_s=5000.0, kv_pool_fraction=1.25,
                    decode_memory_fraction=1.5),
    "cpu": Targets(decode_syncs_per_step=1.0, decode_tokens_per_s=100.0, kv_pool_fraction=1.25,
                   decode_memory_fraction=None),
}  # fmt: skip


def targets(device: torch.device) -> Targets:
    return TARGETS[device.type]


# --- helpers --------------------------------------------------------------------------------------------------------
def real(device: torch.device) -> bool:
    """Real sizes on CUDA; tiny ones on the CPU (the same code, checked by the CPU test)."""
    return device.type == "cuda"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of `fn` (CUDA events on the GPU, the host clock on the CPU), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (NaN never passes a `<` test)."""
    g, w = got.double(), want.double()
    return float((g - w).norm() / w.norm().clamp_min(1e-30))


def random_batch(samples: int, vocab: int, prompt: int, response: int, seed: int) -> Any:
    """A float32 TrainBatch with left-padded prompts and right-padded responses (on the CPU)."""
    from rlhfuse.testing.data import random_batch as make

    return make(samples, vocab=vocab, prompt=prompt, response=response, seed=seed, dtype=torch.float32)


def random_rollout(n: int, vocab: int, prompt: int, response: int, seed: int) -> Any:
    from rlhfuse.testing.data import random_rollout as make

    return make(n, vocab=vocab, prompt=prompt, response=response, seed=seed)


def model_shape(cfg: Any) -> dict[str, int]:
    """A ModelConfig's shape for the figures file, in the keys `rlhfuse-plan calibrate --from` reads."""
    from rlhfuse.planner.calibrate import SHAPE_KEYS

    return {k: int(cfg.resolved_head_dim if k == "head_dim" else getattr(cfg, k)) for k in SHAPE_KEYS}


def pipeline_models(device: torch.device, layers: int = 2) -> Any:
    """The ModelConfig of the 2-rank rows: a GQA model of real width on CUDA, the tiny test model on the CPU."""
    from rlhfuse.models import ModelConfig

    if real(device):
        return ModelConfig.tiny(
            vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=max(layers, 4), num_heads=8,
            num_kv_heads=2, head_dim=64,
        )  # fmt: skip
    return ModelConfig.tiny(num_layers=layers)


# --- one rank, two ranks --------------------------------------------------------------------------------------------
# NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected"): a host id per rank makes it treat them
# as two hosts, which then talk through its socket transport on loopback (no shared memory, no peer-to-peer, no
# InfiniBand between "hosts" that are one process pair on one card).
TWO_RANKS_ON_ONE_GPU = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
}


def nccl_env(rank: int) -> dict[str, str]:
    return {**TWO_RANKS_ON_ONE_GPU, "NCCL_HOSTID": f"rlhfuse-gpu-check-rank{rank}"}


class NcclRefused(RuntimeError):
    """NCCL refused ranks that share a GPU ("Duplicate GPU detected") although each has its own NCCL_HOSTID: a
    limit of this NCCL build, not of rlhfuse."""


def on_shared_gpu(run: Callable[[], Outcome], world: int, gpus: int) -> Outcome:
    """`run()` (a row of `world` ranks on `gpus` GPUs); a SKIP, not a second FAIL, where NCCL refuses ranks
    sharing a GPU: the 2-rank rows of the quick tier FAIL on it already, and this row cannot run here."""
    try:
        return run()
    except NcclRefused as refused:
        if gpus >= world:  # every rank had a GPU of its own: not the sharing
            raise
        raise Skip(f"{world} ranks on {gpus} GPU(s), refused: {refused}") from refused


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_rank_group(device: torch.device, backend: str) -> Iterator[None]:
    """A one-rank process group (unless one is up already: the caller's)."""
    import torch.distributed as dist  # gpu_check is a script, outside rlhfuse: group set-up only

    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_entry(
    rank: int, world: int, port: int, device_type: str, backend: str, worker: str, out_dir: str
) -> None:
    """One of `world` ranks: the group, then `worker` (a `_w_*` function of this module); its outcome or its
    error goes to out_dir/rank{rank}.json. Exits without the process group's destructors once written."""
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)  # rank_device(): cuda:LOCAL_RANK % device_count = the one GPU
    _rank_setup(rank, device_type, backend)

    def run() -> Outcome:
        from rlhfuse import distributed

        device = distributed.rank_device(backend)
        if device.type != device_type:
            raise RuntimeError(f"rank_device({backend!r}) is {device}, not {device_type}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        outcome: Outcome = globals()[worker](rank, device)
        return outcome

    _report(out_dir, rank, run)


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment `torchrun --nnodes=world --nproc-per-node=1` gives `rank`: every rank a node of its own
    (LOCAL_RANK 0, so every rank takes cuda:0, as the other multi-rank rows share one GPU; Fabric reads it as a
    torchelastic launch and starts no process), meeting at MASTER_ADDR:MASTER_PORT."""
    return {
        "TORCHELASTIC_RUN_ID": f"rlhfuse-gpu-check-{port}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "GROUP_RANK": str(rank),
        "GROUP_WORLD_SIZE": str(world),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }


def _job_entry(
    rank: int, world: int, port: int, device_type: str, backend: str, job: str, out_dir: str
) -> None:
    """One rank of a trainer job (`job`: a key of `JOBS`) launched as `torchrun_env` says; the trainer makes
    the process group itself. Its outcome or its error goes to out_dir/rank{rank}.json."""
    os.environ.update(torchrun_env(rank, world, port))
    _rank_setup(rank, device_type, backend)

    def run() -> Outcome:
        from rlhfuse import distributed
        from rlhfuse.runtime.launch import Watchdog

        outcome = JOBS[job](torch.device(device_type), out_dir)
        # as `rlhfuse-train` ends a multi-process run: the watchdog disarmed (a rank that exits first is not a
        # death), every rank done, the group torn down
        if Watchdog.current is not None:
            Watchdog.current.disarm()
        distributed.shutdown()
        return outcome

    _report(out_dir, rank, run)


def _rank_setup(rank: int, device_type: str, backend: str) -> None:
    # the ranks are on this host: gloo (the group itself, or the CPU control groups beside NCCL) on loopback,
    # whatever the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        os.environ.update(nccl_env(rank))
    if device_type == "cpu":
        torch.set_num_threads(1)


def _report(out_dir: str, rank: int, run: Callable[[], Outcome]) -> None:
    """`run()`'s outcome or its error to out_dir/rank{rank}.json, then exit without the process group's
    destructors (a rank whose peer died could block in them)."""
    result: dict[str, Any]
    try:
        outcome = run()
        result = {"detail": outcome.detail, "figures": outcome.figures}
    except BaseException as err:  # reported to the parent, which decides the row
        result = {"error": describe(err), "trace": traceback.format_exc()[-3000:]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    from rlhfuse import distributed

    distributed.exit_finished()


RANK_PRELOAD = [
    "benchmarks.gpu_check",
    "lightning.fabric",  # with torchmetrics, transformers and torch._dynamo: most of a rank's start-up
    "rlhfuse.trainer.strategies.pipelines.training",
    "rlhfuse.trainer.strategies.pipelines.inference",
    "rlhfuse.trainer.strategies.plain.training",
    "rlhfuse.trainer.strategies.plain.inference",
    "rlhfuse.runtime.reshard",
    "rlhfuse.generation.distributed",
]
"""What the CPU's rank processes find imported (`rank_context`): what the `_w_*` workers import, ~7 s of CPU time
per process otherwise (a name that no longer imports is skipped by the fork server, costing only time)."""


def rank_context(device: torch.device) -> Any:
    """How the ranks start: spawned (a fresh interpreter each) for CUDA, which must not be initialised in a
    process that forks, and whose first run should not depend on what a fork server imported; on the CPU (the
    dry run, in the test suite) forked from one server that imported `RANK_PRELOAD` once, so that each multi-rank
    row does not pay every rank's imports again."""
    if device.type == "cuda":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def spawn_ranks(worker: str, device: torch.device, backend: str, timeout_s: float, world: int = 2) -> Outcome:
    """Run `worker` on `world` spawned ranks (all on the one GPU where there is one: `nccl_env`) in a process
    group made here; rank 0's outcome (`_spawn` says how a failure or a hang ends)."""
    import benchmarks.gpu_check as this  # the spawned ranks import the module by name, also under `-m`

    return _spawn(this._rank_entry, worker, device, backend, timeout_s, world)


def spawn_job(job: str, device: torch.device, backend: str, timeout_s: float, world: int = 2) -> Outcome:
    """Run the trainer job `job` (a key of `JOBS`) on `world` spawned ranks as torchrun would start them
    (`torchrun_env`: one rank per node, all on the one GPU where there is one); rank 0's outcome."""
    import benchmarks.gpu_check as this

    return _spawn(this._job_entry, job, device, backend, timeout_s, world)


def _spawn(
    entry: Callable[..., None], name: str, device: torch.device, backend: str, timeout_s: float, world: int
) -> Outcome:
    """`entry(rank, world, port, device type, backend, name, folder)` on `world` processes sharing `folder`;
    rank 0's outcome. A rank that fails (an error reported, or dead without a word: a CUDA abort) stops the
    others after a grace of a few seconds, since they are likely blocked in a collective with it; ranks still
    running at `timeout_s` are killed and the row fails as a hang."""
    ctx = rank_context(device)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=entry, args=(r, world, port, device.type, backend, name, tmp))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            failed = [
                r for r, p in enumerate(procs) if "error" in _read_rank(tmp, r) or p.exitcode not in (None, 0)
            ]
            if failed and failed_at is None:
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 5.0):
                break
            time.sleep(0.1)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        results = [_read_rank(tmp, r) for r in range(world)]
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    errors += [
        f"rank {r} died without a result (exit code {p.exitcode}: killed, out of memory, a CUDA abort?)"
        for r, p in enumerate(procs)
        if r not in hung and not results[r]
    ]
    if errors:
        message = "; ".join(errors)
        if backend == "nccl" and any(
            s in message for s in ("Duplicate GPU", "ncclInvalidUsage", "NCCL error")
        ):
            message = f"NCCL refused {world} ranks on a GPU (NCCL_HOSTID per rank, sockets on lo): {message}"
        if backend == "nccl" and "Duplicate GPU" in message:
            raise NcclRefused(message)
        raise RuntimeError(message)
    if hung:
        raise TimeoutError(
            f"ranks {hung} did not finish within {timeout_s:.0f} s (a hang: a collective or point-to-point message "
            "that never completed)"
        )
    return Outcome(results[0]["detail"], results[0]["figures"])


def _read_rank(folder: str, rank: int) -> dict[str, Any]:
    path = Path(folder, f"rank{rank}.json")
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


# --- the rows -------------------------------------------------------------------------------------------------------
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
    err = float((lp.detach().float() - want.detach()).abs().max())
    assert err < 1e-4, err
    lp.sum().backward()
    return f"backend {distributed.backend()}, device {device}: all helpers; tp=1 log-prob error {err:.1e}"


def row_collectives(device: torch.device, backend: str) -> Outcome:
    with one_rank_group(device, backend):
        return Outcome(check_collectives(device))


def _w_collectives(rank: int, device: torch.device) -> Outcome:
    """All-reduce and point to point checked on both ranks, then the all-reduce bus bandwidth."""
    from rlhfuse import distributed

    x = torch.full((1024,), float(rank + 1), device=device)
    distributed.all_reduce(x)
    assert bool((x == 3).all()), f"all_reduce gave {x[:4].tolist()}, not 3"
    msg = (
        torch.arange(16, dtype=torch.float32, device=device) if rank == 0 else torch.zeros(16, device=device)
    )
    if rank == 0:
        distributed.wait_all([distributed.isend(msg, 1)])
    else:
        distributed.wait_all([distributed.irecv(msg, 0)])
        assert torch.equal(msg.cpu(), torch.arange(16, dtype=torch.float32)), msg
    sizes_mib = (1, 16, 128) if real(device) else (1,)
    busbw = {}
    for mib in sizes_mib:
        buf = torch.ones(mib * 2**18, device=device)
        ms = time_ms(functools.partial(distributed.all_reduce, buf), device, reps=5 if real(device) else 2)
        busbw[str(mib)] = mib * 2**20 / (ms / 1e3) / 1e9  # 2 (n - 1) / n = 1 at n = 2
    # the two ranks talk through loopback sockets (TWO_RANKS_ON_ONE_GPU): not a figure of NVLink or InfiniBand
    figures = {"allreduce_busbw_GBps": busbw, "allreduce_backend": distributed.backend(),
               "allreduce_transport": "loopback"}  # fmt: skip
    shown = ", ".join(f"{k} MiB {v:.2f}" for k, v in busbw.items())
    return Outcome(
        f"{distributed.backend()}: all-reduce and send/recv exact; bus bandwidth GB/s {shown}", figures
    )


def row_two_rank_collectives(device: torch.device, backend: str) -> Outcome:
    return spawn_ranks("_w_collectives", device, backend, timeout_s=100)


@dataclass(frozen=True)
class FusedRun:
    """What `_fused_vs_plain` measured: the model, the samples and tokens of a step, the median seconds of the
    steps after the profiling one, the largest weight difference from PlainStrategy's."""

    model: Any
    samples: int
    tokens: int
    step_s: float
    weight_err: float


def _fused_vs_plain(device: torch.device, pp: int, steps: int, sizes: tuple[int, int, int, int]) -> FusedRun:
    """PipelineStrategy (pp over as many ranks: a profiling step, then the searched fused schedule) vs
    PlainStrategy on copies of the same models, step by step: losses, gradient norms, then the weights.
    `sizes`: samples, microbatches, prompt and response tokens."""
    core("hydra")  # rlhfuse.trainer (PlainStrategy here) imports Hydra with the package
    from lightning.fabric import Fabric

    from rlhfuse.core.advantages import AlgorithmConfig
    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.models import Transformer
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    samples, micro, prompt, response = sizes
    cfg = pipeline_models(device, layers=pp)
    torch.manual_seed(0)
    models = {
        "actor": Transformer(cfg, head="lm").to(device),
        "critic": Transformer(cfg, head="value").to(device),
    }
    plain_models = copy.deepcopy(models)
    pcfg = PipelineConfig(
        name="fused", optim=OptimConfig(warmup_steps=1), actor_pp=pp, critic_pp=pp, microbatches=micro,
        search_budget_s=0.0,
    )  # fmt: skip
    algo = AlgorithmConfig()
    fused = PipelineStrategy(
        models["actor"], models["critic"], pcfg, algo, total_steps=4, mini_batch_size=samples,
        micro_batch_size=samples // micro, schedule="fused", timeout_s=60, log=lambda _: None,
    )  # fmt: skip
    plain = PlainStrategy(
        plain_models["actor"], plain_models["critic"], pcfg.optim, algo,
        fabric=Fabric(accelerator=device.type, devices=1), total_steps=4, micro_batch_size=samples // micro,
    )  # fmt: skip
    step_s, tokens = [], 0
    for step in range(steps):
        batch = random_batch(samples, cfg.vocab_size, prompt, response, seed=11 + step).to(device)
        tokens = int(batch.attention_mask_BT.sum())
        sync(device)
        t0 = time.perf_counter()
        got = fused.train_step(batch).metrics()
        sync(device)
        step_s.append(time.perf_counter() - t0)
        want = plain.train_step(batch).metrics()
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
            assert math.isclose(got[key], want[key], rel_tol=1e-3, abs_tol=1e-5), (
                step,
                key,
                got[key],
                want[key],
            )
    fused.actor_weights()  # the strategy's own sync: whole copies brought up to date on every rank
    weight_err = max(
        float((p.detach() - q.detach()).abs().max())
        for name in models
        for p, q in zip(models[name].parameters(), plain_models[name].parameters(), strict=True)
    )
    # a wrong learning rate, step count or stage update moves weights by ~lr = 5e-4 per step
    assert weight_err < 1e-4, f"weights after {steps} steps differ from PlainStrategy's by {weight_err:.2e}"
    after_profiling_s = statistics.median(step_s[1:])
    return FusedRun(cfg, samples, tokens, after_profiling_s, weight_err)


def _w_pp2_train(rank: int, device: torch.device) -> Outcome:
    """PipelineStrategy (pp=2) vs PlainStrategy for 3 steps; the training figures the planner calibrates on."""
    sizes = (32, 4, 128, 128) if real(device) else (8, 2, 5, 7)
    run = _fused_vs_plain(device, pp=2, steps=3, sizes=sizes)
    figures = {
        "train_tokens_per_s": run.tokens / run.step_s,
        "train_step_s": run.step_s,
        "train_tokens_per_step": run.tokens,
        # one step trains an Actor and a Critic of this shape on `train_samples` sequences, pp=2 over 2 ranks on
        # `train_devices` devices (both ranks share one GPU on a one-GPU machine)
        "train_model": model_shape(run.model),
        "train_samples": run.samples,
        "train_devices": min(2, torch.cuda.device_count()) if device.type == "cuda" else 1,
    }
    return Outcome(
        f"fused pp=2 = PlainStrategy for 3 steps (losses, grad norms; weights to {run.weight_err:.1e}); "
        f"{run.step_s * 1e3:.0f} ms / step, {run.tokens / run.step_s:,.0f} tokens/s",
        figures,
    )


def row_pp2_train(device: torch.device, backend: str) -> Outcome:
    return spawn_ranks("_w_pp2_train", device, backend, timeout_s=120)


def _w_pp3_train(rank: int, device: torch.device) -> Outcome:
    """PipelineStrategy with pp=3 over 3 ranks (a middle stage: receives and sends in both directions, which
    pp=2 never does) vs PlainStrategy; on CUDA 6 microbatches over 3 steps, on the CPU the fewest that run the
    searched schedule once (3 microbatches, the profiling step and one more)."""
    sizes, steps = ((24, 6, 128, 128), 3) if real(device) else ((6, 3, 5, 7), 2)
    run = _fused_vs_plain(device, pp=3, steps=steps, sizes=sizes)
    # not the planner's training figures (pp=2 row's): three ranks on one GPU share its compute
    figures = {"pp3_train_step_s": run.step_s, "pp3_train_tokens_per_s": run.tokens / run.step_s}
    return Outcome(
        f"fused pp=3 = PlainStrategy for {steps} steps (losses, grad norms; weights to {run.weight_err:.1e}); "
        f"{run.step_s * 1e3:.0f} ms / step",
        figures,
    )


def row_pp3_train(device: torch.device, backend: str) -> Outcome:
    """pp=3 on 3 ranks: on a machine with fewer GPUs they share them (`rank_device`: cuda:rank % GPUs), each rank
    its own NCCL_HOSTID (`nccl_env`); a SKIP where this NCCL refuses that."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return on_shared_gpu(
        lambda: spawn_ranks("_w_pp3_train", device, backend, timeout_s=110, world=3), world=3, gpus=gpus
    )


def _w_pp2_inference(rank: int, device: torch.device) -> Outcome:
    core("hydra")  # rlhfuse.trainer (ModelInferencer here) imports Hydra with the package
    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.models import Transformer
    from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
    from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    cfg = pipeline_models(device)
    torch.manual_seed(3)
    heads = {"actor": "lm", "ref": "lm", "critic": "value", "reward": "value"}
    models = {name: Transformer(cfg, head=head).to(device) for name, head in heads.items()}
    tokenizer = build_tokenizer()
    rows, prompt, response = (64, 128, 128) if real(device) else (13, 5, 7)
    config = InferencerConfig(micro_batch_size=0, truncated_score=-5.0)
    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, 2, 4, device=str(device))
    rollout = random_rollout(rows, cfg.vocab_size, prompt, response, seed=5)
    oracle = ModelInferencer(
        config, actor=models["actor"], ref=models["ref"], critic=models["critic"], reward_model=models["reward"],
        rewards=None, tokenizer=tokenizer, temperature=0.7,
    ).infer(rollout)  # fmt: skip
    pipe = PipelineInferencer(
        config, layout, models, rewards=None, tokenizer=tokenizer, temperature=0.7, timeout_s=60
    )
    pipe.infer(rollout)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    got = pipe.infer(rollout)
    sync(device)
    seconds = time.perf_counter() - t0
    errs = {}
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        a, b = getattr(got, name), getattr(oracle, name)
        assert a.shape == b.shape and a.device.type == device.type, (name, a.shape, b.shape, a.device)
        errs[name] = float((a.double() - b.double()).abs().max())
        assert errs[name] < 1e-3, f"{name}: pipeline vs single-process max error {errs[name]:.2e}"
    tokens = rows * (prompt + response)
    worst = max(errs.values())
    return Outcome(
        f"PipelineInferencer (pp=2) = ModelInferencer on {rows} rows (max error {worst:.1e}); "
        f"{seconds * 1e3:.0f} ms, {tokens / seconds:,.0f} tokens/s",
        {"pipeline_inference_tokens_per_s": tokens / seconds},
    )


def row_pp2_inference(device: torch.device, backend: str) -> Outcome:
    return spawn_ranks("_w_pp2_inference", device, backend, timeout_s=100)


def _w_reshard(rank: int, device: torch.device) -> Outcome:
    """pp-sharded Actor/Critic (each rank materialises its stage only), one update, then the trained Actor
    resharded to generator.tp=2 (the strategy's own sync) and to whole copies (g=1), against the trained weights."""
    from rlhfuse import distributed
    from rlhfuse.core.advantages import AlgorithmConfig
    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.models import Transformer, from_pretrained, save_pretrained, to_device
    from rlhfuse.runtime.reshard import Resharder
    from rlhfuse.runtime.tensor_parallel import shard_transformer
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy, pipeline_layout

    cfg = pipeline_models(device)
    with tempfile.TemporaryDirectory() as tmp:
        # every rank writes the same seeded weights to its own folder: no file is shared between processes
        torch.manual_seed(0)
        save_pretrained(Transformer(cfg, head="lm"), f"{tmp}/sft")
        save_pretrained(Transformer(cfg, head="value"), f"{tmp}/rm")
        pcfg = PipelineConfig(
            name="fused", optim=OptimConfig(warmup_steps=1), microbatches=2, search_budget_s=0.0
        )
        layout = pipeline_layout(pcfg, 2, 8, 4)
        held = layout.held_stages(rank)
        actor = from_pretrained(f"{tmp}/sft", head="lm", stages=(2, held["actor"]))
        critic = from_pretrained(f"{tmp}/rm", head="value", stages=(2, held["critic"]))
    actor, critic = to_device(actor, device), to_device(critic, device)
    fused = PipelineStrategy(
        actor, critic, pcfg, AlgorithmConfig(), total_steps=4, mini_batch_size=8, micro_batch_size=4,
        schedule="fused", timeout_s=60, log=lambda _: None, generation_tp=2,
    )  # fmt: skip
    fused.train_step(random_batch(8, cfg.vocab_size, 5, 7, seed=5).to(device))
    trained = Transformer(cfg, head="lm").to(device)
    trained.load_state_dict(fused.state_dict()["actor"])  # reassembled from both ranks' stages
    sync(device)
    t0 = time.perf_counter()
    shard = dict(fused.actor_weights())
    sync(device)
    seconds = time.perf_counter() - t0
    want = shard_transformer(copy.deepcopy(trained), rank, 2).state_dict()
    assert shard.keys() == want.keys(), sorted(set(shard) ^ set(want))
    for name, value in want.items():
        assert shard[name].device.type == device.type, (name, shard[name].device)
        assert torch.equal(shard[name], value), f"g=2 shard {name} differs from the trained slice"
    received = fused.resharder.received_bytes
    assert received > 0, "nothing was sent: the pp=2 shards must exchange the stage each lacks"
    whole = Resharder(fused.layout, rank, fused.models["actor"], 1).run()
    for name, value in trained.state_dict().items():
        assert torch.equal(whole[name], value), f"g=1 copy {name} differs from the trained weights"
    total = torch.tensor([float(received)], device=device)
    distributed.all_reduce(total)
    return Outcome(
        f"pp=2 sharded -> generator.tp=2 and 1 equal the trained slices; {int(total)} bytes sent in all, "
        f"{seconds * 1e3:.0f} ms for the g=2 sync",
        {"reshard_bytes": int(total), "reshard_s": seconds},
    )


def row_reshard(device: torch.device, backend: str) -> Outcome:
    return spawn_ranks("_w_reshard", device, backend, timeout_s=120)


def _migration_model(device: torch.device) -> Any:
    from rlhfuse.models import ModelConfig, Transformer

    torch.manual_seed(0)
    if real(device):
        cfg = ModelConfig.tiny(
            vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2,
            head_dim=64,
        )  # fmt: skip
    else:
        cfg = ModelConfig.tiny(
            vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
        )
    return Transformer(cfg, head="lm").to(device).eval()


def _migration_requests(vocab: int, prompts: int) -> list[Any]:
    from rlhfuse.core.types import PromptBatch
    from rlhfuse.generation import requests_for

    g = torch.Generator().manual_seed(1)
    rows = [[1, *torch.randint(3, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()]
            for _ in range(prompts)]  # fmt: skip
    width = max(map(len, rows))
    ids = torch.zeros((prompts, width), dtype=torch.long)
    mask = torch.zeros((prompts, width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return requests_for(
        PromptBatch(ids, mask, torch.arange(prompts)), samples_per_prompt=4, seed=3, iteration=1
    )


def _w_migration(rank: int, device: torch.device) -> Outcome:
    """Two engine instances (generator.instances=2, migration=fixed): the long tail migrates (KV transfer) and
    every sample comes back once, with the tokens one instance alone generates."""
    from rlhfuse import distributed
    from rlhfuse.generation import GenerationEngine, SamplingParams
    from rlhfuse.generation.distributed import DistributedCoordinator, gather_finished

    model = _migration_model(device)
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.95, stop_token_ids=(2,))
    prompts = 16 if real(device) else 6
    slots = prompts * 4
    engine = GenerationEngine(model, params, num_slots=slots, max_len=6 + params.max_new_tokens)
    coordinator = DistributedCoordinator(engine, bs_max=slots, mechanism="kv", timeout_s=30)
    # both ranks start decoding together: the threshold (the whole batch) is met at the first count the ranks
    # exchange, while the samples are still running, so the tail moves whatever the ranks' start-up times
    distributed.barrier(device)
    t0 = time.perf_counter()
    done = list(coordinator.run(_migration_requests(vocab, prompts), threshold=slots))
    everything = gather_finished(done)
    seconds = time.perf_counter() - t0
    report = coordinator.report
    rows = [r.row for r in everything]
    assert rows == list(range(slots)), f"rows back: {rows}"
    assert report.samples_moved > 0, "nothing migrated (threshold = the whole batch)"
    single = GenerationEngine(model, params, num_slots=slots, max_len=6 + params.max_new_tokens)
    single.add(_migration_requests(vocab, prompts))
    alone: dict[int, list[int]] = {}
    while single.has_work():
        alone.update({r.row: r.tokens for r in single.step()})
    same = sum(alone[r.row] == r.tokens for r in everything)
    # on the CPU the tokens are exact; a GPU's matmuls may round differently in other batch shapes, and one flipped
    # sampled token changes the rest of its sample: most samples must still agree exactly
    need = slots if not real(device) else math.ceil(0.9 * slots)
    assert same >= need, f"{same}/{slots} samples equal one instance's tokens (need {need})"
    return Outcome(
        f"{report.samples_moved} samples migrated ({report.mechanism}), {same}/{slots} samples token-identical "
        f"to one instance; {seconds:.2f} s",
        {"migration_samples_moved": report.samples_moved},
    )


def row_migration(device: torch.device, backend: str) -> Outcome:
    return spawn_ranks("_w_migration", device, backend, timeout_s=100)


def row_gqa_attention(device: torch.device, backend: str) -> Outcome:
    """Grouped-query attention in bf16 through the model's own attention with the math kernel excluded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlhfuse.models import ModelConfig, Transformer

    if real(device):
        cfg = ModelConfig.tiny(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=2, num_heads=16, num_kv_heads=4,
            head_dim=128, max_position_embeddings=4096,
        )  # fmt: skip
        batch, length = 8, 1024
    else:
        cfg = ModelConfig.tiny()  # 4 query heads, 2 kv heads
        batch, length = 2, 16
    assert cfg.num_kv_heads < cfg.num_heads
    torch.manual_seed(0)
    model = Transformer(cfg).to(device, torch.bfloat16).eval()
    reference = copy.deepcopy(model).float()
    ids = torch.randint(0, cfg.vocab_size, (batch, length), device=device)
    padded = torch.ones(batch, length, dtype=torch.long, device=device)
    for b in range(batch):
        padded[b, : (b * length) // (2 * batch)] = 0  # left padding of 0 .. length / 2
    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    details, failures = [], []
    for case, mask in (("unmasked", None), ("padded", padded)):
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(fast):
                    got = model(ids, attention_mask_BT=mask)
            except RuntimeError as refused:
                why = "; ".join(str(w.message).splitlines()[0] for w in caught)[:300]
                failures.append(f"{case}: no flash/efficient/cudnn kernel ran ({str(refused)[:80]}; {why})")
                continue
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            want = reference(ids, attention_mask_BT=mask)
        keep = slice(None) if mask is None else mask.bool()
        error = rel_err(got.float()[keep], want[keep])
        if not error < 2e-2:
            failures.append(f"{case}: bf16 vs fp32 math relative error {error:.2e} (> 2e-2)")
        details.append(f"{case} {error:.1e}")
    if failures:
        raise AssertionError("; ".join(failures))
    return Outcome(
        f"{cfg.num_heads} q / {cfg.num_kv_heads} kv heads, bf16, math kernel excluded, error vs fp32 math: "
        + ", ".join(details)
    )


def check_engine(device: torch.device) -> str:
    from rlhfuse.core.types import PromptBatch
    from rlhfuse.generation.generation_config import GenerationConfig
    from rlhfuse.generation.generator import EngineGenerator, EnginePool, InstanceSetup
    from rlhfuse.models import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny())
    config = GenerationConfig()
    config.sampling.temperature = 0.0  # greedy
    config.sampling.max_new_tokens = 12
    prompts = PromptBatch(torch.randint(3, 128, (4, 6)), torch.ones(4, 6, dtype=torch.long), torch.arange(4))
    out = {}
    for where in (torch.device("cpu"), device):
        gen = EngineGenerator(EnginePool(model.to(where), config.engine), config, InstanceSetup(
                              eos_token_id=1, pad_token_id=0, samples_per_prompt=1, seed=0))  # fmt: skip
        (rollout,) = gen.generate(prompts.to(where), iteration=1)
        out[where.type] = rollout.response_ids_BR.cpu()
    assert torch.equal(out["cpu"], out[device.type]), out
    return f"engine greedy tokens on {device} equal the CPU's ({tuple(out['cpu'].shape)})"


def row_engine(device: torch.device, backend: str) -> Outcome:
    return Outcome(check_engine(device))


def sync_counter() -> Any:
    """`rlhfuse.core.syncs.SyncCounter`, imported when the row runs (its absence is a FAIL naming it)."""
    try:
        from rlhfuse.core.syncs import SyncCounter  # type: ignore[import-not-found,unused-ignore]
    except ImportError as err:
        raise MissingDependency(
            f"rlhfuse.core.syncs.SyncCounter is missing ({err}): syncs per decode step cannot be counted"
        ) from err
    return SyncCounter


@dataclass(frozen=True)
class DecodeSetup:
    """The decode rows' model and sizes: width 1024, 8 layers, GQA 16 / 4 heads in bf16 on CUDA; tiny on the CPU."""

    model: Any
    sizes: tuple[int, ...]  # decode batch sizes
    prompt: int  # prompt tokens per sample
    steps: int  # timed decode steps per batch size

    @staticmethod
    def of(device: torch.device) -> DecodeSetup:
        from rlhfuse.models import ModelConfig, Transformer

        if real(device):
            cfg = ModelConfig.tiny(
                vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                num_kv_heads=4, head_dim=64, max_position_embeddings=4096,
            )  # fmt: skip
            sizes: tuple[int, ...] = (1, 8, 32, 128)
            prompt, steps = 64, 32
        else:
            cfg = ModelConfig.tiny()
            sizes, prompt, steps = (1, 4), 6, 4
        torch.manual_seed(0)
        return DecodeSetup(Transformer(cfg).to(device, torch.bfloat16).eval(), sizes, prompt, steps)

    def warm_engine(self, batch: int) -> Any:
        """An engine with `batch` running samples after its prefill and one warm decode step; every later step
        decodes all of them (no stop token, room for `steps` more tokens)."""
        from rlhfuse.generation import GenerationEngine, SamplingParams
        from rlhfuse.generation.engine import SampleRequest

        params = SamplingParams(max_new_tokens=self.steps + 4, temperature=1.0)
        engine = GenerationEngine(self.model, params, num_slots=batch, max_len=self.prompt + self.steps + 4)
        g = torch.Generator().manual_seed(batch)
        vocab = self.model.config.vocab_size
        engine.add(
            SampleRequest(row=i, prompt_index=i, sample_index=0, group=i, seed=i,
                          prompt_P=torch.randint(3, vocab, (self.prompt,), generator=g))
            for i in range(batch)
        )  # fmt: skip
        engine.step()  # prefill and the first decode step
        engine.step()  # one warm decode step
        return engine

    def decode(self, engine: Any) -> list[float]:
        """`steps` decode steps of every running sample; their seconds."""
        for _ in range(self.steps):
            engine.step()
        done = list(engine.stats.step_seconds[-self.steps :])
        full = all(b == engine.cache.num_slots for b in engine.stats.batch_sizes[-self.steps :])
        assert len(done) == self.steps and full, engine.stats.batch_sizes
        return done


def row_engine_decode(device: torch.device, backend: str) -> Outcome:
    """bf16 decode through the generation engine: step time per batch size, tokens/s, prefill throughput; held
    to the device's `Targets`: the tokens/s floor at the largest batch, the KV pool's allocated / most in use
    and (CUDA) the allocator's peak while decoding the largest batch / what was allocated before."""
    goal = targets(device)
    setup = DecodeSetup.of(device)
    step_ms = {}
    before: int | None = None  # bytes allocated when the largest batch starts decoding (CUDA)
    for bs in setup.sizes:
        engine = setup.warm_engine(bs)
        if bs == setup.sizes[-1] and device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        step_ms[str(bs)] = statistics.median(setup.decode(engine)) * 1e3
    memory_fraction = None if before is None else torch.cuda.max_memory_allocated(device) / before
    pool_fraction = engine.cache.nbytes() / engine.cache.peak_nbytes_in_use
    largest = str(setup.sizes[-1])
    tokens_per_s = setup.sizes[-1] / (step_ms[largest] / 1e3)
    missed = []
    if not tokens_per_s >= goal.decode_tokens_per_s:
        missed.append(
            f"{tokens_per_s:,.0f} tokens/s at bs {largest} (target >= {goal.decode_tokens_per_s:,.0f})"
        )
    if not pool_fraction <= goal.kv_pool_fraction:
        missed.append(
            f"KV pool allocated / most in use {pool_fraction:.2f} (target <= {goal.kv_pool_fraction})"
        )
    if memory_fraction is not None and goal.decode_memory_fraction is not None:
        if not memory_fraction <= goal.decode_memory_fraction:
            missed.append(
                f"peak memory while decoding / before {memory_fraction:.2f} (target <= {goal.decode_memory_fraction})"
            )
    if missed:
        raise AssertionError(f"{device.type} targets missed: " + "; ".join(missed))
    # prefill: one forward over a batch of full-length prompts (what admission of a batch costs)
    pb, pt = (32, 512) if real(device) else (2, 16)
    ids = torch.randint(0, setup.model.config.vocab_size, (pb, pt), device=device)
    with torch.no_grad():
        prefill_ms = time_ms(lambda: setup.model(ids), device, reps=5 if real(device) else 1)
    prefill_tps = pb * pt / (prefill_ms / 1e3)
    figures = {
        "decode_step_ms": step_ms,
        "decode_tokens_per_s": tokens_per_s,
        "prefill_tokens_per_s": prefill_tps,
        "kv_pool_fraction": pool_fraction,
        "decode_memory_fraction": memory_fraction,
        # what `rlhfuse-plan calibrate --from` needs to price the same work: the model's shape, the decode context
        # (prompt, then 2 warm steps before the timed ones) and the prefill batch
        "decode_model": {**model_shape(setup.model.config), "prompt": setup.prompt, "warm_steps": 2,
                         "steps": setup.steps, "dtype": "bf16"},
        "prefill_batch": [pb, pt],
    }  # fmt: skip
    shown = ", ".join(f"bs {k}: {v:.2f} ms" for k, v in step_ms.items())
    memory = "" if memory_fraction is None else f", peak memory / before {memory_fraction:.2f}"
    return Outcome(
        f"{shown}; {tokens_per_s:,.0f} tokens/s at bs {largest} (>= {goal.decode_tokens_per_s:,.0f}); prefill "
        f"{prefill_tps:,.0f} tokens/s; KV pool allocated / most in use {pool_fraction:.2f}{memory}",
        figures,
    )


def row_decode_syncs(device: torch.device, backend: str) -> Outcome:
    """Device syncs per engine decode step (`rlhfuse.core.syncs.SyncCounter`) at the smallest and largest batch."""
    SyncCounter = sync_counter()
    setup = DecodeSetup.of(device)
    syncs = {}
    for bs in (setup.sizes[0], setup.sizes[-1]):
        engine = setup.warm_engine(bs)
        with SyncCounter() as counter:
            setup.decode(engine)
        syncs[str(bs)] = counter.count / setup.steps
    most = targets(device).decode_syncs_per_step
    over = {k: v for k, v in syncs.items() if not v <= most}
    assert not over, f"syncs per decode step {over} (target <= {most:g}: the step's one read of its tokens)"
    if device.type == "cuda":
        # each step reads its sampled tokens on the host at least once: a counter that sees nothing is broken
        assert all(v >= 1 for v in syncs.values()), f"SyncCounter counted {syncs} syncs per decode step (< 1)"
    shown = ", ".join(f"bs {k}: {v:.1f}" for k, v in syncs.items())
    return Outcome(f"syncs per decode step {shown} (<= {most:g})", {"decode_syncs_per_step": syncs})


def backend_row(name: str, module: str) -> RowFn:
    """`attention_backend=name` with fp32 weights under bf16 autocast, a Llama and a Qwen3 (q/k RMSNorm) model:
    q/k/v dtypes agree at the kernel and the logits match sdpa within bf16 tolerance."""

    def row(device: torch.device, backend: str) -> Outcome:
        extra(module)
        if device.type != "cuda":
            raise Skip(f"{EXTRA_MODULES[module.split('.')[0]]} kernels run on CUDA only")
        from rlhfuse.models import ModelConfig

        if "attention_backend" not in {f.name for f in dataclasses.fields(ModelConfig)}:
            raise MissingDependency(
                "ModelConfig.attention_backend is missing (model.attention_backend=flash|te)"
            )
        details = [_backend_case(name, architecture, device) for architecture in ("llama", "qwen3")]
        return Outcome("fp32 weights, bf16 autocast: " + "; ".join(details))

    return row


def _backend_case(name: str, architecture: str, device: torch.device) -> str:
    """One model family through `attention_backend=name`: the backend row's checks; its detail."""
    from rlhfuse.models import ModelConfig, Transformer

    cfg = ModelConfig.tiny(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=2, num_heads=16, num_kv_heads=4,
        head_dim=64, attention_backend=name, max_position_embeddings=4096, architecture=architecture,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).eval()  # fp32 weights
    reference = Transformer(dataclasses.replace(cfg, attention_backend="sdpa")).to(device).eval()
    reference.load_state_dict(model.state_dict())
    seen: list[tuple[str, ...]] = []
    for layer in model.layers:
        attend = layer.self_attn.attend

        def recording(q: Any, k: Any, v: Any, mask: Any, attend: Any = attend) -> Any:
            seen.append((str(q.dtype), str(k.dtype), str(v.dtype)))
            return attend(q, k, v, mask)

        layer.self_attn.attend = recording
    ids = torch.randint(0, cfg.vocab_size, (4, 512), device=device)
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            got = model(ids)
            want = reference(ids)
    except Exception as refused:  # the kernel's own refusal; mixed dtypes are the likely cause, said first
        mixed = sorted({s for s in seen if len(set(s)) > 1})
        if mixed:
            raise AssertionError(
                f"{architecture}: q/k/v dtypes disagree at the {name} kernel: {mixed} ({describe(refused)})"
            ) from refused
        raise
    assert seen, f"attention_backend={name} was never called"
    mixed = sorted({s for s in seen if len(set(s)) > 1})
    assert not mixed, f"{architecture}: q/k/v dtypes disagree at the {name} kernel: {mixed}"
    err = rel_err(got.float(), want.float())
    assert err < 2e-2, f"{architecture}: {name} vs sdpa logits: relative error {err:.2e} (> 2e-2)"
    return f"{architecture}: q/k/v {seen[0][0]} at {len(seen)} calls, vs sdpa {err:.1e}"


def _triton_on(device: torch.device) -> None:
    core("triton")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise Skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")


def row_logprobs_kernel(device: torch.device, backend: str) -> Outcome:
    from rlhfuse.algorithms.logits import chosen_logprobs_torch
    from rlhfuse.algorithms.ops import chosen_logprobs

    _triton_on(device)
    n, v = (8192, 152064) if real(device) else (64, 512)
    reps = 10 if real(device) else 1
    g = torch.Generator(device=device).manual_seed(0)
    logits = (2 * torch.randn(n, v, generator=g, device=device)).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    kernel = lambda: chosen_logprobs(logits, labels, 0.7, backend="triton")  # noqa: E731
    ref = lambda: chosen_logprobs_torch(logits, labels, 0.7)  # noqa: E731
    got, want = kernel(), ref()
    (grad,) = torch.autograd.grad(got.sum(), logits)
    (ref_grad,) = torch.autograd.grad(want.sum(), logits)
    err = float((got.detach().float() - want.detach().float()).abs().max())
    gerr = rel_err(grad.float(), ref_grad.float())
    assert err < 1e-3 and gerr < 1e-2, f"value error {err:.2e} (> 1e-3), gradient relative error {gerr:.2e}"
    with torch.no_grad():
        k_ms = time_ms(kernel, device, reps)
        r_ms = time_ms(ref, device, reps)
    kb_ms = time_ms(lambda: torch.autograd.grad(kernel().sum(), logits), device, reps)
    rb_ms = time_ms(lambda: torch.autograd.grad(ref().sum(), logits), device, reps)
    figures = {
        "logprobs_ms": {"triton": k_ms, "torch": r_ms, "triton_fwd_bwd": kb_ms, "torch_fwd_bwd": rb_ms}
    }
    return Outcome(
        f"N={n} V={v} bf16: forward {k_ms:.2f} ms vs torch {r_ms:.2f} ({r_ms / k_ms:.2f}x), fwd+bwd {kb_ms:.2f} "
        f"vs {rb_ms:.2f} ({rb_ms / kb_ms:.2f}x); value error {err:.1e}, gradient {gerr:.1e}",
        figures,
    )


def row_gae_kernel(device: torch.device, backend: str) -> Outcome:
    from rlhfuse.algorithms.gae import compute_gae_scan
    from rlhfuse.algorithms.ops import gae

    _triton_on(device)
    b, t = (256, 4096) if real(device) else (16, 300)
    reps = 20 if real(device) else 1
    g = torch.Generator(device=device).manual_seed(0)
    r = torch.randn(b, t, generator=g, device=device)
    v = torch.randn(b, t, generator=g, device=device)
    lengths = torch.randint(1, t + 1, (b, 1), generator=g, device=device)
    m = (torch.arange(t, device=device) < lengths).float()
    a, ret = gae(r, v, m, 0.99, 0.95, backend="triton")
    a_ref, ret_ref = compute_gae_scan(r.double(), v.double(), m.double(), 0.99, 0.95)
    err = max(float((a.double() - a_ref).abs().max()), float((ret.double() - ret_ref).abs().max()))
    assert err < 1e-3, f"Triton GAE vs the fp64 scan: max error {err:.2e}"
    k_ms = time_ms(lambda: gae(r, v, m, 0.99, 0.95, backend="triton"), device, reps)
    r_ms = time_ms(lambda: compute_gae_scan(r, v, m, 0.99, 0.95), device, reps)
    return Outcome(
        f"{b}x{t}: Triton {k_ms:.3f} ms vs torch scan {r_ms:.3f} ms ({r_ms / k_ms:.1f}x); max error {err:.1e}",
        {"gae_ms": {"triton": k_ms, "torch": r_ms}},
    )


def row_exact_kernels(device: torch.device, backend: str) -> Outcome:
    """exact=true's CUDA kernels (kernels/exact.py): a decode step's query and a linear's row give the bits of
    their call alone inside a batch of random others, close to SDPA / F.linear; their time beside those."""
    import torch.nn.functional as F

    from rlhfuse._resources import load_kernel_module

    _triton_on(device)
    kernels = load_kernel_module("exact")
    b, h, kv, s, e, n, features = (
        (64, 16, 4, 1024, 128, 4096, 2048) if real(device) else (4, 4, 2, 40, 16, 50, 40)
    )
    reps = 10 if real(device) else 1
    dtype = torch.bfloat16 if real(device) else torch.float32  # the interpreter computes no bf16 dot
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, 1, e, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(b, kv, s, e, generator=g, device=device, dtype=dtype) for _ in range(2))
    pads = torch.randint(0, s // 2, (b,), generator=g, device=device)
    allowed = (torch.arange(s, device=device) >= pads[:, None])[:, None, None]
    attend = lambda: kernels.exact_attention(q, k, v, allowed, e**-0.5, None, None)  # noqa: E731
    out = attend()
    row, pad = b - 1, int(pads[b - 1])
    every = torch.ones(1, 1, 1, s - pad, dtype=torch.bool, device=device)  # its keys, all of them
    alone = kernels.exact_attention(q[row:], k[row:, :, pad:], v[row:, :, pad:], every, e**-0.5, None, None)
    assert torch.equal(out[row:], alone), "a decode query's bits changed with the batch around it"
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # noqa: E731
    attention_err = float((out.float() - sdpa().float()).abs().max())
    x = torch.randn(n, features, generator=g, device=device, dtype=dtype)
    weight = torch.randn(features, features, generator=g, device=device, dtype=dtype) / features**0.5
    y = kernels.invariant_matmul(x, weight)
    # on a GPU a row inside a tile (the claim); the interpreter's dot is numpy's BLAS, whose bits may change with
    # a row's place in the tile: there a row at a tile's first place
    place = n // 2 + 5 if real(device) else kernels.BLOCK_M
    assert torch.equal(y[place : place + 1], kernels.invariant_matmul(x[place : place + 1], weight)), (
        "a linear row's bits changed with the rows around it"
    )
    linear_err = rel_err(y.float(), F.linear(x, weight).float())
    assert attention_err < 3e-2 and linear_err < 1e-2, (
        f"attention error {attention_err:.1e}, linear {linear_err:.1e}"
    )
    times = {
        "attention": time_ms(attend, device, reps),
        "sdpa": time_ms(sdpa, device, reps),
        "matmul": time_ms(lambda: kernels.invariant_matmul(x, weight), device, reps),
        "linear": time_ms(lambda: F.linear(x, weight), device, reps),
    }
    return Outcome(
        f"decode {b}x{h} heads over {s} keys {str(dtype)[6:]}: {times['attention']:.2f} ms vs SDPA {times['sdpa']:.2f}; "
        f"linear {n}x{features}x{features}: {times['matmul']:.2f} ms vs F.linear {times['linear']:.2f}; "
        f"a row alone = in its batch (both); errors {attention_err:.1e}, {linear_err:.1e}",
        {"exact_ms": times},
    )


def _train(overrides: list[str], folder: str | None = None) -> dict[str, float]:
    """The job `overrides` describe, built and fitted in this process (its warm-start cache and run folder in
    `folder`, which the ranks of a multi-rank job share; a temporary one by default); its last metrics."""
    core("hydra")
    from rlhfuse.trainer.build import build_trainer
    from rlhfuse.trainer.hydra import compose_config

    with contextlib.ExitStack() as stack:
        where = folder or stack.enter_context(tempfile.TemporaryDirectory())
        cfg = compose_config([*overrides, f"model.warmstart.cache_dir={where}/cache"])
        history = build_trainer(cfg, run_dir=f"{where}/run", log=lambda _: None).fit()
    last = history[-1]
    bad = [k for k, v in last.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, f"non-finite metrics: {bad}"
    return last


def _shown(last: dict[str, float], keys: tuple[str, ...] = ()) -> str:
    keys = (*keys, "reward/mean", "loss/policy", "loss/value", "time/iteration")
    return ", ".join(f"{k} {last[k]:.4g}" for k in keys if isinstance(last.get(k), float))


@dataclass(frozen=True)
class TrainerSetting:
    overrides: tuple[str, ...]
    shown: tuple[str, ...] = ()  # the metrics that show the setting took effect
    positive: tuple[str, ...] = ()  # metrics that must be > 0
    cuda_only: str = ""  # why the setting means nothing without CUDA (a SKIP there); "" = runs anywhere


CPU_OFFLOAD_NEEDS_CUDA = (
    "pipeline.cpu_offload moves the shards between host memory and a CUDA device (the run's configuration "
    "check refuses it on the CPU)"
)

# one iteration of the smoke job through the trainer, per setting (the keys as conf/ spells them)
TRAINER_SETTINGS = {
    "bf16-true": TrainerSetting(("pipeline.precision=bf16-true",), ("memory/param_bytes",)),
    "micro_batch_tokens": TrainerSetting(("data.micro_batch_tokens=48",)),
    # FSDP2 over a one-rank NCCL group: bf16-mixed units, DCP-free; then the shards in pinned host memory
    "fsdp": TrainerSetting(("pipeline=fsdp",), ("memory/param_bytes", "memory/optimizer_bytes")),
    "fsdp cpu_offload": TrainerSetting(
        ("pipeline=fsdp", "pipeline.cpu_offload=true"),
        ("memory/param_bytes", "memory/optimizer_bytes"),
        cuda_only=CPU_OFFLOAD_NEEDS_CUDA,
    ),
    "offload": TrainerSetting(("inferencer.offload_frozen=true",), ("memory/param_bytes",)),
    "speculative": TrainerSetting(
        ("generator=engine", "generator.speculative=ngram"),
        ("generation/spec_accept_rate", "generation/spec_tokens_per_step"),
    ),
    # two engine instances stepped in this process (the launcher's one process per instance needs a GPU each);
    # Rt = the smoke job's whole batch (4 prompts x 2 samples): the tail moves at the first count
    "trainer migration": TrainerSetting(
        (
            "generator=engine",
            "generator.instances=2",
            "generator.in_process=true",
            "migration=fixed",
            "migration.threshold=8",
        ),
        ("migration/samples_moved", "migration/destinations"),
        ("migration/samples_moved",),
    ),
}


def trainer_row(setting: TrainerSetting) -> RowFn:
    def row(device: torch.device, backend: str) -> Outcome:
        if setting.cuda_only and device.type != "cuda":
            raise Skip(f"CUDA only: {setting.cuda_only}")
        last = _train(["experiment=smoke", "iterations=1", f"device={device.type}", *setting.overrides])
        zero = [k for k in setting.positive if not last.get(k, 0) > 0]
        assert not zero, f"{' '.join(setting.overrides)}: {zero} not > 0 ({_shown(last, setting.shown)})"
        return Outcome(f"{' '.join(setting.overrides)}: finite metrics, {_shown(last, setting.shown)}")

    return row


def row_default_job(device: torch.device, backend: str) -> Outcome:
    import rlhfuse.algorithms.ops as ops

    calls = {"triton": 0}
    original = ops._use_triton

    def counting(backend: str | None, *tensors: torch.Tensor) -> bool:
        used = original(backend, *tensors)
        calls["triton"] += int(used)
        return used

    ops._use_triton = counting  # type: ignore[assignment]
    # the second iteration (a weight sync after a step, bf16 on a GPU) matters on CUDA; the CPU's dry run proves
    # the row's call with one, after a warm start of the smoke job's size (the default's 400 + 400 steps were
    # ~60 s of the dry run)
    iterations = 2 if device.type == "cuda" else 1
    small_warmstart = [
        f"model.warmstart.{key}={value}"
        for key, value in (("sft_examples", 256), ("sft_steps", 10), ("rm_pairs", 256), ("rm_steps", 10))
    ]
    try:
        start = time.perf_counter()
        last = _train(
            [
                "experiment=default",
                f"iterations={iterations}",
                f"device={device}",
                "checkpoint.export_hf=false",
                *(small_warmstart if device.type == "cpu" else []),
            ]
        )
    finally:
        ops._use_triton = original  # type: ignore[assignment]
    if device.type == "cuda":
        assert calls["triton"] > 0, "no Triton kernel ran in training"
    return Outcome(
        f"{iterations} iteration(s) in {time.perf_counter() - start:.0f} s, {_shown(last)}, "
        f"{calls['triton']} Triton kernel calls"
    )


def row_vllm(device: torch.device, backend: str) -> Outcome:
    if not installed("vllm"):
        raise Skip("vllm not installed")
    last = _train(["experiment=smoke", "generator=vllm", "iterations=1", f"device={device}"])
    return Outcome(f"smoke job with generator=vllm: {_shown(last)}")


def _job_fused(device: torch.device, folder: str) -> Outcome:
    """One rank of the smoke job under pipeline=fused (Actor and Critic pp=2 over the 2 ranks in opposite
    directions, a profiling step, then the searched fused schedule; the weight sync to each rank's engine): finite
    metrics, a bubble ratio in [0, 1), bytes synced. Two iterations on CUDA (the second generates with synced
    weights); one on the CPU, with the greedy schedule search (budget 0)."""
    iterations, search_s = (2, 0.5) if real(device) else (1, 0.0)
    last = _train(
        [
            "experiment=smoke", "pipeline=fused", "distributed.nproc_per_node=2", "model.num_layers=2",
            f"iterations={iterations}", f"device={device.type}", "distributed.timeout_s=60",
            f"pipeline.search_budget_s={search_s}",
        ],
        folder,
    )  # fmt: skip
    bubble = last.get("train/bubble_ratio", math.nan)
    assert 0 <= bubble < 1, f"train/bubble_ratio {bubble} is not in [0, 1) ({_shown(last)})"
    zero = [k for k in ("weight_sync/bytes_per_rank", "memory/param_bytes") if not last.get(k, 0) > 0]
    assert not zero, f"{zero} not > 0: the fused pipeline's weight sync or its stages did nothing"
    shown = _shown(last, ("train/bubble_ratio", "train/measured_makespan_s", "weight_sync/bytes_per_rank"))
    return Outcome(f"smoke job, pipeline=fused on 2 ranks, {iterations} iteration(s): {shown}")


JOBS: dict[str, Callable[[torch.device, str], Outcome]] = {"fused": _job_fused}
"""Trainer jobs run on several ranks (`spawn_job`): a rank's outcome from the device and the ranks' shared folder."""


def row_fused_job(device: torch.device, backend: str) -> Outcome:
    """`pipeline=fused` through the trainer (`build_trainer(...).fit()`) on 2 ranks launched as `torchrun --nnodes=2
    --nproc-per-node=1` launches them: Fabric's own launcher (`distributed.nproc_per_node=2`) asks for one GPU per
    process, so each rank is a node of its own on cuda:0 (whatever the GPUs), with its own NCCL_HOSTID; a SKIP
    where this NCCL refuses that."""
    return on_shared_gpu(lambda: spawn_job("fused", device, backend, timeout_s=150), world=2, gpus=1)


REAL_PROMPTS = (
    "What is 7 + 5?",
    "Name a primary colour.",
    "Write a word that rhymes with cat.",
    "What is the capital of France?",
)


def real_model_missing() -> str:
    """The real-checkpoint row's SKIP: where the converted model was looked for, and how to make it."""
    from rlhfuse.models.convert import real_model_dir

    return f"no converted SmolLM2-135M-Instruct at {real_model_dir()}: run `make real-model` (or set RLHFUSE_REAL_MODEL)"


def _engine_vs_trainer(
    engine_model: Any, model: Any, tokenizer: Any, prompts: tuple[str, ...], new_tokens: int, autocast: Any
) -> tuple[torch.Tensor, float, int]:
    """Each prompt's greedy response from an engine over `engine_model`, scored again by the inferencer's
    forward (`logprobs_from_output`) of `model` under `autocast`: |engine log-prob - trainer log-prob| per
    response token, the fraction of tokens that are the forward's argmax too, and how many tokens."""
    from rlhfuse.core.inference import logprobs_from_output
    from rlhfuse.generation import GenerationEngine, SamplingParams
    from rlhfuse.generation.engine import SampleRequest, to_rollout

    device = next(model.parameters()).device
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=tokenizer.stop_ids)
    diffs, agree = [], 0
    for i, text in enumerate(prompts):
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        engine = GenerationEngine(engine_model, params, num_slots=1, max_len=len(ids) + new_tokens)
        request = SampleRequest(
            row=0, prompt_index=i, sample_index=0, group=0, seed=0, prompt_P=torch.tensor(ids)
        )
        (done,) = engine.run([request])
        rollout = to_rollout([done], tokenizer.pad_id).to(device)
        with torch.no_grad(), autocast:
            logits_BTV = model(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)
        trainer_R = logprobs_from_output(logits_BTV, rollout, temperature=1.0)[0]
        engine_R = torch.tensor(done.logprobs, device=device)  # the log-probs the engine recorded
        assert engine_R.shape == trainer_R.shape == (len(done.tokens),), (engine_R.shape, trainer_R.shape)
        diffs.append((engine_R - trainer_R).abs())
        argmax_R = logits_BTV[0, len(ids) - 1 : -1].argmax(dim=-1)
        agree += int((argmax_R == rollout.response_ids_BR[0]).sum())
    diff = torch.cat(diffs).cpu()
    return diff, agree / len(diff), len(diff)


def row_real_checkpoint(device: torch.device, backend: str) -> Outcome:
    """SmolLM2-135M-Instruct as `make real-model` converts it: loaded (fp32, as training holds it), a few greedy
    tokens from the engine (prefill, then KV-cached decode), scored again by the trainer's forward: in fp32 the
    log-probs the engine chose from equal the forward's (< 1e-3) and every token is the forward's argmax. On CUDA
    also the engine in bf16 (the generator's dtype) against the forward under bf16 autocast (bf16-mixed
    training): figures, the mean difference held to a loose first-run bound. The CPU decodes 4 tokens of one
    prompt."""
    from rlhfuse.data.tokenizer import Tokenizer
    from rlhfuse.models import from_pretrained
    from rlhfuse.models.convert import is_converted, real_model_dir

    if not is_converted():
        raise Skip(real_model_missing())
    folder = real_model_dir()
    tokenizer = Tokenizer.from_dir(folder, model_dir=folder)
    t0 = time.perf_counter()
    model = from_pretrained(folder).to(device).eval()
    sync(device)
    load_s = time.perf_counter() - t0
    prompts, new_tokens = (REAL_PROMPTS, 32) if real(device) else (REAL_PROMPTS[:1], 4)
    diff, agree, tokens = _engine_vs_trainer(
        model, model, tokenizer, prompts, new_tokens, contextlib.nullcontext()
    )  # fmt: skip
    worst = float(diff.max())
    assert worst < 1e-3, f"fp32: engine vs trainer log-probs differ by up to {worst:.2e} (> 1e-3)"
    assert agree == 1.0, f"fp32: {agree:.0%} of the engine's greedy tokens are the trainer forward's argmax"
    figures: dict[str, Any] = {"real_checkpoint": {"load_s": load_s, "fp32_logprob_max_abs": worst}}
    detail = (
        f"{model.config.num_layers} layers, V={model.config.vocab_size}, loaded in {load_s:.1f} s; {tokens} greedy "
        f"tokens, fp32 engine vs trainer log-probs max |diff| {worst:.1e}"
    )
    if device.type == "cuda":
        engine_model = copy.deepcopy(model).to(torch.bfloat16)
        bf16 = torch.autocast("cuda", dtype=torch.bfloat16)
        diff, agree, _ = _engine_vs_trainer(engine_model, model, tokenizer, prompts, new_tokens, bf16)
        mean, most = float(diff.mean()), float(diff.max())
        figures["real_checkpoint"].update(
            bf16_logprob_mean_abs=mean, bf16_logprob_max_abs=most, bf16_argmax_agreement=agree
        )
        # a first-run bound on the mean only: bf16 noise is ~1e-2 on average (single tokens may differ more); a
        # wrong position, cache slot or rotary angle in one path costs whole nats on most tokens. The fp32
        # comparison above is the exact check; tighten this one from the figures
        assert mean < 0.1, f"bf16 engine vs trainer log-probs: mean |diff| {mean:.3f} (> 0.1), max {most:.3f}"
        detail += f"; bf16 engine vs bf16-mixed trainer mean {mean:.1e}, max {most:.1e}, argmax {agree:.0%}"
    return Outcome(detail, figures)


TIERS = ("quick", "full")
"""quick: what a first run on a GPU most needs (NCCL, the pipelines, attention kernels, decode, the Triton
log-prob kernel), its row limits within QUICK_TIER_S; full: every row."""


@dataclass(frozen=True)
class Check:
    fn: RowFn
    limit_s: float  # this row's own time limit on CUDA (its subprocess is killed after it), start-up included
    tier: str = "full"  # the first tier that runs it: quick rows run in both


# Limits: a row is a fresh process (interpreter, torch, CUDA context: ~10 s), a 2-rank row three of them plus
# NCCL's start-up (~25 s), then the row's own work at real sizes.
CHECKS: dict[str, Check] = {
    "dependencies": Check(row_dependencies, 30, "quick"),
    "collectives": Check(row_collectives, 40, "quick"),
    "nccl 2 ranks": Check(row_two_rank_collectives, 70, "quick"),
    "pp=2 train step": Check(row_pp2_train, 90, "quick"),
    "pp=3 train step": Check(row_pp3_train, 130),  # 3 ranks' start-up and NCCL, ~10 p2p communicators
    "pp=2 inference": Check(row_pp2_inference, 70, "quick"),
    "reshard": Check(row_reshard, 90),
    "migration": Check(row_migration, 75),
    "gqa attention": Check(row_gqa_attention, 40, "quick"),
    "engine": Check(row_engine, 40),
    "engine decode": Check(row_engine_decode, 60, "quick"),
    "decode syncs": Check(row_decode_syncs, 40, "quick"),
    "flash backend": Check(backend_row("flash", "flash_attn"), 60),
    "te backend": Check(backend_row("te", "transformer_engine.pytorch"), 60),
    "logprobs kernel": Check(row_logprobs_kernel, 60, "quick"),
    "gae kernel": Check(row_gae_kernel, 45),
    "exact kernels": Check(row_exact_kernels, 45),
    **{name: Check(trainer_row(setting), 90) for name, setting in TRAINER_SETTINGS.items()},
    "fused job": Check(row_fused_job, 180),
    "real checkpoint": Check(row_real_checkpoint, 90),
    "default job": Check(row_default_job, 180),
    "vllm": Check(row_vllm, 240),
}


def tier_rows(tier: str) -> list[str]:
    """The rows of `tier`, in table order."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}: choose from {TIERS}")
    return [name for name, check in CHECKS.items() if tier == "full" or check.tier == tier]


def budget_for(names: list[str]) -> float:
    """Time for `names` run one by one: their limits and the reserve (no row is left unrun for lack of time)."""
    return sum(CHECKS[name].limit_s for name in names) + RESERVE_S


# --- running, reporting ---------------------------------------------------------------------------------------------
def describe(err: BaseException) -> str:
    """One line for the table: the exception's own last line (assertion messages are written to be read)."""
    line = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return " ".join(line.split())[:400]


def run_row(name: str, device: torch.device, backend: str) -> Row:
    """One row in this process: PASS with its outcome, SKIP, or FAIL with the error's last line."""
    start = time.perf_counter()
    try:
        outcome = CHECKS[name].fn(device, backend)
    except Skip as skip:
        return Row(name, "SKIP", str(skip), time.perf_counter() - start)
    except Exception as err:  # a row, not a crash: the other checks still run
        return Row(name, "FAIL", describe(err), time.perf_counter() - start)
    return Row(name, "PASS", outcome.detail, time.perf_counter() - start, outcome.figures)


def run_checks(device: torch.device, names: list[str], backend: str | None = None) -> list[Row]:
    """The rows in this process, one after the other (the CPU tests run them so)."""
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    return [run_row(name, device, backend) for name in names]


def dry_run(names: list[str] | None = None) -> list[Row]:
    """Every row's code (or `names`') on the CPU, in this process, one after the other: gloo for the 2-rank rows,
    tiny sizes, the Triton interpreter where TRITON_INTERPRET=1; rows that need CUDA-only things (flash-attn,
    Transformer Engine, vLLM's GPU engine, a CUDA device for the setting) SKIP saying why. What it proves: each
    row's calls still match the code they call, and its assertions and targets hold at tiny sizes."""
    import torch.distributed as dist

    rows = []
    for name in names or list(CHECKS):
        threads, grouped = torch.get_num_threads(), dist.is_initialized()
        rows.append(run_row(name, torch.device("cpu"), "gloo"))
        # what a row's own process would have taken with it: the thread count (Lightning sets one per CPU core)
        # and a process group it left (the next row's trainer would take itself for one rank of a world)
        torch.set_num_threads(threads)
        if dist.is_initialized() and not grouped:
            dist.destroy_process_group()
        row = rows[-1]
        print(f"gpu-check dry run: {name}: {row.status} ({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    return rows


def run_isolated(name: str, device: torch.device, backend: str, limit_s: float) -> Row:
    """One row in its own process (a session of its own, so the ranks it spawns go with it), killed at
    `limit_s`: a hang, a CUDA crash or an NCCL abort becomes this row's FAIL."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp, "row.json")
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--row", name, "--device", str(device),
                   "--backend", backend, "--result", str(result)]  # fmt: skip
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return Row(name, "FAIL", f"timed out after {limit_s:.0f} s (killed: a hang or a stuck kernel)",
                       time.perf_counter() - start, {"log_tail": (output or "")[-2000:]})  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks it left behind
        seconds = time.perf_counter() - start
        if not result.exists():
            last = [line for line in (output or "").splitlines() if line.strip()][-1:] or ["no output"]
            return Row(name, "FAIL", f"its process died (exit {proc.returncode}): {last[0][:300]}", seconds,
                       {"log_tail": (output or "")[-2000:]})  # fmt: skip
        data = json.loads(result.read_text())
    row = Row(**{**data, "seconds": seconds})
    if row.status == "FAIL":
        row.figures["log_tail"] = (output or "")[-2000:]
    return row


def run_all(device: torch.device, backend: str, names: list[str], budget_s: float) -> list[Row]:
    """Every named row in its own process, in order, each within its own limit and what is left of the budget."""
    rows: list[Row] = []
    deadline = time.monotonic() + budget_s
    for name in names:
        left = deadline - time.monotonic() - RESERVE_S
        if left < 5:
            rows.append(Row(name, "FAIL", f"not run: the {budget_s:.0f} s budget of the check was spent"))
            continue
        rows.append(run_isolated(name, device, backend, min(CHECKS[name].limit_s, left)))
        print(f"gpu-check: {name}: {rows[-1].status} ({rows[-1].seconds:.0f} s)", file=sys.stderr, flush=True)
    return rows


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    return "\n".join(f"{r.check:<{width}}  {r.status:<4}  {r.detail}" for r in rows)


def default_out() -> Path:
    return Path(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else Path("gpu_check.json")


def write_json(path: Path, rows: list[Row], device: torch.device) -> dict[str, Any]:
    """The figures for calibration: every passing row's measurements, keyed by name, and the table's rows."""
    figures: dict[str, Any] = {}
    for row in rows:
        if row.status == "PASS":
            figures.update({k: v for k, v in row.figures.items() if k != "log_tail"})
    data = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "figures": figures,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checks", nargs="*", help=f"checks to run (default: the tier's, of {list(CHECKS)})")
    parser.add_argument(
        "--tier", choices=TIERS, default="quick",
        help=f"quick (row limits within {QUICK_TIER_S:.0f} s: fits 10 minutes) or full (every row)",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true",
        help="every row's code on the CPU in this process (gloo, tiny sizes): the rows' calls and targets, "
        "not a GPU; exit 1 if any row FAILs",
    )  # fmt: skip
    parser.add_argument("--device", default=None, help="cuda (default where CUDA is available) or cpu")
    parser.add_argument("--backend", default=None, help="nccl (CUDA) or gloo (CPU) by default")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON figures (default $OUT/ or ./gpu_check.json)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="time for the whole check (default: the rows' limits)"
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child: run this one row, write --result
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [n for n in args.checks if n not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}: choose from {list(CHECKS)}")
    if args.dry_run:
        start = time.perf_counter()
        rows = dry_run(args.checks or None)
        if args.out:
            write_json(args.out, rows, torch.device("cpu"))
        print(
            f"gpu-check dry run on the CPU (torch {torch.__version__}, gloo, tiny sizes) in "
            f"{time.perf_counter() - start:.0f} s: the rows' code and targets, nothing about a GPU"
        )
        print(table(rows))
        return 1 if any(r.status == "FAIL" for r in rows) else 0
    if args.device is None and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing was checked")
        return 0
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if args.row:
        if device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(device)
        row = run_row(args.row, device, backend)
        args.result.write_text(json.dumps(dataclasses.asdict(row)))
        return 0
    names = args.checks or tier_rows(args.tier)
    budget_s = budget_for(names) if args.budget_s is None else args.budget_s
    rows = run_all(device, backend, names, budget_s)
    out = args.out or default_out()
    write_json(out, rows, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tier = "rows named" if args.checks else f"{args.tier} tier"
    print(f"gpu-check on {name} (torch {torch.__version__}, {backend}), {tier}; figures in {out}")
    print(table(rows))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
