"""The embedded verifiable task and the dataset rows' fields: generated problems with right answers, tokenised by
the task's vocabulary, and every row's other fields kept with its prompt (generated task and prompt file)."""

import json

from rlhfuse.data import ArithmeticTask, DataConfig, load_prompts, read_prompt_rows
from rlhfuse.data.synthetic import build_tokenizer


def test_problems_are_deterministic_and_their_answers_right():
    task = ArithmeticTask(seed=3)
    assert task.prompts(20) == ArithmeticTask(seed=3).prompts(20) != ArithmeticTask(seed=4).prompts(20)
    for prompt, row in (task.problem(i) for i in range(200)):
        a, op, b, eq = prompt.split()
        assert eq == "=" and int(a) == row["a"] and int(b) == row["b"] and op == row["op"]
        assert int(row["answer"]) == (row["a"] + row["b"] if op == "+" else row["a"] - row["b"])


def test_sft_examples_follow_the_format_and_are_right_at_about_the_configured_rate():
    task = ArithmeticTask(seed=0)
    rows = task.rows(2000)
    examples = task.sft_examples(2000)
    right = sum(r.split()[-1] == row["answer"] for (_, r), row in zip(examples, rows, strict=True))
    assert 0.25 < right / 2000 < 0.35
    assert sum(r.startswith("answer :") for _, r in examples) == 2000 - 2000 // 8
    for prompt, chosen, rejected in task.preference_pairs(50):
        answer = task.problem(task.prompts(50).index(prompt))[1]["answer"]
        assert chosen.split()[-1] == answer != rejected.split()[-1]


def test_load_prompts_keeps_the_rows_fields():
    task = ArithmeticTask(seed=0, max_operand=5)
    cfg = DataConfig(source="arithmetic", num_prompts=30, max_prompt_length=8, max_operand=5)
    prompts = load_prompts(cfg, task.tokenizer(), seed=0)
    assert [p.fields for p in prompts] == task.rows(30)
    assert [p.id for p in prompts] == list(range(30))
    unk = task.tokenizer().token_to_id("<unk>")
    assert all(unk not in p.token_ids for p in prompts)


def test_prompt_file_rows_reach_the_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"q": "animals : cat", "answer": "3", "meta": {"k": 1}}, {"q": "food : egg", "answer": "4"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_prompt_rows(path, "q") == [
        ("animals : cat", {"answer": "3", "meta": {"k": 1}}),
        ("food : egg", {"answer": "4"}),
    ]
    cfg = DataConfig(source="file", path=str(path), prompt_key="q")
    prompts = load_prompts(cfg, build_tokenizer(), seed=0)
    assert [p.fields["answer"] for p in prompts] == ["3", "4"]
