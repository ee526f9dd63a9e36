"""Checkpoints: round trip, atomic writes, no NaN weights, and no code execution from tampered files; the end of a
run recorded in run.json."""

import json
import pickle

import pytest
import safetensors.torch
import torch

from rlhfuse.core.checkpoint import (
    RUN_FILE,
    SealedFolder,
    begin_run,
    end_run,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_runs,
    rng_state,
    save_checkpoint,
    set_rng_state,
    sha256,
)
from rlhfuse.core.errors import CheckpointError


def _state(value=1.0):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return {
        "actor": model.state_dict(),
        "critic": {"w": torch.full((2,), value)},
        "actor_optim": optim.state_dict(),
        "trainer": {"iteration": 3, "loader": {"epoch": 1, "offset": 4}, "rng": rng_state()},
    }


def test_round_trip_restores_tensors_optimizer_and_rng(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, 3, state)
    expected = torch.rand(4)  # drawn after the state was captured
    loaded = load_checkpoint(path)
    assert loaded["iteration"] == 3 and loaded["trainer"]["loader"] == {"epoch": 1, "offset": 4}
    assert torch.equal(loaded["actor"]["weight"], state["actor"]["weight"])
    assert loaded["actor_optim"]["param_groups"][0]["lr"] == 1e-3
    assert torch.equal(
        loaded["actor_optim"]["state"][0]["exp_avg"], state["actor_optim"]["state"][0]["exp_avg"]
    )
    set_rng_state(loaded["trainer"]["rng"])
    assert torch.equal(torch.rand(4), expected)


def test_keep_prunes_old_checkpoints_and_latest_is_the_newest(tmp_path):
    for it in (2, 4, 6):
        save_checkpoint(tmp_path, it, _state(float(it)), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_00000004", "iter_00000006"]
    assert latest_checkpoint(tmp_path).name == "iter_00000006"


def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, _state(2.0))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, _state(4.0))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["iter_00000002"]  # no partial folder left behind
    assert float(load_checkpoint(latest_checkpoint(tmp_path))["critic"]["w"][0]) == 2.0
    # a temporary folder left by a hard kill (no cleanup ran) is never picked up
    (tmp_path / ".tmp-iter_00000006-999").mkdir()
    assert latest_checkpoint(tmp_path).name == "iter_00000002"


def test_nan_weights_are_never_saved(tmp_path):
    state = _state()
    state["critic"]["w"][0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN/inf"):
        save_checkpoint(tmp_path, 1, state)
    assert list_checkpoints(tmp_path) == []


class _Exploit:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.write_text, (pathlib.Path(_Exploit.marker), "pwned"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_tampered_state_file_is_an_error_not_code_execution(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", 1, _state())
    marker = tmp_path / "pwned.txt"
    _Exploit.marker = str(marker)
    (path / "state.pt").write_bytes(pickle.dumps({"trainer": _Exploit()}))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path)
    # even with meta.json rewritten to match, torch.load(weights_only=True) refuses the object
    meta = json.loads((path / "meta.json").read_text())
    meta["sha256"]["state.pt"] = sha256(path / "state.pt")
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not a plain tensor/number state file"):
        load_checkpoint(path)
    assert not marker.exists()


def test_missing_or_truncated_files_are_clear_errors(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    weights = path / "critic.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"critic\.safetensors does not match"):
        load_checkpoint(path)
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"critic\.safetensors is missing"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"no meta\.json"):
        load_checkpoint(tmp_path / "nowhere")
    assert safetensors.torch.load_file(str(path / "actor.safetensors"))["weight"].shape == (2, 3)


def test_a_sealed_folder_appears_whole_with_meta_json_last_or_not_at_all(tmp_path):
    final = tmp_path / "iter_00000001"
    with SealedFolder(final, "7") as folder:
        assert folder.path.name == ".tmp-iter_00000001-7" and not final.exists()
        (folder.path / "a.bin").write_bytes(b"a")
        (folder.path / "sub").mkdir()
        (folder.path / "sub" / "b.bin").write_bytes(b"b")
        assert folder.seal({"iteration": 1}) == final
    meta = json.loads((final / "meta.json").read_text())
    assert meta == {
        "iteration": 1,
        "sha256": {"a.bin": sha256(final / "a.bin"), "sub/b.bin": sha256(final / "sub/b.bin")},
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_00000001"]
    # hashes gathered elsewhere are recorded as given; an older folder of the same name is replaced
    with SealedFolder(final, "7") as folder:
        (folder.path / "c.bin").write_bytes(b"c")
        folder.seal({"iteration": 2}, {"c.bin": "given"})
    assert json.loads((final / "meta.json").read_text())["sha256"] == {"c.bin": "given"}
    assert sorted(p.name for p in final.iterdir()) == ["c.bin", "meta.json"]
    # a failure before the seal removes the temporary folder and leaves the sealed one as it was
    with pytest.raises(OSError, match="disk full"), SealedFolder(final, "7") as folder:
        (folder.path / "d.bin").write_bytes(b"d")
        raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_00000001"]
    assert sorted(p.name for p in final.iterdir()) == ["c.bin", "meta.json"]


def test_end_run_records_the_status_and_a_one_line_reason_in_the_runs_entry(tmp_path):
    first = begin_run(tmp_path, "hash", None, 0, auto=False)
    current = begin_run(tmp_path, "hash", None, 0, auto=False)  # a fresh start: the first run stays listed
    end_run(tmp_path, current.id, "failed", "CheckpointError: layout changed:\n  - dp: saved 1, this run 2\n")
    (run, earlier) = read_runs(tmp_path)
    assert (run.id, run.status, run.reason) == (
        current.id,
        "failed",
        "CheckpointError: layout changed: - dp: saved 1, this run 2",
    )
    assert run.ended_at is not None and run.ended_at >= run.started_at
    assert (earlier.id, earlier.status, earlier.reason) == (first.id, None, None)
    assert [p.name for p in tmp_path.iterdir() if p.name != RUN_FILE] == []  # written through a replaced file
    # resume=auto continues the run: running again until it ends
    assert begin_run(tmp_path, "hash", None, 3, auto=True).id == current.id
    assert (read_runs(tmp_path)[0].status, read_runs(tmp_path)[0].reason) == (None, None)
    end_run(tmp_path, current.id, "completed")
    assert (read_runs(tmp_path)[0].status, read_runs(tmp_path)[0].reason) == ("completed", None)
    with pytest.raises(CheckpointError, match="records no run 'nope'"):
        end_run(tmp_path, "nope", "completed")
