"""Prompt datasets (the embedded synthetic / arithmetic tasks or a local JSONL/Parquet file), tokenisation with a
length limit, and a resumable loader that yields a fixed number of prompts per iteration, epoch after epoch.

Each prompt keeps its dataset row's other fields (`Prompt.fields`, e.g. a reference `answer`): the rollout carries
only the prompt's id (`Rollout.prompt_index_B`), and the reward stage looks the fields up by it.

A file row holds either a prompt (`data.prompt_key`: a text, or a list of chat messages as in TRL's
conversational format) or chat messages (a `messages` list of {"role", "content"} objects). A `messages` row
whose last turn is the assistant's (an SFT-style row) keeps that turn out of the prompt, as the row's
`completion` field (which reward functions see). With `data.chat_template=auto` and a tokenizer that has a chat template, every prompt
is rendered with it (a text as one user turn) and ends with the assistant's generation prompt; otherwise prompts
are plain text with the tokenizer's BOS first, and `messages` rows are an error."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfuse._optional import MissingDependencyError
from rlhfuse.data.arithmetic import ArithmeticTask
from rlhfuse.data.config import DataConfig
from rlhfuse.data.synthetic import SyntheticTask
from rlhfuse.data.tokenizer import ChatTemplateError, Tokenizer

MESSAGES_KEY = "messages"
COMPLETION_KEY = "completion"
# a prompt: its text, or chat messages ({"role", "content"} each)
PromptInput = str | list[dict[str, Any]]


class DatasetError(ValueError):
    """A dataset file is malformed; the message names the file and the line (or row)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its position in the dataset (`id`), text (as rendered by the chat template, when one is used),
    token ids (BOS first when the tokenizer has one and no template is used) and the dataset row's other fields
    (what a reward function may read, e.g. `answer`)."""

    id: int
    text: str
    token_ids: tuple[int, ...]
    fields: Mapping[str, Any] = field(default_factory=dict)


def read_prompt_file(path: str | Path, prompt_key: str = "prompt") -> list[PromptInput]:
    """Read prompts (texts, or chat messages) from a .jsonl or .parquet file; malformed rows raise DatasetError
    naming file:line."""
    return [text for text, _ in read_prompt_rows(path, prompt_key)]


def read_prompt_rows(
    path: str | Path, prompt_key: str = "prompt"
) -> list[tuple[PromptInput, dict[str, Any]]]:
    """(prompt text or messages, the row's other fields) of every row of a .jsonl or .parquet file; malformed rows
    raise DatasetError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt file {path} does not exist: set data.path to a local .jsonl or .parquet file"
        )
    if path.suffix == ".parquet":
        return _read_parquet(path, prompt_key)
    if path.suffix not in (".jsonl", ".json"):
        raise DatasetError(f"{path}: unsupported prompt file type {path.suffix!r}: use .jsonl or .parquet")
    texts: list[tuple[PromptInput, dict[str, Any]]] = []
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(
                    f"{path}:{lineno}: not UTF-8 text (byte {err.start} of the line): re-save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(
                    f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})"
                ) from None
            texts.append((_prompt_of(row, prompt_key, f"{path}:{lineno}"), _fields_of(row, prompt_key)))
    if not texts:
        raise DatasetError(f"{path}: no prompts found (empty file)")
    return texts


def _read_parquet(path: Path, prompt_key: str) -> list[tuple[PromptInput, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq  # optional: only Parquet prompt files need it
    except ImportError:
        raise MissingDependencyError(
            f"reading {path} needs pyarrow: `pip install pyarrow` (or convert it to .jsonl)"
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"{path}: not a readable Parquet file ({err}): re-export it") from None
    return [
        (_prompt_of(row, prompt_key, f"{path}: row {i}"), _fields_of(row, prompt_key))
        for i, row in enumerate(rows)
    ]


def _fields_of(row: dict[str, Any], prompt_key: str) -> dict[str, Any]:
    key = prompt_key if prompt_key in row else MESSAGES_KEY
    fields = {k: v for k, v in row.items() if k != key}
    if key == MESSAGES_KEY and _ends_with_answer(row[MESSAGES_KEY]):
        fields[COMPLETION_KEY] = row[MESSAGES_KEY][-1]["content"]  # the SFT answer, for the reward
    return fields


def _ends_with_answer(messages: list[dict[str, Any]]) -> bool:
    return len(messages) > 1 and messages[-1]["role"] == "assistant"


def completion_rows(rows: list[Mapping[str, Any]]) -> int:
    """How many rows carry a `completion` taken from a final assistant turn (the trainer logs it once)."""
    return sum(COMPLETION_KEY in row for row in rows)


def _prompt_of(row: object, prompt_key: str, where: str) -> PromptInput:
    if not isinstance(row, dict):
        raise DatasetError(
            f"{where}: expected a JSON object with key {prompt_key!r}, got {type(row).__name__}"
        )
    if prompt_key not in row and MESSAGES_KEY in row:
        messages = _messages_of(row[MESSAGES_KEY], where, MESSAGES_KEY)
        return messages[:-1] if _ends_with_answer(messages) else messages  # the answer never leaks in
    if prompt_key not in row:
        raise DatasetError(
            f"{where}: missing key {prompt_key!r} (keys: {sorted(row)}); set data.prompt_key to the prompt field "
            f"(or give chat messages as {MESSAGES_KEY!r})"
        )
    text = row[prompt_key]
    if isinstance(text, list):  # TRL's conversational format: the prompt as chat messages
        return _messages_of(text, where, prompt_key)
    if not isinstance(text, str) or not text.strip():
        raise DatasetError(
            f"{where}: {prompt_key!r} must be a non-empty string or a list of chat messages, got {text!r}"[
                :400
            ]
        )
    return text


def _messages_of(value: object, where: str, key: str) -> list[dict[str, Any]]:
    fix = f'{key!r} must be a non-empty list of {{"role": ..., "content": ...}} objects with string values'
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: {fix}, got {value!r}"[:400])
    for k, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DatasetError(f"{where}: message {k}: {fix}, got {message!r}"[:400])
    return [dict(m) for m in value]


def apply_prompt_template(
    texts: list[PromptInput], rows: list[dict[str, Any]] | None, template: str, source: str
) -> list[PromptInput]:
    """Each text prompt rewritten as `template.format(prompt=text, **row)` (chat messages are left as they are);
    a placeholder the row lacks is a DatasetError naming the row and `data.prompt_template`."""
    out: list[PromptInput] = []
    for i, text in enumerate(texts):
        if isinstance(text, list):
            out.append(text)
            continue
        fields = rows[i] if rows else {}
        try:
            out.append(template.format(**{**fields, "prompt": text}))
        except KeyError as err:
            raise DatasetError(
                f"data.prompt_template={template!r} names {{{err.args[0]}}} but row {i} of {source} has only "
                f"{sorted(['prompt', *fields])}: use {{prompt}} or one of the row's fields"
            ) from None
        except (IndexError, ValueError) as err:
            raise DatasetError(
                f"data.prompt_template={template!r} is not a valid format string ({err}): write fields as "
                "{name} and literal braces as {{ }}"
            ) from None
    return out


def uses_chat_template(config: DataConfig, tokenizer: Tokenizer) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template (data.chat_template=auto and it has one)."""
    return config.chat_template == "auto" and tokenizer.chat_template is not None


def tokenize_prompts(
    texts: list[PromptInput],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    truncate: str = "error",
    rows: list[dict[str, Any]] | None = None,
    chat: bool = False,
    source: str = "the dataset",
) -> list[Prompt]:
    """Tokenise every prompt (with its row's fields, `rows[i]`, if given): with `chat`, rendered by the tokenizer's
    chat template (a text as one user turn), else as text after a BOS. Prompts over `max_length` tokens are an
    error unless truncate is left|right; a template that fails names its file and the prompt."""
    prompts, too_long = [], []
    for i, text in enumerate(texts):
        if chat:
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
            try:
                text = tokenizer.render_chat(messages)
            except ChatTemplateError as err:
                raise ChatTemplateError(f"{err} (prompt {i} of {source}: {messages!r:.200})") from None
            ids = tokenizer.encode(text, add_bos=False)  # the template writes any BOS: none is duplicated
        elif isinstance(text, list):
            raise DatasetError(
                f"prompt {i} of {source} is a list of chat messages but no chat template is used (data.chat_template"
                f"=none, or the tokenizer has no chat template): give prompt texts, "
                "set data.chat_template=auto, or use a checkpoint whose tokenizer_config.json has a chat_template"
            )
        else:
            ids = tokenizer.encode(text)
        if len(ids) > max_length:
            if truncate == "left":
                ids = ids[len(ids) - max_length :]
            elif truncate == "right":
                ids = ids[:max_length]
            else:
                too_long.append((i, len(ids)))
        prompts.append(Prompt(id=i, text=str(text), token_ids=tuple(ids), fields=rows[i] if rows else {}))
    if too_long:
        shown = ", ".join(f"prompt {i} has {n} tokens" for i, n in too_long[:5])
        more = f" (and {len(too_long) - 5} more)" if len(too_long) > 5 else ""
        raise DatasetError(
            f"{len(too_long)} prompt(s) longer than data.max_prompt_length={max_length}: {shown}{more}; "
            f"raise data.max_prompt_length or set data.truncate=left (keep the end) or data.truncate=right"
        )
    return prompts


def load_prompts(config: DataConfig, tokenizer: Tokenizer, *, seed: int) -> list[Prompt]:
    rows: list[dict[str, Any]] | None = None
    texts: list[PromptInput]
    if config.source == "synthetic":
        texts = list(SyntheticTask(seed=seed).prompts(config.num_prompts))
    elif config.source == "arithmetic":
        task = ArithmeticTask(seed=seed, max_operand=config.max_operand)
        texts, rows = list(task.prompts(config.num_prompts)), task.rows(config.num_prompts)
    else:
        assert config.path is not None, "validated: data.source=file needs data.path"
        pairs = read_prompt_rows(config.path, config.prompt_key)
        texts, rows = [text for text, _ in pairs], [fields for _, fields in pairs]
    if config.prompt_template is not None:
        texts = apply_prompt_template(
            texts, rows, config.prompt_template, config.path or f"data.source={config.source}"
        )
    return tokenize_prompts(
        texts,
        tokenizer,
        max_length=config.max_prompt_length,
        truncate=config.truncate,
        rows=rows,
        chat=uses_chat_template(config, tokenizer),
        source=config.path or f"data.source={config.source}",
    )


class PromptLoader:
    """Yields `batch_size` prompts per call, walking a fresh seeded permutation every epoch.

    The position (`epoch`, `offset`) is the whole state, so a resumed loader continues exactly where the saved
    one stopped; an epoch whose remainder is smaller than a batch is dropped and the next epoch starts (resuming
    at an epoch boundary trains the next epoch, it does not stop or repeat the finished one).
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, *, seed: int) -> None:
        if batch_size > len(prompts):
            raise ValueError(
                f"data.prompts_per_iteration={batch_size} exceeds the {len(prompts)} prompts of the dataset: "
                "lower data.prompts_per_iteration or add prompts"
            )
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.prompts), generator=generator).tolist()

    def next_batch(self) -> list[Prompt]:
        if self.offset + self.batch_size > len(self.prompts):
            self.epoch, self.offset = self.epoch + 1, 0
        order = self._order(self.epoch)[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        return [self.prompts[i] for i in order]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
