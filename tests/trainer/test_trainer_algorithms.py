"""The algorithm registry in the trainer: every shipped algorithm composes, trains the tiny model end to end, and
the critic-free ones build, infer, train and save no Critic; bad choices fail in `validate` naming the fix."""

import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rlhfuse._resources import conf_dir
from rlhfuse.core import step_losses as losses
from rlhfuse.core.advantages import ALGORITHMS, AlgorithmConfig, compute_train_batch
from rlhfuse.core.checkpoint import RUN_FILE
from rlhfuse.core.errors import CheckpointError
from rlhfuse.core.types import Experience, Rollout
from rlhfuse.trainer import build_trainer, compose_config, validate

ALGORITHM_YAMLS = sorted(p.stem for p in (Path(conf_dir()) / "algorithm").glob("*.yaml"))
CRITIC_FREE = ["grpo", "dr_grpo", "rloo", "reinforce_pp"]
CRITIC_METRICS = ("loss/value", "critic/grad_norm", "value/mean", "value/explained_variance")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _smoke(cache_dir, run_dir, *overrides):
    cfg = compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}", *overrides])
    return build_trainer(cfg, run_dir=run_dir, log=lambda _: None)


def test_every_registered_algorithm_has_a_yaml_and_composes():
    assert set(ALGORITHMS.names()) <= set(ALGORITHM_YAMLS)
    for name in ALGORITHM_YAMLS:
        cfg = compose_config([f"algorithm={name}"])
        validate(cfg)
        assert cfg.algorithm.name in ALGORITHMS.names()
    assert compose_config(["algorithm=dr_grpo"]).algorithm.std_norm is False


def test_unknown_algorithm_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        validate(compose_config(["algorithm.name=ppo2"]))
    message = str(err.value)
    assert "algorithm.name='ppo2'" in message
    assert "['grpo', 'ppo', 'reinforce_pp', 'rloo']" in message
    with pytest.raises(
        ValueError, match=r"algorithm=ppo2 is not an option of algorithm .* did you mean algorithm=ppo\?"
    ):
        compose_config(["algorithm=ppo2"])


def test_group_baseline_needs_two_samples_per_prompt():
    for name in ("grpo", "rloo"):
        with pytest.raises(ValueError) as err:
            validate(
                compose_config([f"algorithm={name}", "data.samples_per_prompt=1", "data.mini_batch_size=32"])
            )
        message = str(err.value)
        assert "data.samples_per_prompt >= 2 (got data.samples_per_prompt=1)" in message
        assert "set data.samples_per_prompt=4" in message
    validate(
        compose_config(["algorithm=reinforce_pp", "data.samples_per_prompt=1", "data.mini_batch_size=32"])
    )


def test_pipeline_strategies_run_critic_free_algorithms_actor_only_saying_what_fusion_remains():
    from rlhfuse.trainer.run_config import resolve_components

    # critic_pp=3 divides no actor_pp=2 layout: refused with a Critic, unused without one
    layout = ["distributed.nproc_per_node=2", "pipeline.actor_pp=2", "pipeline.critic_pp=3"]
    for pipeline in ("fused", "serial_1f1b"):
        said: list[str] = []
        cfg = resolve_components(
            compose_config(["algorithm=grpo", f"pipeline={pipeline}", *layout]), log=said.append
        )
        validate(cfg)  # no problem: the Actor's pipeline alone
        (line,) = [s for s in said if "with algorithm=grpo" in s]
        assert f"pipeline={pipeline} with algorithm=grpo" in line and "Actor alone with 1F1B" in line
        assert "inter-stage fusion (migration, early Ref/reward inference) is unchanged" in line
        assert "pipeline.critic_pp=3 is unused" in line
        if pipeline == "fused":
            assert "intra-stage fusion needs two models (Actor and Critic)" in line
    said = []
    ppo = resolve_components(compose_config(["algorithm=ppo", "pipeline=fused", *layout]), log=said.append)
    assert not [s for s in said if "Actor alone" in s]
    with pytest.raises(ValueError, match=r"pipeline\.critic_pp=3 exceeds model\.num_layers"):
        validate(ppo)


def _experience(scores, groups, logprobs, ref_logprobs, mask):
    B, R = mask.shape
    rollout = Rollout(
        prompt_ids_BP=torch.ones(B, 1, dtype=torch.long),
        prompt_mask_BP=torch.ones(B, 1, dtype=torch.long),
        response_ids_BR=torch.ones(B, R, dtype=torch.long),
        response_mask_BR=mask,
        prompt_index_B=torch.tensor(groups),
        sample_index_B=torch.arange(B),
        finished_B=torch.ones(B, dtype=torch.bool),
    )
    return Experience(rollout, logprobs, ref_logprobs, torch.zeros(B, R), torch.tensor(scores))


def test_grpo_train_batch_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    lp = torch.zeros(4, 3)
    exp = _experience([1.0, 0.0, 2.0, 2.0], [5, 5, 6, 6], lp, lp, mask)
    batch, stats = compute_train_batch(exp, AlgorithmConfig(name="grpo", kl_coef=0.0))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [
        a,
        a,
        0.0,
        -a,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
    ]  # rows of 3, groups (5: 1 vs 0), (6: tie)
    assert batch.advantages_BR.flatten().tolist() == pytest.approx(expected, abs=1e-6)
    assert batch.ref_logprobs_BR is None  # no KL loss term: nothing to carry
    assert not any(key.startswith("value/") for key in stats)


def test_rloo_subtracts_the_summed_kl_from_the_outcome():
    # k1 KL = logprob - ref = 0.5 on each valid token; kl_coef 0.2: outcomes 1 - 0.2*1.0 = 0.8 and 0 - 0.2*0.5 = -0.1
    mask = torch.tensor([[1, 1], [1, 0]])
    lp, ref = torch.full((2, 2), 0.5) * mask, torch.zeros(2, 2)
    exp = _experience([1.0, 0.0], [3, 3], lp, ref, mask)
    batch, stats = compute_train_batch(exp, AlgorithmConfig(name="rloo", kl_coef=0.2))
    assert batch.advantages_BR.flatten().tolist() == pytest.approx([0.9, 0.9, -0.9, 0.0])
    assert stats["reward/with_kl_mean"] == pytest.approx((0.8 - 0.1) / 2)


def test_kl_loss_term_is_added_to_the_policy_loss():
    torch.manual_seed(0)
    B, P, R, V = 2, 2, 3, 7
    exp = _experience([1.0, 0.0], [0, 0], torch.zeros(B, R), torch.full((B, R), -2.0), torch.ones(B, R))
    exp.rollout.prompt_ids_BP = torch.ones(B, P, dtype=torch.long)
    exp.rollout.prompt_mask_BP = torch.ones(B, P, dtype=torch.long)
    logits = torch.randn(B, P + R, V)
    base = AlgorithmConfig(name="grpo", kl_coef=0.0)
    with_kl = AlgorithmConfig(name="grpo", kl_coef=0.0, kl_loss_coef=0.5, kl_loss_estimator="k1")
    off, _ = losses.actor_loss(logits, compute_train_batch(exp, base)[0], base)
    batch = compute_train_batch(exp, with_kl)[0]
    on, stats = losses.actor_loss(logits, batch, with_kl)
    logprobs = torch.log_softmax(logits[:, P - 1 : -1], dim=-1).gather(-1, batch.input_ids_BT[:, P:, None])[
        ..., 0
    ]
    kl = float((logprobs + 2.0).mean())  # k1 = log pi - log pi_ref, token mean
    assert float(stats.kl_loss) == pytest.approx(kl, rel=1e-5)
    assert float(on - off) == pytest.approx(0.5 * kl, rel=1e-5)


@pytest.mark.parametrize("name", CRITIC_FREE)
def test_critic_free_algorithm_trains_the_tiny_model_without_a_critic(cache_dir, tmp_path, name):
    trainer = _smoke(cache_dir, tmp_path, f"algorithm={name}", "checkpoint.every=3")
    assert trainer.strategy.critic is None and trainer.inferencer.critic is None
    history = trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(history) == 3
    for row in rows:
        assert all(math.isfinite(v) for v in row.values())
        assert not set(CRITIC_METRICS) & set(row), set(CRITIC_METRICS) & set(row)
        assert ("loss/kl" in row) == (trainer.config.algorithm.kl_loss_coef > 0)
    assert rows[0]["actor/grad_norm"] > 0
    checkpoint = tmp_path / "checkpoints" / "iter_00000003"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["actor.safetensors", "meta.json", "state.pt"]
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    assert not any(key.startswith("critic") for key in state)


def test_critic_free_resume_is_bit_identical_and_refuses_a_ppo_checkpoint(cache_dir, tmp_path, crash_after):
    common = ["algorithm=grpo", "iterations=4", "checkpoint.every=2"]
    straight = _smoke(cache_dir, tmp_path / "a", *common).fit()
    first = _smoke(cache_dir, tmp_path / "b", *common)
    first.callbacks.append(crash_after(at=2))
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    resumed = _smoke(cache_dir, tmp_path / "b", *common, "resume=auto").fit()
    skip = ("time/", "throughput/")
    same = [{k: v for k, v in r.items() if not k.startswith(skip)} for r in straight[2:]]
    assert [{k: v for k, v in r.items() if not k.startswith(skip)} for r in resumed] == same
    ppo = _smoke(cache_dir, tmp_path / "ppo", "iterations=1", "checkpoint.every=1")
    ppo.fit()
    # refused before any model is built, from the configuration run.json records
    with pytest.raises(CheckpointError, match=r"algorithm\.name: ppo -> grpo"):
        _smoke(cache_dir, tmp_path / "ppo", "algorithm=grpo", "resume=auto", "iterations=2")
    (tmp_path / "ppo" / RUN_FILE).unlink()  # a folder without the record: the checkpoint's entries tell
    with pytest.raises(Exception, match="written by a run with a Critic"):
        _smoke(cache_dir, tmp_path / "ppo", "algorithm=grpo", "resume=auto", "iterations=2").fit()


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "adapter", [[], ["model.lora.rank=4", "pipeline.actor_lr=1e-2"]], ids=["full", "lora"]
)
def test_grpo_two_instance_processes_with_migration_data_parallel(tmp_path, adapter, train_cli):
    """generator.instances=2 migration=auto: 2 gloo processes, generation fused with inference (inter-stage
    fusion) and data-parallel Actor-only training (all its weights, or its LoRA adapters: the gradient buckets
    hold the trained tensors only); the same results as the single-process GRPO job."""
    job = ["experiment=smoke", "iterations=3", "algorithm=grpo", "generator.stop_token_ids=[10,20,30,40,50]"]
    job += adapter
    run_dir = tmp_path / "dp"
    rows = train_cli(
        run_dir,
        *job,
        "generator.instances=2",
        "migration=auto",
        "checkpoint.every=3",
        "distributed.timeout_s=60",
        f"model.warmstart.cache_dir={tmp_path / 'cache'}",
        timeout=240,
    )
    assert len(rows) == 3 and all("migration/threshold" in r for r in rows)
    assert not any(set(CRITIC_METRICS) & set(r) for r in rows)
    assert sorted(p.name for p in (run_dir / "checkpoints" / "iter_00000003").iterdir()) == [
        "actor.safetensors",
        "meta.json",
        "state.pt",
    ]
    saved = safetensors.torch.load_file(run_dir / "checkpoints" / "iter_00000003" / "actor.safetensors")
    assert all(".lora_" in k for k in saved) == bool(adapter)
    single = _smoke(str(tmp_path / "cache"), tmp_path / "one", *job[1:]).fit()
    # policy/approx_kl and policy/entropy are token means per micro-batch, weighted by sample share under
    # loss_reduction=sequence: a diagnostic that depends on how the ranks split the mini-batch (the loss does not)
    skip = ("time/", "throughput/", "generation/", "migration/", "policy/approx_kl", "policy/entropy")
    for got, ref in zip(rows, single, strict=True):
        ref = {k: v for k, v in ref.items() if not k.startswith(skip)}
        assert {k: v for k, v in got.items() if not k.startswith(skip)} == pytest.approx(
            ref, rel=1e-5, abs=1e-6
        )


def test_grpo_from_checkpoints_with_a_rule_reward_asks_for_no_reward_or_critic_checkpoint(
    cache_dir, tmp_path
):
    warm = _smoke(cache_dir, tmp_path / "warm", "iterations=1")  # the cached warm start: an SFT checkpoint
    sft = warm.config.model.warmstart.cache_dir
    (sft_dir,) = [p / "sft" for p in Path(sft).iterdir() if (p / "DONE").is_file()]
    rule_only = ["inferencer.use_reward_model=false", "inferencer.reward_fn=topic_fraction"]
    with pytest.raises(ValueError, match=r"model\.sft_path='/x', model\.reward_path=None: set both"):
        validate(compose_config(["model.sft_path=/x", *rule_only]))  # PPO's Critic needs a start
    cfg = compose_config(["experiment=smoke", "algorithm=grpo", f"model.sft_path={sft_dir}", *rule_only])
    trainer = build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)
    assert trainer.inferencer.reward_model is None and trainer.strategy.critic is None
    (row,) = trainer.fit()[:1]
    assert math.isfinite(row["loss/policy"]) and "task/score" in row


def test_sequence_sum_constant_length_defaults_to_max_new_tokens_and_says_so():
    from rlhfuse.trainer.run_config import resolve_components

    said = []
    cfg = resolve_components(
        compose_config(["algorithm=dr_grpo", "generator.max_new_tokens=24"]), log=said.append
    )
    assert cfg.algorithm.loss_constant_length == 24
    assert any("algorithm.loss_constant_length=0 -> 24" in line for line in said)
    kept = resolve_components(
        compose_config(["algorithm=dr_grpo", "algorithm.loss_constant_length=7"]), log=said.append
    )
    assert kept.algorithm.loss_constant_length == 7


def test_an_off_policy_correction_trains_and_logs_what_it_corrected(cache_dir, tmp_path):
    """token_mask with bounds [1, 1] leaves out every token whose sampler log-prob differs from the trainer's in
    any bit: some do on the CPU (other batches round differently), none with exact=true."""
    strict = ("algorithm.off_policy_correction=token_mask", "algorithm.is_low=1", "algorithm.is_high=1")
    for name, exact, check in (
        ("plain", "exact=false", lambda r: 0 < r["off_policy/corrected_fraction"] < 1),
        (
            "exact",
            "exact=true",
            lambda r: r["off_policy/corrected_fraction"] == 0 == r["rollout/mismatch_kl"],
        ),
    ):
        history = _smoke(cache_dir, tmp_path / name, *strict, exact, "iterations=2").fit()
        assert all(check(row) for row in history), [
            (r["off_policy/corrected_fraction"], r["rollout/logprob_abs_diff"]) for r in history
        ]
        assert all(0 < row["off_policy/is_weight_mean"] <= 1 for row in history)
    assert "off_policy/is_weight_mean" not in _smoke(cache_dir, tmp_path / "off", "iterations=1").fit()[0]
