"""Inference stage values by hand, step-2 advantages layout, and gradient accumulation == full mini-batch."""

import copy

import pytest
import torch
from lightning.fabric import Fabric

from rlhfuse.core.advantages import AlgorithmConfig, compute_train_batch
from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.optim import OptimConfig, lr_lambda, micro_batches
from rlhfuse.core.protocols import SplitInferencer
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.data import two_row_rollout
from rlhfuse.trainer.strategies.plain.inference import ModelInferencer
from rlhfuse.trainer.strategies.plain.training import PlainStrategy

PAD = 0


def _models():
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return (
        Transformer(config, "lm"),
        Transformer(config, "lm"),
        Transformer(config, "value"),
        Transformer(config, "value"),
    )


def _rollout():
    # row 0: prompt [pad, 5, 6], response [7, 2] finished; row 1: prompt [8, 9, 10], response [11, 12, 13] cut
    return two_row_rollout(PAD)


def _inferencer(truncated_score=None):
    actor, ref, critic, reward = _models()
    config = InferencerConfig(truncated_score=truncated_score)
    inf = ModelInferencer(
        config, actor=actor, ref=ref, critic=critic, reward_model=reward, rewards=None,
        tokenizer=build_tokenizer(), temperature=1.0,
    )  # fmt: skip
    return inf, actor, critic, reward


def test_inference_outputs_match_single_sequence_forward_passes():
    inf, actor, critic, reward = _inferencer()
    exp = inf.infer(_rollout())
    with torch.no_grad():
        seq0 = torch.tensor([[5, 6, 7, 2]])  # row 0 without its padding
        logp0 = torch.log_softmax(actor(seq0)[0], -1)
        assert exp.logprobs_BR[0, :2] == pytest.approx(torch.stack([logp0[1, 7], logp0[2, 2]]), abs=1e-5)
        assert exp.values_BR[0, :2] == pytest.approx(critic(seq0)[0, 1:3], abs=1e-5)
        assert float(exp.scores_B[0]) == pytest.approx(float(reward(seq0)[0, -1]), abs=1e-5)
        seq1 = torch.tensor([[8, 9, 10, 11, 12, 13]])
        assert float(exp.scores_B[1]) == pytest.approx(float(reward(seq1)[0, -1]), abs=1e-5)
    assert exp.logprobs_BR[0, 2] == 0 and exp.values_BR[0, 2] == 0  # padding zeroed


@pytest.mark.parametrize("micro_batch_size", [0, 1])  # one forward of every row; a forward per row
def test_the_frozen_and_live_parts_make_the_whole_inference_bit_for_bit(micro_batch_size):
    """`SplitInferencer`: the split placement's generation rank runs `infer_frozen` (Ref, Reward, rules), the
    training rank `infer_live` (Actor, Critic) with it; together they are `infer`."""
    inf, *_ = _inferencer()
    inf.config = InferencerConfig(micro_batch_size=micro_batch_size)
    rollout = _rollout()
    whole = inf.infer(rollout)
    frozen = inf.infer_frozen(rollout)
    parts = inf.infer_live(rollout, frozen)
    assert isinstance(inf, SplitInferencer)
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B", "rule_scores_BK"):
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name
    assert torch.equal(frozen.ref_logprobs_BR, whole.ref_logprobs_BR)


def test_truncated_responses_get_the_fixed_score():
    inf, *_ = _inferencer(truncated_score=-5.0)
    scores = inf.infer(_rollout()).scores_B
    assert float(scores[1]) == -5.0 and float(scores[0]) != -5.0


def test_advantages_are_zero_on_padding_and_the_score_lands_on_the_last_token():
    inf, *_ = _inferencer()
    exp = inf.infer(_rollout())
    batch, stats = compute_train_batch(exp, AlgorithmConfig(kl_coef=0.0, whiten_advantages=False, lam=1.0))
    assert batch.advantages_BR[0, 2] == 0 and batch.returns_BR[0, 2] == 0
    # gamma = lam = 1, no KL: every return equals the final score
    assert batch.returns_BR[0, :2] == pytest.approx(exp.scores_B[0].expand(2), abs=1e-5)
    assert batch.returns_BR[1] == pytest.approx(exp.scores_B[1].expand(3), abs=1e-5)
    assert stats["reward/mean"] == pytest.approx(float(exp.scores_B.mean()))


def _strategy(micro, tokens=0):
    actor, _, critic, _ = _models()
    return PlainStrategy(
        actor, critic, OptimConfig(warmup_steps=0), AlgorithmConfig(),
        fabric=Fabric(accelerator="cpu", devices=1, precision="32-true"),
        total_steps=10, micro_batch_size=micro, micro_batch_tokens=tokens,
    )  # fmt: skip


def test_gradient_accumulation_equals_one_full_mini_batch():
    inf, *_ = _inferencer()
    rollout = _rollout()
    doubled = rollout.select(torch.cat([torch.arange(len(rollout)), torch.arange(len(rollout)).flip(0)]))
    batch, _ = compute_train_batch(inf.infer(doubled), AlgorithmConfig())
    full, accumulated, packed = _strategy(4), _strategy(1), _strategy(0, tokens=9)
    # lengths 4, 6, 6, 4 under a budget of 9: the fewest micro-batches that fit are 6 | 6 | 4+4
    assert sorted(m.num_tokens for m in micro_batches(batch, samples=4, tokens=9)) == [6, 6, 8]
    for strategy in (full, accumulated, packed):
        strategy.train_step(copy.deepcopy(batch))
    for name, weight in full.actor.state_dict().items():
        assert torch.allclose(weight, accumulated.actor.state_dict()[name], atol=1e-6), name
        assert torch.allclose(weight, packed.actor.state_dict()[name], atol=1e-6), name
    for name, weight in full.critic.state_dict().items():
        assert torch.allclose(weight, accumulated.critic.state_dict()[name], atol=1e-6), name


def test_lr_schedule_warmup_then_decay():
    kw = dict(warmup=4, total=14, min_ratio=0.1)
    assert [lr_lambda(s, schedule="constant", **kw) for s in (0, 3, 4, 13)] == [0.25, 1.0, 1.0, 1.0]
    assert lr_lambda(9, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_lambda(14, schedule="cosine", **kw) == pytest.approx(0.1)


def test_shipped_components_satisfy_the_protocols(tmp_path):
    from rlhfuse.core.protocols import Generator, Inferencer, Logger, Strategy
    from rlhfuse.core.sampling import SamplingConfig
    from rlhfuse.generation.batched import SamplingGenerator
    from rlhfuse.trainer.logging import JsonlLogger

    actor = _models()[0]
    generator = SamplingGenerator(
        actor, SamplingConfig(), eos_token_id=2, pad_token_id=0, samples_per_prompt=1, seed=0
    )
    assert isinstance(generator, Generator)
    assert isinstance(_inferencer()[0], Inferencer)
    assert isinstance(_strategy(2), Strategy)
    assert isinstance(JsonlLogger(tmp_path / "m.jsonl"), Logger)
