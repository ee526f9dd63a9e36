"""Tokenizer, synthetic task, prompt files (bad rows name file:line), length limits and the resumable loader."""

import json

import pytest

from rlhfuse.data import (
    DatasetError,
    PromptLoader,
    SyntheticTask,
    Tokenizer,
    read_prompt_file,
    tokenize_prompts,
)
from rlhfuse.data.prompts import dataset_label, dataset_rows, read_prompt_rows
from rlhfuse.data.synthetic import TOPICS, build_tokenizer, topic_fraction


def test_word_tokenizer_round_trip_and_special_ids(tmp_path):
    tok = build_tokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("animals : cat dog")
    assert ids[0] == tok.bos_id and len(ids) == 5
    assert tok.decode(ids) == "animals : cat dog"
    assert tok.encode("zebra", add_bos=False) == [tok.token_to_id("<unk>")]
    tok.save(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    )
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode("food : cake") == tok.encode("food : cake")
    assert (loaded.pad_id, loaded.eos_id, loaded.vocab_size) == (0, 2, tok.vocab_size)


def test_tokenizer_dir_without_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_topic_fraction_hand_values():
    assert topic_fraction("cat animals :", "cat dog the") == pytest.approx(2 / 3)
    assert topic_fraction("the food :", "cat dog") == 0.0
    assert topic_fraction("food :", "") == 0.0
    assert topic_fraction("no separator", "cat") == 0.0


def test_synthetic_task_is_deterministic_and_long_tailed():
    task = SyntheticTask(seed=3, max_new_tokens=48)
    assert task.sft_examples(50) == SyntheticTask(seed=3, max_new_tokens=48).sft_examples(50)
    examples = task.sft_examples(2000)
    lengths = sorted(len(r.split()) for _, r in examples)
    p50, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p50 <= 8 and p99 >= 4 * p50 and lengths[-1] <= 47  # most short, a few near the limit
    mean_score = sum(topic_fraction(p, r) for p, r in examples) / len(examples)
    assert 0.2 < mean_score < 0.3  # room for PPO to improve
    for prompt, chosen, rejected in task.preference_pairs(100):
        assert topic_fraction(prompt, chosen) > topic_fraction(prompt, rejected)
        assert prompt.split()[-2] in TOPICS and prompt.endswith(" :")


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "ok"', "not valid JSON"),
        ('{"text": "no prompt key"}', "missing key 'prompt'"),
        ('{"prompt": 3}', "must be a non-empty string or a list of chat messages"),
        ('["a list"]', "expected a JSON object"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "p.jsonl", ['{"prompt": "fine"}', "", line])
    with pytest.raises(DatasetError, match=rf"p\.jsonl:3: .*{message}"):
        read_prompt_file(path)


def test_prompt_file_reads_rows_and_missing_file_errors(tmp_path):
    path = _write(tmp_path / "p.jsonl", ['{"q": "animals : cat"}', '{"q": "food : egg"}'])
    assert read_prompt_file(path, "q") == ["animals : cat", "food : egg"]
    with pytest.raises(FileNotFoundError, match=r"data\.path"):
        read_prompt_file(tmp_path / "absent.jsonl")


def test_prompt_longer_than_limit_errors_unless_truncation_is_chosen():
    tok = build_tokenizer()
    texts = ["animals : cat dog bird fish", "food : egg"]
    with pytest.raises(
        DatasetError, match=r"data.max_prompt_length=4: prompt 0 has 7 tokens.*data.truncate=left"
    ):
        tokenize_prompts(texts, tok, max_length=4)
    left = tokenize_prompts(texts, tok, max_length=4, truncate="left")
    right = tokenize_prompts(texts, tok, max_length=4, truncate="right")
    assert tok.decode(left[0].token_ids) == "cat dog bird fish" and len(left[0].token_ids) == 4
    assert right[0].token_ids == tuple(tok.encode("animals : cat"))
    assert left[1].token_ids == right[1].token_ids == tuple(tok.encode("food : egg"))


def test_loader_covers_each_epoch_and_resumes_at_the_epoch_boundary():
    tok = build_tokenizer()
    prompts = tokenize_prompts(SyntheticTask().prompts(10), tok, max_length=16)
    loader = PromptLoader(prompts, 4, seed=1)
    epoch0 = [p.id for _ in range(2) for p in loader.next_batch()]
    assert len(set(epoch0)) == 8  # 2 batches of 4 from a permutation; the remainder of 2 is dropped
    state = loader.state_dict()  # saved exactly at the end of an epoch
    expected_next = [p.id for p in loader.next_batch()]
    resumed = PromptLoader(prompts, 4, seed=1)
    resumed.load_state_dict(state)
    assert [p.id for p in resumed.next_batch()] == expected_next
    assert resumed.epoch == 1  # it trains the next epoch rather than stopping or repeating epoch 0
    with pytest.raises(ValueError, match=r"data\.prompts_per_iteration=11"):
        PromptLoader(prompts, 11, seed=1)


def test_parquet_prompts_read_in_the_default_install(tmp_path):
    import pyarrow as pa  # comes with datasets, a dependency
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["cat animals :", "dog animals :"], "answer": ["1", "2"]}), path)
    assert read_prompt_rows(path) == [("cat animals :", {"answer": "1"}), ("dog animals :", {"answer": "2"})]
    pq.write_table(pa.table({"prompt": ["cat animals :", ""]}), path)
    with pytest.raises(DatasetError, match=r"p\.parquet: row 1: 'prompt' must be a non-empty string"):
        read_prompt_file(path)


def test_saved_datasets_and_in_memory_datasets_are_prompt_sources(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [  # a table mixing both formats: each row has every column, None where it has no value
        {"prompt": [{"role": "user", "content": "7 + 5 ="}], "messages": None, "answer": "12"},
        {
            "prompt": None,
            "messages": [{"role": "user", "content": "2 + 2 ="}, {"role": "assistant", "content": "4"}],
            "answer": None,
        },
    ]
    dataset = datasets.Dataset.from_list(rows)
    # each row is read in its own format, the other's None column is not one of its fields, and the
    # assistant's final turn is the `completion`
    expected = [
        ([{"role": "user", "content": "7 + 5 ="}], {"answer": "12"}),
        ([{"role": "user", "content": "2 + 2 ="}], {"answer": None, "completion": "4"}),
    ]
    assert dataset_rows(dataset) == expected
    saved = tmp_path / "saved"
    dataset.save_to_disk(str(saved))
    assert read_prompt_rows(saved) == read_prompt_rows(dataset) == dataset_rows(dataset)
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DatasetError, match=r"splits \['train', 'test'\]: set data\.path=.*dict/train"):
        read_prompt_rows(tmp_path / "dict")
    assert len(read_prompt_rows(tmp_path / "dict" / "train")) == 2
    (tmp_path / "plain").mkdir()
    with pytest.raises(
        DatasetError, match=r"plain is a folder but not one saved with datasets' save_to_disk"
    ):
        read_prompt_rows(tmp_path / "plain")
    with pytest.raises(DatasetError, match=r"got list: wrap rows with datasets\.Dataset\.from_list"):
        read_prompt_rows(rows)  # type: ignore[arg-type]
    label = dataset_label(dataset)
    assert label.startswith("datasets.Dataset(rows=2, sha256=") and label == dataset_label(
        datasets.Dataset.from_list(rows)
    )
    assert dataset_label(datasets.Dataset.from_list(rows[:1])) != label
