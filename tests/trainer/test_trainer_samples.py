"""logger.log_samples_every: a table of prompts, responses and scores every N iterations to samples.jsonl and to
each table sink (W&B), rewritten past the checkpoint on resume."""

import json

import pytest

from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.callbacks import SAMPLE_COLUMNS, SampleTable


class _Sink:
    def __init__(self):
        self.tables = []

    def log_table(self, key, columns, data, step=None):
        self.tables.append((key, columns, data, step))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def test_samples_table_every_n_iterations_to_jsonl_and_sinks(cache_dir, tmp_path):
    cfg = compose_config(
        [
            "experiment=smoke",
            f"model.warmstart.cache_dir={cache_dir}",
            "iterations=4",
            "logger.log_samples_every=2",
            "logger.log_samples_count=3",
        ]
    )
    trainer = build_trainer(cfg, run_dir=tmp_path, log=lambda _: None)
    (table,) = [c for c in trainer.callbacks if isinstance(c, SampleTable)]
    sink = _Sink()
    table.sinks.append(sink)
    history = trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [2, 2, 2, 4, 4, 4]
    assert all(list(r) == SAMPLE_COLUMNS for r in rows)
    assert all(isinstance(r["prompt"], str) and r["prompt"].endswith(":") for r in rows)
    assert [t[3] for t in sink.tables] == [2, 4] and sink.tables[0][0] == "samples"
    assert sink.tables[0][2][0][4] == rows[0]["response"]
    assert len(history) == 4


def test_samples_table_is_off_by_default_and_trimmed_on_resume(cache_dir, tmp_path):
    trainer = build_trainer(
        compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}", "iterations=1"]),
        run_dir=tmp_path / "off",
        log=lambda _: None,
    )
    assert not any(isinstance(c, SampleTable) for c in trainer.callbacks)
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 3)))

    class _At:
        iteration = 2

    SampleTable(path, tokenizer=None, every=1).on_fit_start(_At())
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]
