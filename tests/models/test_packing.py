"""Packed sequences (rlhfuse.models.packing) equal the padded path in float64: logits, values, log-probs,
entropy, scores, and the training losses and gradients of every algorithm; bad input names the fix.

Legend: B rows, T padded width, N packed tokens, P prompt width, R response width, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from omegaconf import OmegaConf

from rlhfuse.algorithms import entropy_from_logits
from rlhfuse.core.advantages import AlgorithmConfig, algorithm_of
from rlhfuse.core.inference import response_logprobs, response_values, sequence_scores
from rlhfuse.core.optim import OptimConfig
from rlhfuse.core.types import Rollout, TrainBatch
from rlhfuse.models import ModelConfig, Transformer, split_stages
from rlhfuse.models.packing import pack_rows, packed_forward, packed_last_token
from rlhfuse.trainer.strategies.plain.training import PlainStrategy

VOCAB = 40
CONF = Path(__file__).resolve().parents[2] / "conf" / "algorithm"


def _model(head: str = "lm", architecture: str = "llama", seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig.tiny(
        architecture=architecture, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=4,
        num_kv_heads=2, num_layers=2, **overrides,
    )  # fmt: skip
    model = Transformer(config, head).double()
    with torch.no_grad():  # non-trivial norms and biases: every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _rows(layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of lengths 7, 3, 1, 5 in a [4, 9] layout: left, right or both-sided padding."""
    gen = torch.Generator().manual_seed(1)
    lengths, width = [7, 3, 1, 5], 9
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        start = {"left": width - n, "right": 0, "both": (width - n) // 2}[layout]
        ids[b, start : start + n] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[b, start : start + n] = 1
    return ids, mask


def _rollout() -> Rollout:
    """Left-padded prompts, right-padded responses; row 2 has a single-token response, row 3 a 1-token prompt."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12], [13]]
    responses = [[14, 15, 2], [16, 17, 18, 19], [2], [20, 21]]
    p_width, r_width = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.zeros(len(prompts), p_width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    response_ids = torch.zeros(len(prompts), r_width, dtype=torch.long)
    response_mask = torch.zeros_like(response_ids)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[b, p_width - len(p) :] = torch.tensor(p)
        prompt_mask[b, p_width - len(p) :] = 1
        response_ids[b, : len(r)] = torch.tensor(r)
        response_mask[b, : len(r)] = 1
    n = len(prompts)
    return Rollout(
        prompt_ids, prompt_mask, response_ids, response_mask, torch.arange(n), torch.zeros(n, dtype=torch.long),
        torch.tensor([True, False, True, False]),
    )  # fmt: skip


def test_pack_rows_offsets_and_positions_restart_per_sequence():
    _, mask = _rows("both")
    packed = pack_rows(mask)
    assert packed.cu_seqlens_B1.tolist() == [0, 7, 10, 11, 16]
    assert packed.cu_seqlens_B1.dtype == torch.int32 and packed.max_seqlen == 7
    assert packed.position_ids_N.tolist() == [*range(7), *range(3), 0, *range(5)]
    x_BT = torch.arange(mask.numel()).view(mask.shape)
    assert packed.unpack(packed.pack(x_BT)).tolist() == (x_BT * mask).tolist()


@pytest.mark.parametrize("layout", ["left", "right", "both"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_packed_logits_and_values_equal_padded(layout, architecture):
    ids, mask = _rows(layout)
    valid = mask.bool()
    for head in ("lm", "value"):
        model = _model(head, architecture)
        padded = model(ids, attention_mask_BT=mask)
        packed = packed_forward(model, ids, mask)
        assert packed.shape == padded.shape
        torch.testing.assert_close(packed[valid], padded[valid], atol=1e-12, rtol=0)
        assert bool((packed[~valid] == 0).all())
        # the window [2, 6) of columns, head on the window's real tokens only
        torch.testing.assert_close(
            packed_forward(model, ids, mask, start=2, stop=6), packed[:, 2:6], atol=1e-12, rtol=0
        )
        last = valid.long().cumsum(1).argmax(1)  # each row's last real column
        torch.testing.assert_close(
            packed_last_token(model, ids, mask), padded[torch.arange(len(ids)), last], atol=1e-12, rtol=0
        )


def test_packed_inference_log_probs_values_entropy_and_scores_equal_padded():
    rollout = _rollout()
    mask_BR = rollout.response_mask_BR.bool()
    actor, critic = _model("lm", seed=2), _model("value", seed=3)
    with torch.no_grad():
        for packing in (False, True):
            got = (
                response_logprobs(actor, rollout, 0.7, packing=packing),
                response_values(critic, rollout, packing=packing),
                sequence_scores(critic, rollout, packing=packing),
            )
            if not packing:
                expected = got
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype
        torch.testing.assert_close(got[0][mask_BR], expected[0][mask_BR], atol=1e-12, rtol=0)
        torch.testing.assert_close(got[1][mask_BR], expected[1][mask_BR], atol=1e-12, rtol=0)
        torch.testing.assert_close(got[2], expected[2], atol=1e-12, rtol=0)
        # entropy of the response-predicting distributions
        p = rollout.prompt_ids_BP.shape[1]
        padded_BRV = actor(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)[:, p - 1 : -1]
        width = rollout.input_ids_BT.shape[1]
        packed_BRV = packed_forward(
            actor, rollout.input_ids_BT, rollout.attention_mask_BT, start=p - 1, stop=width - 1
        )
        torch.testing.assert_close(
            entropy_from_logits(packed_BRV)[mask_BR],
            entropy_from_logits(padded_BRV)[mask_BR],
            atol=1e-12,
            rtol=0,
        )


def _train_batch(kl: bool) -> TrainBatch:
    rollout = _rollout()
    gen = torch.Generator().manual_seed(4)
    mask_BR = rollout.response_mask_BR.double()

    def field() -> torch.Tensor:
        return torch.randn(mask_BR.shape, generator=gen, dtype=torch.float64) * mask_BR

    return TrainBatch(
        input_ids_BT=rollout.input_ids_BT,
        attention_mask_BT=rollout.attention_mask_BT,
        response_mask_BR=mask_BR,
        old_logprobs_BR=(field() * 0.1 - 3.0) * mask_BR,
        old_values_BR=field(),
        advantages_BR=field(),
        returns_BR=field(),
        ref_logprobs_BR=(field() * 0.1 - 3.0) * mask_BR if kl else None,
    )


def _algorithms() -> list[tuple[str, AlgorithmConfig]]:
    found = []
    for path in sorted(CONF.glob("*.yaml")):
        config = AlgorithmConfig(**OmegaConf.to_container(OmegaConf.load(path)))  # type: ignore[arg-type]
        if config.loss_reduction == "sequence_sum" and config.loss_constant_length == 0:
            config.loss_constant_length = 4  # what trainer.config.resolve_components sets
        found.append((path.stem, config))
    found.append(("ppo+entropy+dual_clip", AlgorithmConfig(entropy_coef=0.01, dual_clip=3.0)))
    return found


@pytest.mark.parametrize(("name", "algorithm"), _algorithms(), ids=[n for n, _ in _algorithms()])
def test_packed_training_losses_and_gradients_equal_padded_for_every_algorithm(name, algorithm):
    critic_used = algorithm_of(algorithm).uses_critic
    batch = _train_batch(kl=algorithm.kl_loss_coef > 0)
    grads, stats = [], []
    for packing in (False, True):
        actor, critic = _model("lm", seed=5), (_model("value", seed=6) if critic_used else None)
        strategy = PlainStrategy(
            actor, critic, OptimConfig(warmup_steps=0), algorithm,
            fabric=Fabric(accelerator="cpu", devices=1, precision="32-true"),
            total_steps=4, micro_batch_size=4, temperature=0.9, packing=packing,
        )  # fmt: skip
        named, micro_stats = strategy._losses(batch)
        for _, loss, _ in named:
            loss.backward()
        stats.append(micro_stats.host())
        grads.append(
            {f"{i}.{n}": p.grad for i, m in enumerate(strategy.models) for n, p in m.named_parameters()}
        )
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "kl_loss"):
        assert getattr(stats[1], key) == pytest.approx(getattr(stats[0], key), abs=1e-12), key
    assert stats[0].policy_loss != 0
    assert set(grads[0]) == set(grads[1])
    for key, grad in grads[0].items():
        assert grad is not None and grads[1][key] is not None, key
        torch.testing.assert_close(grads[1][key], grad, atol=1e-12, rtol=0, msg=key)


def test_packing_with_a_backend_that_cannot_pack_names_the_fix():
    actor = _model()
    actor.config.attention_backend = "te"
    with pytest.raises(ValueError, match=r"attention_backend='te' cannot run packed.*data\.packing=false"):
        PlainStrategy(
            actor, None, OptimConfig(), AlgorithmConfig(name="grpo"),
            fabric=Fabric(accelerator="cpu", devices=1, precision="32-true"),
            total_steps=1, micro_batch_size=1, packing=True,
        )  # fmt: skip


def test_an_empty_row_cannot_be_packed():
    with pytest.raises(ValueError, match="at least one real token"):
        pack_rows(torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.parametrize("head", ["lm", "value"])
def test_packed_pipeline_stages_equal_the_padded_model_outputs_and_gradients(head):
    ids, mask = _rows("both")
    model = _model(head)
    expected = model(ids, attention_mask_BT=mask)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    valid = mask.bool().view(*mask.shape, *([1] * (expected.dim() - 2)))
    (expected * weight * valid).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.packing = True  # what data.packing sets under a pipeline strategy
    x = ids
    for stage in split_stages(model, 2):
        x = stage(x, attention_mask_BT=mask)
        assert x.shape[:2] == ids.shape  # messages keep the padded layout, 0 at padding
    torch.testing.assert_close(x * valid, expected * valid, atol=1e-12, rtol=0)
    (x * weight * valid).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("window", [None, 3])
def test_flash_varlen_call_follows_the_flash_attn_interface(monkeypatch, window):
    """No CUDA here: a stand-in module with flash-attn's documented `flash_attn_varlen_func` signature (q/k/v
    [N, heads, E], int32 cu_seqlens, causal per sequence, grouped kv heads; `window_size=(left, right)`: query i
    attends to keys i - left .. i + right) checks the call the flash backend makes; the kernel itself runs only
    on a GPU (docs/packing.md)."""
    import sys
    import types

    calls = []

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, window_size=(-1, -1)
    ):
        assert cu_seqlens_q.dtype == torch.int32 and causal and torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert q.dim() == 3 and q.shape[0] == int(cu_seqlens_q[-1]) and max_seqlen_q == max_seqlen_k
        calls.append(max_seqlen_q)
        out = []
        for start, stop in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
            qs, ks, vs = (t[start:stop].transpose(0, 1) for t in (q, k, v))
            i = torch.arange(stop - start)
            allowed = i[None, :] <= i[:, None]
            if window_size[0] >= 0:
                allowed &= i[None, :] >= i[:, None] - window_size[0]
            out.append(
                torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=allowed, enable_gqa=True
                ).transpose(0, 1)
            )
        return torch.cat(out)

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    )
    ids, mask = _rows("left")
    model = _model() if window is None else _model(architecture="mistral", sliding_window=window)
    expected = packed_forward(model, ids, mask)
    for layer in model.layers:
        layer.self_attn.backend = "flash"
    torch.testing.assert_close(packed_forward(model, ids, mask), expected, atol=1e-12, rtol=0)
    assert calls == [7, 7]  # one call per layer, the longest sequence


def test_a_token_budget_fills_the_fewest_micro_batches_that_fit():
    from rlhfuse.core.optim import token_groups

    rng = torch.Generator().manual_seed(8)
    lengths = torch.randint(3, 46, (64,), generator=rng).tolist()
    groups = token_groups(lengths, 160)
    assert sorted(i for g in groups for i in g) == list(range(64))
    assert all(sum(lengths[i] for i in g) <= 160 for g in groups)
    assert len(groups) == -(-sum(lengths) // 160)  # the lower bound itself, here
    assert token_groups([5, 5, 5], 5) == [[0], [1], [2]]


def test_a_token_budget_below_the_longest_sequence_names_the_key():
    from rlhfuse.core.optim import token_groups

    with pytest.raises(
        ValueError, match=r"data\.micro_batch_tokens=8 cannot hold a sequence of 9 tokens.*>= 9"
    ):
        token_groups([3, 9, 2], 8)


def test_the_trainer_config_refuses_a_budget_below_the_longest_sample():
    from rlhfuse.trainer import compose_config, validate

    with pytest.raises(ValueError, match=r"data\.micro_batch_tokens=10 cannot hold one full sample"):
        validate(compose_config(["data.micro_batch_tokens=10"]))


def test_the_inferencer_under_a_token_budget_equals_one_pass():
    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    rollout = _rollout()  # 6, 6, 4 and 3 real tokens
    actor, ref, critic, reward = (_model(h, seed=s) for s, h in enumerate(("lm", "lm", "value", "value")))
    results = []
    for tokens in (0, 8):
        inferencer = ModelInferencer(
            InferencerConfig(truncated_score=None), actor=actor, ref=ref, critic=critic, reward_model=reward,
            rewards=None, tokenizer=build_tokenizer(), temperature=1.0, packing=True, micro_batch_tokens=tokens,
        )  # fmt: skip
        results.append(inferencer.infer(rollout))
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        torch.testing.assert_close(getattr(results[1], name), getattr(results[0], name), atol=1e-6, rtol=0)
        assert bool(getattr(results[1], name).abs().sum() > 0), name
