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


def test_parquet_prompts_read_or_name_the_missing_dependency(tmp_path):
    path = tmp_path / "p.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            read_prompt_file(path)
        return
    pq.write_table(pa.table({"prompt": ["cat animals :", ""]}), path)
    with pytest.raises(DatasetError, match=r"p\.parquet: row 1: 'prompt' must be a non-empty string"):
        read_prompt_file(path)
