"""generator=engine in the trainer: the smoke job with the engine gives the same samples and PPO results as
generator=sampling; two instances with migration give the same results as without; the new metrics are logged;
bad combinations fail in `validate` with the override to fix. The instances run in this process
(`generator.in_process=true`); test_generation_processes.py runs them as processes."""

import json

import pytest

from rlhfuse.generation import EngineGenerator
from rlhfuse.trainer import build_trainer, compose_config, validate

NEW_METRICS = (
    "migration/threshold",
    "migration/samples_moved",
    "migration/destinations",
    "time/generation_inference",
    "generation/batch_size_p50",
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _fit(cache_dir, run_dir, *overrides):
    cfg = compose_config(
        [
            "experiment=smoke",
            f"model.warmstart.cache_dir={cache_dir}",
            "iterations=2",
            "generator.in_process=true",
            *overrides,
        ]
    )
    trainer = build_trainer(cfg, run_dir=run_dir, log=lambda _: None)
    history = trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, history, rows


def _same_results(history, expected):
    skip = (
        "time/",
        "throughput/",
        "generation/",
        "migration/",
        "memory/",
    )  # memory: one Actor copy per instance
    assert len(history) == len(expected)
    for row, ref in zip(history, expected, strict=True):
        got = {k: v for k, v in row.items() if not k.startswith(skip)}
        assert got == pytest.approx(
            {k: v for k, v in ref.items() if not k.startswith(skip)}, rel=1e-5, abs=1e-6
        )


# the smoke model rarely emits EOS: a few frequent word tokens as stop tokens give it long-tailed lengths
STOPS = "generator.stop_token_ids=[10,20,30,40,50]"


def test_engine_equals_sampling_and_migration_changes_nothing(cache_dir, tmp_path):
    _, sampling, _ = _fit(cache_dir, tmp_path / "sampling", STOPS)
    trainer, engine, _ = _fit(cache_dir, tmp_path / "engine", "generator=engine", STOPS)
    assert isinstance(trainer.generator, EngineGenerator)
    _same_results(engine, sampling)
    for mechanism in ("kv", "reprefill"):
        trainer, migrated, rows = _fit(
            cache_dir,
            tmp_path / mechanism,
            "generator.instances=2",
            "migration=fixed",
            "migration.threshold=5",
            "migration.bs_max=8",
            f"migration.mechanism={mechanism}",
            STOPS,
        )
        assert isinstance(trainer.generator, EngineGenerator)  # generator=sampling with 2 instances -> engine
        _same_results(migrated, sampling)
        for row in rows:
            assert set(NEW_METRICS) <= set(row)
            assert row["migration/threshold"] == 5 and row["migration/destinations"] == 1
            assert row["migration/samples_moved"] > 0 and row["generation/batch_size_p50"] > 0
        assert trainer.generator.migration.mechanism == mechanism


def test_auto_migration_retunes_rt_and_keeps_results(cache_dir, tmp_path):
    _, sampling, _ = _fit(cache_dir, tmp_path / "sampling", STOPS, "iterations=3")
    trainer, auto, rows = _fit(
        cache_dir, tmp_path / "auto", "generator.instances=2", "migration=auto", STOPS, "iterations=3"
    )
    _same_results(auto, sampling)
    assert rows[0]["migration/threshold"] == round(0.2 * 8)  # the configured start, before any observation
    policy = trainer.generator.policy
    assert policy.chosen is not None and policy.predicted_serial is not None
    assert "migration/predicted_gen_inf_s" in rows[1] and "migration/predicted_serial_s" in rows[1]
    assert rows[2]["migration/threshold"] in (0, *range(1, 8))


def test_speculative_decoding_in_the_trainer_changes_no_result_and_logs_its_metrics(cache_dir, tmp_path):
    _, sampling, _ = _fit(cache_dir, tmp_path / "sampling", STOPS)
    trainer, spec, rows = _fit(
        cache_dir,
        tmp_path / "spec",
        "generator.instances=2",
        "migration=fixed",
        "migration.threshold=5",
        "generator.speculative=ngram",
        "generator.speculative_tokens=3",
        STOPS,
    )
    _same_results(spec, sampling)
    assert all(e.speculative == "ngram" and e.speculative_tokens == 3 for e in trainer.generator.engines)
    for row in rows:
        assert 0 <= row["generation/spec_accept_rate"] <= 1 and row["generation/spec_tokens_per_step"] >= 1
        assert row["migration/samples_moved"] > 0


def test_invalid_migration_settings_name_the_fix():
    cfg = compose_config(["migration=fixed", "migration.mechanism=teleport", "generator.num_slots=-1"])
    with pytest.raises(ValueError) as err:
        validate(cfg)
    message = str(err.value)
    assert "set generator.instances=2" in message
    assert "migration.mechanism='teleport'" in message and "generator.num_slots=-1" in message


def test_every_migration_choice_composes():
    for choice in ("off", "fixed", "auto"):
        cfg = compose_config([f"migration={choice}", "generator=engine", "generator.instances=2"])
        assert cfg.migration.name == choice
        validate(cfg)
