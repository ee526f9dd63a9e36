"""The README's main command: `rlhfuse-train` with no overrides learns (reward and hidden task score rise)
while response lengths stay long-tailed. A cold run: the warm start (SFT + reward model) is trained too."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from rlhfuse.trainer import compose_config


@pytest.mark.slow
def test_default_job_reward_rises_with_long_tailed_lengths(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "RLHFUSE_CACHE": str(tmp_path / "cache")}  # cold: trains the warm start as well
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhfuse.trainer.train_command",
            f"hydra.run.dir={run}",
            "logger.progress=false",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = compose_config()
    assert len(rows) == cfg.iterations

    def mean(key, part):
        return statistics.fmean(r[key] for r in part)

    first, last = rows[:5], rows[-10:]
    # the optimised reward (reward-model score) and the hidden rule it was learned from both rise clearly
    assert mean("reward/mean", last) > mean("reward/mean", first) + 3.0
    assert mean("task/score", last) > 1.8 * mean("task/score", first)
    assert mean("task/score", last) > 0.35
    # long-tailed lengths all along: p99 well above the median, and a few responses near the limit
    assert statistics.median(r["response_length/p99"] / r["response_length/p50"] for r in rows) >= 2.5
    assert max(r["response_length/max"] for r in last) >= 0.75 * cfg.generator.sampling.max_new_tokens
    assert (run / "actor_hf" / "config.json").is_file()
