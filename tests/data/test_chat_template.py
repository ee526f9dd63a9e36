"""Chat templates: prompts rendered with the checkpoint's own template (as transformers renders it, no duplicated
BOS), `messages` rows, stop tokens from generation_config.json, and templates that fail naming their file."""

import json

import pytest

from rlhfuse.data import DataConfig, DatasetError, Tokenizer, load_prompts
from rlhfuse.data.tokenizer import ChatTemplateError

# A template in the style of real ones: BOS written by the template, a default system turn, a generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|system|> be brief {{ eos_token }} {% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ["<|system|>", "<|user|>", "<|assistant|>", "be", "brief", "7", "+", "5", "=", "2", "-", "you", "are"]


def _checkpoint_tokenizer(tmp_path, template=TEMPLATE, *, jinja_file=False):
    """A word-level tokenizer saved with a chat template, plus a config.json and a generation_config.json that
    lists a second stop token (as instruct checkpoints do)."""
    tok = Tokenizer.from_words(WORDS)
    tok.chat_template = None if jinja_file else template
    tok.save(tmp_path)
    if jinja_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "config.json").write_text(
        json.dumps({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    )
    user = tok.token_to_id("<|user|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, user]}))
    return Tokenizer.from_dir(tmp_path)


def test_render_matches_transformers_apply_chat_template_without_a_duplicated_bos(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = _checkpoint_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "7 + 5 ="}]
    ids = tok.encode_chat(messages)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected)
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id  # the template's BOS only
    assert tok.decode(ids, skip_special=False).split()[-1] == "<|assistant|>"
    assert tok.stop_ids == (2, tok.token_to_id("<|user|>"))


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    tok = _checkpoint_tokenizer(
        tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}", jinja_file=True
    )
    assert tok.render_chat([{"role": "user", "content": "7 + 5 ="}]) == "7 + 5 ="
    assert tok.template_source == str(tmp_path / "chat_template.jinja")


def test_file_prompts_as_text_or_messages_and_data_chat_template_none(tmp_path):
    tok = _checkpoint_tokenizer(tmp_path / "ckpt")
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "7 + 5 =", "answer": "12"},
        {"messages": [{"role": "system", "content": "you are brief"}, {"role": "user", "content": "2 - 2 ="}],
         "answer": "0"},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DataConfig(source="file", path=str(path), max_prompt_length=32)
    text, chat = load_prompts(config, tok, seed=0)
    assert text.token_ids == tuple(tok.encode_chat([{"role": "user", "content": "7 + 5 ="}]))
    assert text.fields == {"answer": "12"} and chat.fields == {"answer": "0"}
    assert (
        "<|system|> you are brief" in chat.text and "be brief" not in chat.text
    )  # the row's own system turn
    with pytest.raises(
        DatasetError, match=r"prompt 1 of .*p\.jsonl is a list of chat messages.*chat_template"
    ):
        load_prompts(DataConfig(source="file", path=str(path), chat_template="none"), tok, seed=0)
    path.write_text(json.dumps(rows[0]) + "\n")
    (plain,) = load_prompts(DataConfig(source="file", path=str(path), chat_template="none"), tok, seed=0)
    assert plain.token_ids == tuple(tok.encode("7 + 5 =")) and plain.token_ids[0] == tok.bos_id


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('no system turns allowed') }}", "fails to render .*no system turns allowed"),
        ("{% for m in messages %}{{ m['content'] }}", "does not compile"),
    ],
)
def test_a_template_that_fails_names_its_file_and_the_prompt(tmp_path, template, message):
    tok = _checkpoint_tokenizer(tmp_path / "ckpt", template)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "7 + 5 ="}) + "\n")
    with pytest.raises(
        ChatTemplateError, match=rf"tokenizer_config\.json \(key chat_template\): .*{message}"
    ):
        load_prompts(DataConfig(source="file", path=str(path)), tok, seed=0)


def test_malformed_messages_row_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DatasetError, match=r"p\.jsonl:1: message 0: 'messages' must be a non-empty list"):
        load_prompts(DataConfig(source="file", path=str(path)), Tokenizer.from_words(WORDS), seed=0)


def test_special_tokens_from_tokenizer_config_when_config_json_has_none(tmp_path):
    tok = Tokenizer.from_words(["hello", "<|im_end|>"])
    tok.eos_id = tok.token_to_id("<|im_end|>")
    tok.save(tmp_path)  # tokenizer_config.json names eos_token "<|im_end|>"; no config.json
    loaded = Tokenizer.from_dir(tmp_path)
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (0, 1, tok.token_to_id("<|im_end|>"))
    assert loaded.chat_template is None


def test_prompt_template_rewrites_text_prompts_with_row_fields_before_the_chat_template(tmp_path):
    tok = _checkpoint_tokenizer(tmp_path / "ckpt")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "7 + 5 =", "a": 7, "answer": "12"}) + "\n")
    config = DataConfig(source="file", path=str(path), max_prompt_length=32, prompt_template="{a} + {prompt}")
    (prompt,) = load_prompts(config, tok, seed=0)
    assert prompt.token_ids == tuple(tok.encode_chat([{"role": "user", "content": "7 + 7 + 5 ="}]))
    arithmetic = DataConfig(source="arithmetic", num_prompts=3, prompt_template="{a} {op} {b} ?")
    first = load_prompts(arithmetic, Tokenizer.from_words(WORDS), seed=0)[0]
    assert first.text.endswith("?") and first.fields["answer"]
    config.prompt_template = "What is {x}?"
    with pytest.raises(
        DatasetError, match=r"names \{x\} but row 0 of .*p\.jsonl has only \['a', 'answer', 'prompt'\]"
    ):
        load_prompts(config, tok, seed=0)


def test_trl_conversational_prompt_and_sft_row_answer_kept_out_of_the_prompt(tmp_path):
    tok = _checkpoint_tokenizer(tmp_path / "ckpt")
    path = tmp_path / "p.jsonl"
    user = {"role": "user", "content": "7 + 5 ="}
    rows = [
        {"prompt": [user], "answer": "12"},  # TRL's conversational format
        {
            "messages": [user, {"role": "assistant", "content": "12"}]
        },  # an SFT row: the answer is the last turn
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trl, sft = load_prompts(DataConfig(source="file", path=str(path), max_prompt_length=32), tok, seed=0)
    assert trl.token_ids == sft.token_ids == tuple(tok.encode_chat([user]))
    assert trl.fields == {"answer": "12"}
    assert sft.fields == {"completion": "12"} and "12" not in sft.text  # no leak into the prompt
    path.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(DatasetError, match=r"p\.jsonl:1: message 0: 'prompt' must be a non-empty list"):
        load_prompts(DataConfig(source="file", path=str(path)), tok, seed=0)
