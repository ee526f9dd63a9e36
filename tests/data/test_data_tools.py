"""Prompts with tools, as TRL users have them (issue 43): a `tools` column of JSON schemas (a list, or its JSON
text) is rendered into the prompt through the chat template's `tools`, and OpenAI-style tool-call messages (an
assistant message's `tool_calls` with a null content, then the tool's answer) pass through to the template; bad
input is one line naming the file, the row and the key."""

from __future__ import annotations

import json

import pytest

from rlhfuse.data.prompts import DatasetError, read_prompt_rows, tokenize_prompts
from rlhfuse.testing.chat import TEMPLATE, byte_tokenizer

# the test template, rendering an assistant message's tool calls as Qwen's does
CALLS = TEMPLATE.replace(
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}{%- for c in m.tool_calls or [] %}"
    "{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}",
)
SCHEMA = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}
MESSAGES = [
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    },
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "user", "content": "And 5 + 1?"},
]


def test_a_tools_column_and_tool_call_messages_reach_the_chat_template(tmp_path) -> None:
    assert CALLS != TEMPLATE
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": MESSAGES, "tools": [SCHEMA], "answer": "6"},
        {"prompt": MESSAGES, "tools": json.dumps([SCHEMA])},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_prompt_rows(path)
    assert [fields["tools"] for _, fields in read] == [[SCHEMA], [SCHEMA]]  # the JSON text parsed
    assert read[0][0][1]["content"] == "" and read[0][0][1]["tool_calls"][0]["function"]["name"] == "add"
    prompts = tokenize_prompts(
        [text for text, _ in read],
        byte_tokenizer(CALLS),
        max_length=1024,
        rows=[f for _, f in read],
        chat=True,
    )
    text = prompts[0].text
    assert text.startswith(
        "<|im_start|>system\nTools:\n" + json.dumps(SCHEMA)
    )  # the schema, in the system turn
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert prompts[1].text == text and prompts[0].messages[1]["tool_calls"] == MESSAGES[1]["tool_calls"]


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"prompt": "hi", "tools": "not json"}, r"p.jsonl:1: 'tools' is a string but not JSON"),
        ({"prompt": "hi", "tools": {"name": "add"}}, r"p.jsonl:1: 'tools' must be a list of JSON schemas"),
        (
            {"prompt": [{"role": "assistant", "content": None}]},
            r"p.jsonl:1: message 0: .* may have a null content",
        ),
    ],
)
def test_bad_tools_or_tool_call_messages_are_one_line_naming_the_row(tmp_path, row, match) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=match):
        read_prompt_rows(path)
