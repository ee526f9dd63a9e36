"""rlhfuse-plan end to end on small settings."""

import json

import pytest

from rlhfuse.planner.plan_command import main

GRID_KEYS = {"actor", "critic", "max_len", "throughput_ratio", "gen_inf_ratio", "train_ratio", "plan"}


def test_plan_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", "--nodes", "2", "--actor", "7b", "--critic", "7b", "--max-len", "256",
               "--global-batch", "64", "--mini-batch", "16", "--json", str(out), "--png", str(png)])  # fmt: skip
    assert rc == 0
    d = json.loads(out.read_text())
    assert GRID_KEYS <= set(d)
    assert png.stat().st_size > 1000
    assert "RLHFuse / RLHFuse-Base" in capsys.readouterr().out


def test_paper_grid_one_length(tmp_path, capsys):
    out = tmp_path / "GRID.json"
    assert main(["paper-grid", "--out", str(out), "--max-lens", "512"]) == 0
    cells = json.loads(out.read_text())
    assert [(c["actor"], c["critic"]) for c in cells] == [
        ("13B", "33B"),
        ("33B", "13B"),
        ("33B", "65B"),
        ("65B", "33B"),
    ]
    for c in cells:
        assert GRID_KEYS <= set(c) and c["max_len"] == 512
        assert c["throughput_ratio"] > 0 and c["plan"]["generation"]["tp"] in (1, 2, 4, 8)
        # the speculative tail, simulated next to migration on the same plans (default k = 4, acceptance 0.4)
        spec = c["speculation"]
        assert spec["tokens"] == 4 and spec["acceptance"] == 0.4
        assert spec["gen_inf_rlhfuse_s"] < c["plan"]["breakdown_s"]["gen_inf"] and spec["spec_gain"] > 1
        # the per-cell time split adds up to each system's iteration, and the gain's sources to the whole gain
        for system, plan in (("base", c["base_plan"]), ("rlhfuse", c["plan"])):
            split = c["split_s"][system]
            assert split["reduction"] > 0  # dp > 1 everywhere on this grid
            assert sum(split.values()) == pytest.approx(plan["breakdown_s"]["total"], rel=1e-9)
        assert sum(c["gain_sources"].values()) == pytest.approx(1.0)
    assert "gain: inter intra other" in capsys.readouterr().out
    searched = {(c["actor"], c["critic"]): c for c in cells}
    assert main(["paper-grid", "--out", str(out), "--max-lens", "512", "--spec-acceptance", "-1",
                 "--search-iterations", "0"]) == 0  # fmt: skip
    greedy = json.loads(out.read_text())
    assert all(c["speculation"] is None for c in greedy)
    # the same layouts, scheduled by the greedy list schedule only: never faster than the searched schedule
    for c in greedy:
        s = searched[(c["actor"], c["critic"])]
        assert c["plan"]["training"] == s["plan"]["training"]
        assert c["plan"]["breakdown_s"]["training"] >= s["plan"]["breakdown_s"]["training"]
    assert any(
        c["plan"]["breakdown_s"]["training"]
        > 1.05 * searched[(c["actor"], c["critic"])]["plan"]["breakdown_s"]["training"]
        for c in greedy
    )  # the search pays on this grid (13B/33B: 1.2x)


def test_bad_model_and_bad_batch_are_reported(capsys):
    assert main(["plan", "--nodes", "1", "--actor", "7b", "--critic", "7b", "--global-batch", "100"]) == 2
    assert "multiple of mini_batch" in capsys.readouterr().err


def test_memory_prints_each_rank_by_component(capsys):
    assert main(["memory", "--actor", "7b", "--critic", "7b", "--actor-pp", "2", "--critic-pp", "2", "--tp", "2",
                 "--gen-tp", "2", "--precision", "bf16-true"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert "master_weights" in lines[1] and "generation_weights" in lines[1]
    rank0, rank1 = (list(map(float, line.split()[1:])) for line in lines[2:4])
    # the Actor's LM head and the Critic's embedding on rank 1: two vocabulary tables, rank 0 one (+ value head)
    assert rank1[0] > rank0[0]
    # bf16 weights and gradients; fp32 masters and moments (printed to 1 MiB)
    assert rank0[1] == rank0[0] and rank0[2] == pytest.approx(2 * rank0[0], abs=2e-3)
    assert rank0[3] == pytest.approx(4 * rank0[0], abs=2e-3)
    # unequal tp: the Critic's two consecutive stages merged on each tp=2 pipeline rank, one row per sub-rank
    assert main(["memory", "--actor", "7b", "--critic", "7b", "--actor-pp", "2", "--critic-pp", "4", "--tp", "2",
                 "--critic-tp", "1"]) == 0  # fmt: skip
    merged = capsys.readouterr().out.splitlines()
    assert "actor_tp=2 critic_tp=1" in merged[0]
    assert [line.split()[0] for line in merged[2:]] == ["0.0", "0.1", "1.0", "1.1"]
    with pytest.raises(SystemExit):  # argparse refuses a precision the runtime does not have
        main(["memory", "--precision", "fp16"])


def test_memory_prints_each_fsdp_rank(capsys):
    """`--fsdp N`: one row per rank of pipeline=fsdp, its gathered phases as columns; the padded weight shards are
    the same on every rank."""
    assert (
        main(["memory", "--actor", "7b", "--critic", "7b", "--fsdp", "4", "--precision", "bf16-mixed"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert "pipeline=fsdp over 4 ranks" in lines[0] and "rollout_gathered" in lines[1]
    ranks = [list(map(float, line.split()[1:])) for line in lines[2:]]
    assert [line.split()[0] for line in lines[2:]] == ["0", "1", "2", "3"]
    assert len({r[0] for r in ranks}) == 1  # trained weights (GiB, 3 decimals)
