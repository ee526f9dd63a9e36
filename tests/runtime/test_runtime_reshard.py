"""Generation layout under the pipeline strategies and resharding between tp degrees (gloo, float64).

Two runs (each spawn costs seconds on this machine):
- 2 ranks, pp=2 x tp=1: vocabulary-parallel top-k / top-p equals `filter_logits` + `sample_from` on random
  logits; after an update the generation shard of generator.tp = 2 (T=1 -> g=2) and the whole copy (g=1) equal
  the trained weights' slice, each rank receiving exactly what it lacks; with generator.tp = 1 each rank decodes
  only its half of the samples and the tokens equal the single-process generator's (greedy and sampled with
  top-k / top-p), and so do those of one instance over both ranks (generator.tp = 2).
- 4 ranks, pp=2 x tp=2 (T=2): the vocabulary-parallel filter over 4 slices; the resharding for g = 1, 2 and 4
  (g = 4 replicates the 2 kv heads and pads the vocabulary of 130 to 132, whose quarters straddle the training
  halves), and generation with generator.tp = 4.
"""

from __future__ import annotations

import copy
import math
import pathlib
import tempfile
from typing import Any

import pytest
import torch
from runtime_helpers import random_batch, run_distributed
from test_runtime_sharded import _load

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.models import ModelConfig, Transformer, save_pretrained

pytestmark = pytest.mark.distributed

VOCAB = 130


def _check_vocab_parallel_filter(rank: int, world: int) -> None:
    """This rank's slice (of `world`) of the filtered probabilities and the sampled tokens equal the
    single-process ones."""
    from rlhfuse import distributed
    from rlhfuse.core.sampling import filter_logits, sample_from
    from rlhfuse.generation.vocab_parallel import vocab_parallel_filter, vocab_parallel_filtered_sample
    from rlhfuse.runtime.tensor_parallel import VocabShard

    g = torch.Generator().manual_seed(8)
    vocab = 37  # padded to a multiple of 2 and 4: the last slice has padded rows
    logits = torch.randn(64, vocab, generator=g, dtype=torch.float64) * 3
    logits[:8] *= 8  # peaked rows: the nucleus is one or two tokens
    uniforms = torch.rand(64, generator=g, dtype=torch.float64)
    shard = VocabShard.of(vocab, rank, world)
    local = torch.full((64, shard.size), 123.0, dtype=torch.float64)  # padded rows hold garbage
    local[:, : shard.valid] = logits[:, shard.start : shard.start + shard.valid]
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9), (7, 0.8), (0, 0.3), (40, 0.99), (1, 1.0)):
        args: dict[str, Any] = dict(temperature=0.7, top_k=top_k, top_p=top_p)
        want = filter_logits(logits, **args)
        got = vocab_parallel_filter(local, shard, None, vocab_size=vocab, **args)
        torch.testing.assert_close(got[:, : shard.valid], want[:, shard.start : shard.start + shard.valid])
        assert torch.all(got[:, shard.valid :] == 0), (top_k, top_p)  # padded rows carry no probability
        tokens = vocab_parallel_filtered_sample(local, uniforms, shard, None, vocab_size=vocab, **args)
        assert torch.equal(tokens, sample_from(want, uniforms)), (rank, top_k, top_p)
        same = torch.stack(distributed.all_gather(tokens))
        assert all(torch.equal(same[0], other) for other in same)


def _expected_received(model: Transformer, layout: Any, rank: int, gen_tp: int) -> int:
    """Bytes `rank` lacks of its generation shard, counted element by element: the indices along each tensor's
    split dimension that its generation slice needs and its training shard does not hold (padding excluded)."""
    from rlhfuse.runtime.tensor_parallel import _split, full_shapes, shard_transformer

    with torch.device("meta"):
        whole = Transformer(model.config, head="lm")
    gen = _split(shard_transformer(whole, rank % gen_tp, gen_tp)) if gen_tp > 1 else {}
    train = _split(model) if layout.tp > 1 else {}
    state = model.state_dict(keep_vars=True)
    shapes = full_shapes(model) if layout.tp > 1 else {k: v.shape for k, v in state.items()}
    total, seen = 0, set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        shape = shapes[name]
        dim = gen[name][0] if name in gen else train[name][0] if name in train else 0
        need = torch.zeros(shape[dim], dtype=torch.bool)
        lo, hi = gen[name][1][rank % gen_tp] if name in gen else (0, shape[dim])
        need[lo:hi] = True
        held = torch.zeros_like(need)
        if not tensor.is_meta:
            lo, hi = train[name][1][layout.tp_rank(rank)] if name in train else (0, shape[dim])
            held[lo:hi] = True
        total += int((need & ~held).sum()) * (shape.numel() // shape[dim]) * tensor.element_size()
    return total


def _trained_strategy(rank: int, world: int, root: pathlib.Path, tp: int, gen_tp: int) -> tuple[Any, Any]:
    """A PipelineStrategy (pp=2 x tp over sharded models) after one optimizer update, and the whole
    trained Actor (its state reassembled on every rank)."""
    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy, pipeline_layout

    cfg = PipelineConfig(
        name="fused", optim=OptimConfig(warmup_steps=1), actor_tp=tp, critic_tp=tp, microbatches=2,
        search_budget_s=0.0,
    )  # fmt: skip
    layout = pipeline_layout(cfg, world, 8, 4)
    models = _load(root, layout.held_stages(rank))
    fused = PipelineStrategy(
        models["actor"], models["critic"], cfg, AlgorithmConfig(), total_steps=4, mini_batch_size=8,
        micro_batch_size=4, schedule="fused", timeout_s=120, log=lambda _: None, generation_tp=gen_tp,
    )  # fmt: skip
    start = {k: v.clone() for k, v in fused.state_dict()["actor"].items()}
    fused.train_step(random_batch(8, seed=5, vocab=VOCAB))
    trained = Transformer(fused.models["actor"].config, head="lm").double()
    trained.load_state_dict(fused.state_dict()["actor"])
    assert any(not torch.equal(start[k], v) for k, v in trained.state_dict().items())  # it was updated
    return fused, trained


def _check_shard(rank: int, got: dict[str, torch.Tensor], trained: Transformer, gen_tp: int) -> None:
    """`got` is exactly the trained weights' slice of generation position rank % gen_tp."""
    from rlhfuse.runtime.tensor_parallel import shard_transformer

    want = (
        trained.state_dict()
        if gen_tp == 1
        else shard_transformer(trained, rank % gen_tp, gen_tp).state_dict()
    )
    assert got.keys() == want.keys(), (rank, gen_tp)
    for name, value in want.items():
        assert got[name].shape == value.shape and torch.equal(got[name], value), (rank, gen_tp, name)


def _check_reshard(rank: int, fused: Any, trained: Transformer, gen_tps: tuple[int, ...]) -> dict[int, int]:
    """For each generation tp: the resharded weights equal the trained slice; received bytes = what it lacks."""
    from rlhfuse.models import resident_bytes
    from rlhfuse.runtime.reshard import Resharder
    from rlhfuse.runtime.tensor_parallel import shard_transformer

    out = {}
    model = fused.models["actor"]
    for g in gen_tps:
        resharder = Resharder(fused.layout, rank, model, g)
        got = resharder.run()
        _check_shard(rank, got, trained, g)
        if (
            g == fused.layout.tp
        ):  # the tensors of its own stages are its generation shard: handed over, no copy
            live = model.state_dict(keep_vars=True)
            held = [n for n, t in live.items() if not t.is_meta]
            assert held and all(got[n].data_ptr() == live[n].data_ptr() for n in held), rank
        want = _expected_received(model, fused.layout, rank, g)
        assert resharder.received_bytes == want, (rank, g, resharder.received_bytes, want)
        # streamed in buckets of the largest tensor (the weight sync's way): the same shard, the same bytes
        whole = [math.prod(e.shape) * resharder.element_size[i] for i, e in enumerate(resharder.plan.entries)]
        buckets = list(resharder.buckets(max(whole)))
        assert len(buckets) > 2
        _check_shard(rank, {k: v for b in buckets for k, v in b.items()}, trained, g)
        assert resharder.received_bytes == want, (rank, g, "streamed")
        # for a bf16 generator: the same shard cast (no tensor handed over as it is), in bf16's bytes
        half = Resharder(fused.layout, rank, model, g, dtype=torch.bfloat16)
        bf16 = half.run()
        size = next(model.parameters()).element_size()  # the trained dtype's (bf16: 2 bytes)
        assert (
            all(t.dtype == torch.bfloat16 for t in bf16.values()) and size * half.received_bytes == 2 * want
        )
        _check_shard(rank, bf16, copy.deepcopy(trained).to(torch.bfloat16), g)
        # at most its own generation shard, never a whole model (g > 1)
        mine = trained if g == 1 else shard_transformer(trained, rank % g, g)
        assert resharder.received_bytes <= resident_bytes(mine)
        assert g == 1 or resident_bytes(mine) < resident_bytes(trained)
        out[g] = resharder.received_bytes
    return out


def _prompts() -> Any:
    from rlhfuse.core.types import PromptBatch

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, VOCAB, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return PromptBatch(ids * mask, mask, torch.tensor([4, 9, 2]))


def _tokens(chunks: list[Any]) -> list[list[int]]:
    rows = []
    for c in chunks:
        for r in range(len(c)):
            rows.append(c.response_ids_BR[r, : int(c.response_mask_BR[r].sum())].tolist())
    return rows


def _check_generation(rank: int, world: int, trained: Transformer, weights: dict[int, Any]) -> None:
    """Every generation tp in `weights` (tp -> this rank's shard) decodes only its instance's share and yields
    the single-process generator's tokens, greedy and sampled with top-k / top-p."""
    from rlhfuse.core.sampling import SamplingConfig
    from rlhfuse.generation.batched import InstanceGenerator, SamplingGenerator

    prompts = _prompts()
    args: dict[str, Any] = dict(eos_token_id=1, pad_token_id=0, samples_per_prompt=2, seed=3)
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (1.3, 9, 0.85)):
        cfg = SamplingConfig(max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p)
        want = list(SamplingGenerator(trained, cfg, **args).generate(prompts, iteration=1))
        for tp, shard in weights.items():
            # sampled: generator.max_batch_size=2 cuts an instance's share into chunks of at most 2
            chunked = SamplingConfig(**{**vars(cfg), "max_batch_size": 2 if temperature else 0})
            gen = InstanceGenerator(trained, chunked, tp=tp, **args)
            gen.load_weights(shard)
            prefill: list[int] = []
            gen.model.register_forward_pre_hook(
                lambda _, a, rows=prefill: rows.append(a[0].shape[0]) if a[0].shape[1] > 1 else None
            )
            got = list(gen.generate(prompts, iteration=1))
            share = torch.tensor_split(torch.arange(6), world // tp)[rank // tp]
            assert torch.equal(gen.decoded_rows, share), (rank, tp)  # only its instance's contiguous share
            assert sum(prefill) == len(share), (rank, tp, prefill)
            assert _tokens(got) == _tokens(want), (rank, tp, temperature)
            assert torch.equal(
                torch.cat([c.prompt_index_B for c in got]), torch.cat([c.prompt_index_B for c in want])
            )


def _worker_two(rank: int, world: int, folder: str) -> None:
    _check_vocab_parallel_filter(rank, world)
    fused, trained = _trained_strategy(rank, world, pathlib.Path(folder), tp=1, gen_tp=2)
    shard = dict(fused.actor_weights())  # the strategy's own path: T=1 pp=2 -> g=2
    _check_shard(rank, shard, trained, 2)
    want = _expected_received(fused.models["actor"], fused.layout, rank, 2)
    assert fused.resharder.received_bytes == want > 0
    sizes = _check_reshard(rank, fused, trained, (1, 2))
    print(f"reshard T=1 pp=2 rank {rank}: bytes received {sizes}", flush=True)
    whole = fused.state_dict()["actor"]
    _check_generation(rank, world, trained, {1: whole, 2: shard})


def _worker_four(rank: int, world: int, folder: str) -> None:
    _check_vocab_parallel_filter(rank, world)
    fused, trained = _trained_strategy(rank, world, pathlib.Path(folder), tp=2, gen_tp=4)
    shard = dict(fused.actor_weights())
    _check_shard(rank, shard, trained, 4)
    sizes = _check_reshard(rank, fused, trained, (1, 2, 4))
    print(f"reshard T=2 pp=2 rank {rank}: bytes received {sizes}", flush=True)
    _check_generation(rank, world, trained, {4: shard})


def _save_models(root: pathlib.Path, **overrides: Any) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2, vocab_size=VOCAB, **overrides)
    save_pretrained(Transformer(cfg, head="lm"), root / "sft")
    save_pretrained(Transformer(cfg, head="value"), root / "rm")


@pytest.mark.timeout(240)
def test_two_ranks_generate_their_halves_and_reshard_t1_to_g2() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _save_models(pathlib.Path(tmp))
        run_distributed(_worker_two, 2, tmp, timeout=220.0)


@pytest.mark.timeout(300)
def test_four_ranks_reshard_t2_to_g1_g2_g4_and_generate_with_g4() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _save_models(pathlib.Path(tmp))
        run_distributed(_worker_four, 4, tmp, timeout=280.0)
