"""Prompts in the forms TRL users have: a conversational JSONL (`prompt` as chat messages, SFT-style `messages`
rows whose final assistant turn becomes the `completion` a reward sees), a folder saved with `save_to_disk`,
and in the Python API `datasets.Dataset`s as `train_dataset` / `eval_dataset`."""

import json

import pytest

from rlhfuse.data import DatasetError
from rlhfuse.trainer import build_trainer, compose_config

datasets = pytest.importorskip("datasets")

ROWS = [
    {"prompt": [{"role": "user", "content": "7 + 5 ="}], "answer": "12"},
    {"prompt": [{"role": "user", "content": "2 + 2 ="}], "answer": "4"},
]
SFT_ROWS = [
    {"messages": [{"role": "user", "content": "5 + 7 ="}, {"role": "assistant", "content": "12"}]},
    {"messages": [{"role": "user", "content": "4 ="}, {"role": "assistant", "content": "4"}]},
]


def _overrides(sft, *extra):
    return [
        "experiment=hf_local",
        "algorithm=grpo",
        f"model.sft_path={sft}",
        "data.max_prompt_length=16",
        "data.prompts_per_iteration=2",
        "data.samples_per_prompt=2",
        "data.mini_batch_size=4",
        "data.micro_batch_size=4",
        "inferencer.use_reward_model=false",
        "generator.max_new_tokens=4",
        "logger=quiet",
        *extra,
    ]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trl_conversational_jsonl_trains_and_the_sft_answer_reaches_the_reward_as_completion(
    tmp_path, chat_checkpoint
):
    prompts = _write_jsonl(tmp_path / "p.jsonl", ROWS + SFT_ROWS)
    seen: list[dict] = []

    def completion_seen(samples):  # a reward given as a Python callable: records what it was shown
        seen.extend({"prompt": s.prompt, **s.fields} for s in samples)
        return [float(s.fields.get("completion", s.fields.get("answer")) in s.response) for s in samples]

    cfg = compose_config(_overrides(chat_checkpoint.path, f"data.path={prompts}", "iterations=2"))
    cfg.inferencer.reward_fn = [completion_seen, "numeric_match"]
    cfg.inferencer.reward_weights = [1.0, 0.5]
    lines: list[str] = []
    # numeric_match reads `answer`, which the SFT rows lack: the check names it before training
    with pytest.raises(Exception, match=r"numeric_match.*'answer'"):
        build_trainer(cfg, run_dir=tmp_path / "bad", log=lines.append)
    cfg.inferencer.reward_fn = completion_seen
    cfg.inferencer.reward_weights = None
    lines.clear()
    history = build_trainer(cfg, run_dir=tmp_path / "run", log=lines.append).fit()
    assert len(history) == 2 and all("reward/completion_seen/mean" in row for row in history)
    assert [line for line in lines if "end with an assistant turn" in line] == [
        "rlhfuse: 2 of 4 `messages` rows end with an assistant turn: it is left out of the prompt and kept as "
        "the row's `completion` field (what reward functions see)"
    ]
    sft = [s for s in seen if "completion" in s]
    assert sft and {s["completion"] for s in sft} <= {"12", "4"}
    # the answer never leaks into the prompt the policy sees
    assert all(not s["prompt"].rstrip().endswith(s["completion"] + " <eos> <|assistant|>") for s in sft)
    assert all(s["completion"] not in s["prompt"].split("<|assistant|>", 1)[-1] for s in sft)


def test_python_api_datasets_train_and_evaluate_and_a_saved_folder_is_a_data_path(tmp_path, chat_checkpoint):
    train = datasets.Dataset.from_list(ROWS * 2)
    held_out = datasets.Dataset.from_list(ROWS[:1])
    cfg = compose_config(
        _overrides(chat_checkpoint.path, "inferencer.reward_fn=numeric_match", "eval.every=1", "iterations=1")
    )
    trainer = build_trainer(
        cfg, run_dir=tmp_path / "run", log=lambda _: None, train_dataset=train, eval_dataset=held_out
    )
    (row,) = trainer.fit()
    assert "eval/accuracy" in row and "eval/reward/mean" in row
    run = json.loads((tmp_path / "run" / "run.json").read_text())["run"]
    assert run["config"]["data"]["path"].startswith("datasets.Dataset(rows=4, sha256=")
    assert run["config"]["eval"]["path"].startswith("datasets.Dataset(rows=1, sha256=")

    saved = tmp_path / "saved"
    train.save_to_disk(str(saved))
    cfg = compose_config(
        _overrides(
            chat_checkpoint.path, "inferencer.reward_fn=numeric_match", f"data.path={saved}", "iterations=1"
        )
    )
    (row,) = build_trainer(cfg, run_dir=tmp_path / "folder", log=lambda _: None).fit()
    assert row["iteration"] == 1


def test_python_api_datasets_beside_a_configured_source_or_of_the_wrong_type_fail_before_building(
    tmp_path, chat_checkpoint
):
    prompts = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = compose_config(_overrides(chat_checkpoint.path, f"data.path={prompts}", "eval.split_fraction=0.5"))
    with pytest.raises(ValueError) as err:
        build_trainer(
            cfg,
            run_dir=tmp_path / "run",
            log=lambda _: None,
            train_dataset=datasets.Dataset.from_list(ROWS),
            eval_dataset=datasets.Dataset.from_list(ROWS),
        )
    assert "2 problem(s)" in str(err.value)
    assert f"build_trainer(train_dataset=...) and data.source=file data.path={prompts}" in str(err.value)
    assert "build_trainer(eval_dataset=...) and eval.path=None eval.split_fraction=0.5" in str(err.value)
    with pytest.raises(DatasetError, match=r"pass one split, e\.g\. dataset\['train'\]"):
        build_trainer(
            cfg,
            run_dir=tmp_path / "run",
            train_dataset=datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}),
        )
    assert not (tmp_path / "run").exists()
