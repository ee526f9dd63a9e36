"""Vocabulary-parallel sampling (`rlhfuse.generation.vocab_parallel`) in `sampling_dtype`: float32 on CUDA, as the
whole-vocabulary engine samples there, not float64 at every decode step. In float32 the slices' tokens equal the
single-process float32 `filter_logits` + `sample_from`, no [B, Vl] pass runs in float64, and a uniform that rounds
up to 1 still lands on a kept token (never the vocabulary's last token when it was filtered out)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime_helpers import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlhfuse.generation import vocab_parallel

pytestmark = pytest.mark.distributed

VOCAB = 37  # padded to 38 over 2 ranks: the last slice has a padded row


class _WideFloat64(TorchDispatchMode):
    """Records the ops that produce a float64 tensor as wide as a vocabulary slice ([..., width])."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.seen = width, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        wide = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim()]
        if any(t.dtype == torch.float64 and t.shape[-1] == self.width for t in wide):
            self.seen.add(str(func))
        return out


def _logits_and_uniforms() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(64, VOCAB, generator=g, dtype=torch.float64) * 3
    logits[:8] *= 8  # peaked rows: the nucleus is one or two tokens
    logits[8:16, -1] = -30.0  # the vocabulary's last token is filtered out by top-k / top-p in these rows
    uniforms = torch.rand(64, generator=g, dtype=torch.float64)
    uniforms[8:16] = 1 - 2**-30  # rounds up to 1.0 in float32
    return logits.float(), uniforms


def _float32_slices(rank: int, world: int) -> None:
    from rlhfuse.core.sampling import filter_logits, sample_from
    from rlhfuse.runtime.tensor_parallel import VocabShard

    logits, uniforms = _logits_and_uniforms()
    shard = VocabShard.of(VOCAB, rank, world)
    local = torch.full((64, shard.size), 123.0)  # padded rows hold garbage
    local[:, : shard.valid] = logits[:, shard.start : shard.start + shard.valid]
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9), (7, 0.8), (40, 0.99)):
        args: dict[str, Any] = dict(temperature=0.7, top_k=top_k, top_p=top_p)
        want = filter_logits(logits, **args, dtype=torch.float32)
        with _WideFloat64(shard.size) as wide:
            probs = vocab_parallel.vocab_parallel_filter(
                local, shard, None, vocab_size=VOCAB, **args, dtype=torch.float32
            )
            tokens = vocab_parallel.vocab_parallel_filtered_sample(
                local, uniforms, shard, None, vocab_size=VOCAB, **args, dtype=torch.float32
            )
        assert not wide.seen, (top_k, top_p, wide.seen)
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs[:, : shard.valid], want[:, shard.start : shard.start + shard.valid])
        assert torch.equal(tokens, sample_from(want, uniforms)), (rank, top_k, top_p)
        kept = want.gather(-1, tokens[:, None]).squeeze(-1)
        assert bool((kept > 0).all()), (top_k, top_p, tokens[kept == 0])  # u -> 1 included


def test_vocab_parallel_sampling_in_float32_equals_the_single_process_float32_tokens() -> None:
    run_distributed(_float32_slices, 2, timeout=120)


def test_the_tensor_parallel_choice_samples_in_the_logits_devices_sampling_dtype(monkeypatch: Any) -> None:
    """`VocabularyShards` without a dtype takes `sampling_dtype` of the logits' device at each call: float32 where
    that is CUDA's answer (here the CPU made to give it), with no float64 [B, V] pass."""
    from rlhfuse.generation.engine import SamplingParams
    from rlhfuse.models import ModelConfig, Transformer
    from rlhfuse.runtime.tensor_parallel import shard_transformer

    monkeypatch.setattr(vocab_parallel, "sampling_dtype", lambda device: torch.float32)
    cfg = ModelConfig.tiny()
    choice = vocab_parallel.VocabularyShards(shard_transformer(Transformer(cfg), 0, 1), None)
    logits, uniforms = _logits_and_uniforms()
    logits = logits[:, :1].expand(-1, cfg.vocab_size) + torch.randn(64, cfg.vocab_size)
    params = SamplingParams(max_new_tokens=4, temperature=0.8, top_k=12, top_p=0.9)
    with _WideFloat64(cfg.vocab_size) as wide:
        tokens = choice.sample(logits, uniforms, params)
    assert not wide.seen, wide.seen
    assert tokens.shape == (64,) and bool(((tokens >= 0) & (tokens < cfg.vocab_size)).all())
