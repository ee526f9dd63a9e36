"""The single-process paths on the stand-in device (`rlhfuse.testing.standin`): a CPU tensor mixed into device
work raises there as it would on a GPU, so each path running through with the CPU's numbers shows that it keeps
its tensors on the models' device. One `PlainStrategy` training step, `ModelInferencer.infer` (whole batch, by
samples and by tokens), one `SamplingGenerator` decode, and one whole trainer iteration."""

import dataclasses

import pytest
import torch
from lightning.fabric import Fabric

from rlhfuse.core.advantages import AlgorithmConfig, compute_train_batch
from rlhfuse.core.balance import microbatch_weights
from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.optim import OptimConfig, micro_batches
from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.data.prompts import PromptLoader, load_prompts
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.runtime.batch_split import split_minibatch
from rlhfuse.runtime.executor import StepWork
from rlhfuse.testing.data import assert_same_rollout, two_row_rollout
from rlhfuse.testing.standin import recording, standin_device
from rlhfuse.trainer import RLHFTrainer, compose_config
from rlhfuse.trainer.callbacks import MemoryMetrics
from rlhfuse.trainer.rollout import SerialRollout
from rlhfuse.trainer.strategies.plain.inference import ModelInferencer
from rlhfuse.trainer.strategies.plain.training import PlainStrategy
from rlhfuse.trainer.trainer import Assembled

STANDIN = standin_device()
PAD, EOS = 0, 2


def _models(device: torch.device | str) -> tuple[Transformer, Transformer, Transformer, Transformer]:
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    heads = ("lm", "lm", "value", "value")
    actor, ref, critic, reward = (Transformer(config, head).to(device) for head in heads)
    return actor, ref, critic, reward


def _rollout() -> Rollout:
    """Four samples (prompt [3] + response [3], lengths 4, 6, 6, 4), on the CPU as the generator returns them."""
    one = two_row_rollout(PAD)
    return one.select(torch.cat([torch.arange(len(one)), torch.arange(len(one)).flip(0)]))


def _inferencer(device: torch.device | str, **kw) -> ModelInferencer:
    actor, ref, critic, reward = _models(device)
    micro_batch_tokens = kw.pop("micro_batch_tokens", 0)
    return ModelInferencer(
        InferencerConfig(truncated_score=-1.0, **kw), actor=actor, ref=ref, critic=critic, reward_model=reward,
        rewards=None, tokenizer=build_tokenizer(), temperature=1.0, micro_batch_tokens=micro_batch_tokens,
    )  # fmt: skip


def _tensors(obj: object) -> dict[str, torch.Tensor]:
    """Every tensor field of a stage dataclass (nested ones by dotted name)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif dataclasses.is_dataclass(value):
            out.update({f"{name}.{k}": v for k, v in _tensors(value).items()})
    return out


@pytest.mark.parametrize(
    "how", [{}, {"micro_batch_size": 1}, {"micro_batch_tokens": 6}], ids=["whole", "by-samples", "by-tokens"]
)
def test_inference_runs_on_the_standin_with_the_cpu_values(how) -> None:
    on_cpu = _inferencer("cpu", **how).infer(_rollout())
    on_device = _inferencer(STANDIN, **how).infer(_rollout())
    # every output on the models' device, the rollout included (GAE and the losses run there next)
    assert {name: t.device for name, t in _tensors(on_device).items()} == {
        name: STANDIN for name in _tensors(on_cpu)
    }
    for name, expected in _tensors(on_cpu).items():
        torch.testing.assert_close(_tensors(on_device)[name].cpu(), expected, msg=name)


def _strategy(actor: Transformer, critic: Transformer, micro: int, tokens: int, **kw) -> PlainStrategy:
    return PlainStrategy(
        actor, critic, OptimConfig(warmup_steps=0, **kw), AlgorithmConfig(),
        fabric=Fabric(accelerator="cpu", devices=1, precision="32-true"),
        total_steps=10, micro_batch_size=micro, micro_batch_tokens=tokens,
    )  # fmt: skip


@pytest.mark.parametrize(
    "micro, tokens, kw",
    [(4, 0, {}), (1, 0, {}), (0, 9, {}), (2, 0, {"activation_checkpointing": True})],
    ids=["whole", "accumulated", "token-budget", "checkpointed"],
)
def test_a_plain_training_step_runs_on_the_standin_with_the_cpu_values(micro, tokens, kw) -> None:
    results = []
    for device in ("cpu", STANDIN):
        inf = _inferencer(device)
        batch, _ = compute_train_batch(inf.infer(_rollout()), AlgorithmConfig())
        assert batch.advantages_BR.device == torch.device(device)  # the advantages ran on the device
        strategy = _strategy(inf.actor, inf.critic, micro, tokens, **kw)  # type: ignore[arg-type]
        batch = batch.with_host_mask()  # as the trainer hands it over: the mask copied to the host once
        with recording() as rec:
            stats = strategy.train_step(batch)
        states = [s for s in strategy.actor_optim.state.values()]
        assert {t.device for s in states for k, t in s.items() if k != "step"} == {torch.device(device)}
        results.append((stats, {k: v.cpu() for k, v in strategy.actor.state_dict().items()}, rec))
    (cpu_stats, cpu_weights, _), (stats, weights, rec) = results
    assert stats.actor_grad_norm == pytest.approx(cpu_stats.actor_grad_norm, rel=1e-5)
    assert stats.critic_grad_norm == pytest.approx(cpu_stats.critic_grad_norm, rel=1e-5)
    # close, not equal: attention on a non-CPU device takes the math path of scaled_dot_product_attention
    for field in cpu_stats.loss._fields:
        assert getattr(stats.loss, field) == pytest.approx(getattr(cpu_stats.loss, field), rel=1e-5, abs=1e-6)
    for name, weight in cpu_weights.items():
        torch.testing.assert_close(weights[name], weight, msg=name)
    # one read per step, whatever the micro-batches: the statistics, losses and norms together (36 reads with 4
    # micro-batches before: a mask per forward, a loss check per micro-batch, each norm, each split)
    assert rec.host_reads == 1


def test_a_plain_training_step_without_a_host_mask_reads_the_mask_once() -> None:
    inf = _inferencer(STANDIN)
    batch, _ = compute_train_batch(inf.infer(_rollout()), AlgorithmConfig())
    strategy = _strategy(inf.actor, inf.critic, 1, 0)  # type: ignore[arg-type]
    with recording() as rec:
        strategy.train_step(batch)
    assert rec.host_reads == 2  # the mask, then the step's statistics


def test_a_sampling_generator_decodes_on_the_standin_with_the_cpu_tokens() -> None:
    prompts = PromptBatch(
        input_ids_BP=torch.tensor([[PAD, 1, 5, 6], [1, 9, 10, 11]]),
        attention_mask_BP=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
        prompt_ids_B=torch.tensor([3, 8]),
    )
    rollouts = []
    for device in ("cpu", STANDIN):
        actor = _models(device)[0]
        config = SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=10, top_p=0.9, max_batch_size=4)
        generator = SamplingGenerator(
            actor, config, eos_token_id=EOS, pad_token_id=PAD, samples_per_prompt=3, seed=5
        )
        assert next(generator.model.parameters()).device == torch.device(device)
        rollouts.append(list(generator.generate(prompts, iteration=0)))
    assert len(rollouts[0]) == len(rollouts[1]) == 2  # two chunks of at most four samples
    for expected, chunk in zip(*rollouts, strict=True):
        assert_same_rollout(chunk, expected)


def _trainer(device: torch.device | str, run_dir, *overrides: str) -> RLHFTrainer:
    """PPO iterations: the sampling generator (two chunks), inference of each chunk, GAE, two mini-batches, a
    checkpoint after each iteration, the memory metrics."""
    cfg = compose_config(
        ["iterations=1", "data.prompts_per_iteration=2", "data.samples_per_prompt=3", "data.mini_batch_size=3",
         "data.micro_batch_size=2", "generator.max_new_tokens=6", "generator.max_batch_size=4",
         "logger.progress=false", "checkpoint.every=1", *overrides]
    )  # fmt: skip
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = ModelConfig.tiny(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_heads=2
    )
    actor, ref, critic, reward = (Transformer(model, h).to(device) for h in ("lm", "lm", "value", "value"))
    generator = SamplingGenerator(
        actor, cfg.generator.sampling, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
        samples_per_prompt=cfg.data.samples_per_prompt, seed=cfg.seed,
    )  # fmt: skip
    inferencer = ModelInferencer(
        cfg.inferencer, actor=actor, ref=ref, critic=critic, reward_model=reward, rewards=None,
        tokenizer=tokenizer, temperature=cfg.generator.sampling.temperature,
    )  # fmt: skip
    strategy = _strategy(actor, critic, cfg.data.micro_batch_size, 0)
    prompts = PromptLoader(load_prompts(cfg.data, tokenizer, seed=cfg.seed), 2, seed=cfg.seed)
    memory = MemoryMetrics(lambda: [actor, ref, critic, reward], strategy.optimizers_in_use)
    rollout = SerialRollout(generator, inferencer, pad_token_id=tokenizer.pad_id)
    return RLHFTrainer.assembled(
        Assembled(
            cfg, generator=generator, inferencer=inferencer, strategy=strategy, rollout=rollout, prompts=prompts,
            pad_token_id=tokenizer.pad_id, run_dir=run_dir, callbacks=[memory],
        )
    )  # fmt: skip


def test_trainer_iterations_and_a_resume_run_on_the_standin_with_the_cpu_metrics(tmp_path) -> None:
    """fit(): rollout (generation streamed into inference, chunks concatenated), advantages, the update over
    mini-batches, the weight sync to the generator, metrics and a checkpoint, all on the device; then a resumed
    run loads that checkpoint (optimizer states onto the device) and trains a second iteration."""
    history = {}
    for name, device in (("cpu", "cpu"), ("standin", STANDIN)):
        (first,) = _trainer(device, tmp_path / name).fit()
        resumed = _trainer(device, tmp_path / name, "iterations=2", "resume=auto")
        (second,) = resumed.fit()  # this run's iterations: the second one only
        assert (first["iteration"], second["iteration"]) == (1, 2)
        assert next(resumed.generator.actor_copies()[0].parameters()).device == torch.device(device)
        states = resumed.strategy.actor_optim.state.values()  # type: ignore[attr-defined]
        assert {t.device for s in states for k, t in s.items() if k != "step"} == {torch.device(device)}
        history[name] = (first, second)
    for on_cpu, on_device in zip(history["cpu"], history["standin"], strict=True):
        compared = [k for k in on_cpu if not k.startswith(("time/", "throughput/"))]
        assert {"loss/policy", "reward/mean", "memory/param_bytes"} <= set(compared)
        for key in compared:
            assert on_device[key] == pytest.approx(on_cpu[key], rel=1e-4, abs=1e-5), key


def test_splitting_a_device_batch_that_carries_its_host_mask_reads_nothing() -> None:
    inf = _inferencer(STANDIN)
    batch, _ = compute_train_batch(inf.infer(_rollout()), AlgorithmConfig())
    batch = batch.with_host_mask()
    with recording() as rec:
        micro, weights, _ = split_minibatch(batch, 2, 2)  # the pipelines' split: dp 2 x 2 micro-batches
        StepWork(micro, weights).with_layouts(packed=True).to(STANDIN)
        by_samples = micro_batches(batch.select(torch.tensor([3, 0, 1])), samples=2, tokens=0)
        by_tokens = micro_batches(batch, samples=0, tokens=9)
        microbatch_weights(by_tokens, batch)
    assert rec.host_reads == 0
    assert [len(m) for m in by_samples] == [2, 1] and sum(len(m) for m in by_tokens) == 4
    # the trimmed widths are the device masks' own
    for m in [*by_samples, *by_tokens, *micro[0], *micro[1]]:
        assert m.host_mask_BT is not None and torch.equal(m.host_mask_BT, m.attention_mask_BT.cpu().bool())
