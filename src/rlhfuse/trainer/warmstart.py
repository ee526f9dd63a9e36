"""Recipe steps for the embedded tasks: a supervised warm start of the tiny Actor and a Bradley–Terry reward
model trained on the task's preference pairs (the synthetic topic task, or the arithmetic task), cached as
Hugging Face checkpoints.

The cache key hashes everything that determines the checkpoints (architecture, warm-start settings, seed and
task parameters), so a changed setting trains anew; a file lock keeps concurrent runs from training twice and the
result is renamed into place only when complete.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhfuse.core.checkpoint import SealedFolder
from rlhfuse.data.synthetic import SyntheticTask
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import ModelConfig, Transformer, save_pretrained
from rlhfuse.trainer.models import ModelsConfig


class WarmStartTask(Protocol):
    """An embedded task the tiny model is warm-started on (a dataclass: its fields key the cache)."""

    max_new_tokens: int

    def tokenizer(self) -> Tokenizer: ...

    def sft_examples(self, count: int) -> list[tuple[str, str]]: ...

    def preference_pairs(self, count: int) -> list[tuple[str, str, str]]: ...


def cache_root(config: ModelsConfig) -> Path:
    if config.warmstart.cache_dir:
        return Path(config.warmstart.cache_dir).expanduser()
    return Path(os.environ.get("RLHFUSE_CACHE", Path.home() / ".cache" / "rlhfuse")).expanduser()


def tiny_model_config(
    config: ModelsConfig, tokenizer: Tokenizer, max_positions: int, *, reward: bool = False
) -> ModelConfig:
    """The embedded Actor's shape, or with `reward` the Reward model's (model.reward_* where set)."""
    return ModelConfig.tiny(
        architecture=config.architecture,
        sliding_window=config.sliding_window,
        vocab_size=tokenizer.vocab_size,
        hidden_size=(reward and config.reward_hidden_size) or config.hidden_size,
        intermediate_size=(reward and config.reward_intermediate_size) or config.intermediate_size,
        num_layers=(reward and config.reward_num_layers) or config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )


def warm_start(
    config: ModelsConfig, task: WarmStartTask, *, seed: int, log: Callable[[str], None] = print
) -> tuple[Path, Path]:
    """Return (sft_path, reward_path), training and caching them on first use."""
    models = dataclasses.asdict(config) | {
        "warmstart": dataclasses.asdict(config.warmstart) | {"cache_dir": None}
    }
    for name in ("reward_hidden_size", "reward_intermediate_size", "reward_num_layers"):
        if not models[name]:
            del models[name]  # unset: the key (and so the cache) of setups from before these fields
    # the kernel that will run the checkpoints is no part of them (the warm start itself trains with sdpa)
    del models["attention_backend"]
    task_key = dataclasses.asdict(task)  # type: ignore[call-overload]
    if not task_key.get("phrase_length", 1):
        del task_key["phrase_length"]  # off: the key of tasks from before the field
    key_source: dict[str, Any] = {
        "models": models,
        "task": task_key,
        "seed": seed,
        "version": 5,  # bump when the task or the training recipe changes
    }
    if not isinstance(task, SyntheticTask):  # the synthetic task's key predates the other tasks
        key_source["task_kind"] = type(task).__name__
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root(config)
    final = root / f"default-{key}"
    if (final / "DONE").is_file():
        log(f"warm start: using cached SFT actor and reward model in {final}")
        return final / "sft", final / "reward"
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"default-{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be training the same checkpoints: wait for it
        if (final / "DONE").is_file():
            return final / "sft", final / "reward"
        # DONE (the key's source and the files' SHA-256) is the seal: written last, then renamed into place
        with SealedFolder(final, str(os.getpid()), seal_file="DONE") as folder:
            _train_and_save(config, task, seed, folder.path, log)
            folder.seal(key_source)
    return final / "sft", final / "reward"


def _train_and_save(
    config: ModelsConfig, task: WarmStartTask, seed: int, out: Path, log: Callable[[str], None]
) -> None:
    tokenizer = task.tokenizer()
    max_positions = 64 + task.max_new_tokens + 16
    model_config = tiny_model_config(config, tokenizer, max_positions)
    ws = config.warmstart

    start = time.perf_counter()
    torch.manual_seed(seed)
    actor = Transformer(model_config, head="lm")
    sft_data = [
        (tokenizer.encode(p), [*tokenizer.encode(r, add_bos=False), tokenizer.eos_id])
        for p, r in task.sft_examples(ws.sft_examples)
    ]
    lengths = torch.tensor([len(r) for _, r in sft_data], dtype=torch.float64)
    p50, p90, p99 = (float(torch.quantile(lengths, q)) for q in (0.5, 0.9, 0.99))
    log(
        f"warm start: SFT response lengths (tokens, EOS included) p50 {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, "
        f"max {int(lengths.max())} over {len(sft_data)} examples"
    )
    loss = _train(
        actor,
        ws.sft_steps,
        ws.sft_lr,
        ws.batch_size,
        seed,
        len(sft_data),
        lambda idx: _sft_loss(actor, [sft_data[i] for i in idx], tokenizer.pad_id),
    )
    log(
        f"warm start: SFT actor trained ({ws.sft_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.1f}s)"
    )
    save_pretrained(actor, out / "sft")
    tokenizer.save(out / "sft")
    tokenizer.save_generation_config(out / "sft")

    start = time.perf_counter()
    torch.manual_seed(seed + 1)
    reward = Transformer(tiny_model_config(config, tokenizer, max_positions, reward=True), head="value")
    pairs = [
        (
            tokenizer.encode(p),
            [*tokenizer.encode(c, add_bos=False), tokenizer.eos_id],
            [*tokenizer.encode(r, add_bos=False), tokenizer.eos_id],
        )
        for p, c, r in task.preference_pairs(ws.rm_pairs)
    ]
    loss = _train(
        reward,
        ws.rm_steps,
        ws.rm_lr,
        ws.batch_size,
        seed + 1,
        len(pairs),
        lambda idx: _bt_loss(reward, [pairs[i] for i in idx], tokenizer.pad_id),
    )
    log(
        f"warm start: reward model trained ({ws.rm_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.1f}s)"
    )
    save_pretrained(reward, out / "reward")
    tokenizer.save(out / "reward")


def _train(
    model: Transformer,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    size: int,
    loss_of: Callable[[list[int]], Tensor],
) -> float:
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1.0 - s / max(1, steps))
    )
    generator = torch.Generator().manual_seed(seed)
    model.train()
    recent: list[float] = []
    for _ in range(steps):
        idx = torch.randint(size, (batch_size,), generator=generator).tolist()
        loss = loss_of(idx)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        recent = [*recent[-19:], float(loss.detach())]
    model.eval()
    return sum(recent) / max(1, len(recent))


def _right_pad(seqs: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids_BT = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask_BT = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BT[i, : len(s)] = torch.tensor(s)
        mask_BT[i, : len(s)] = 1
    return ids_BT, mask_BT


def _sft_loss(actor: Transformer, batch: list[tuple[list[int], list[int]]], pad: int) -> Tensor:
    """Next-token cross-entropy on response tokens only (EOS included)."""
    ids_BT, mask_BT = _right_pad([p + r for p, r in batch], pad)
    labels_BT = torch.full_like(ids_BT, -100)
    for i, (p, r) in enumerate(batch):
        labels_BT[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    logits_BTV = actor(ids_BT, attention_mask_BT=mask_BT)
    return F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), labels_BT[:, 1:].flatten(), ignore_index=-100)


def _bt_loss(reward: Transformer, batch: list[tuple[list[int], list[int], list[int]]], pad: int) -> Tensor:
    """Bradley–Terry: -log sigmoid(r(chosen) - r(rejected)), scores read at the last token."""
    seqs = [p + c for p, c, _ in batch] + [p + r for p, _, r in batch]
    ids_BT, mask_BT = _right_pad(seqs, pad)
    values_BT = reward(ids_BT, attention_mask_BT=mask_BT)
    scores_B = values_BT[torch.arange(len(seqs)), mask_BT.sum(dim=1) - 1]
    chosen_B, rejected_B = scores_B.chunk(2)
    return -F.logsigmoid(chosen_B - rejected_B).mean()
