"""Prompt datasets (the embedded synthetic / arithmetic tasks, a local JSONL/Parquet file, a folder saved with
`datasets.Dataset.save_to_disk`, or a `datasets.Dataset` given to the Python API), tokenisation with a
length limit, and a resumable loader that yields a fixed number of prompts per iteration, epoch after epoch.

Each prompt keeps its dataset row's other fields (`Prompt.fields`, e.g. a reference `answer`): the rollout carries
only the prompt's id (`Rollout.prompt_index_B`), and the reward stage looks the fields up by it.

A file row holds either a prompt (`data.prompt_key`: a text, or a list of chat messages as in TRL's
conversational format) or chat messages (a `messages` list of {"role", "content"} objects). A `messages` row
whose last turn is the assistant's (an SFT-style row) keeps that turn out of the prompt, as the row's
`completion` field (which reward functions see). With `data.chat_template=auto` and a tokenizer that has a chat
template, every prompt is rendered with it (a text as one user turn) and ends with the assistant's generation
prompt; otherwise prompts are plain text with the tokenizer's BOS first, and `messages` rows are an error."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfuse.data.arithmetic import ARITHMETIC_TASKS, ArithmeticTask
from rlhfuse.data.data_config import DataConfig
from rlhfuse.data.guessing import GuessingTask
from rlhfuse.data.synthetic import SyntheticTask
from rlhfuse.data.tokenizer import ChatTemplateError, Tokenizer

MESSAGES_KEY = "messages"
TOOLS_KEY = "tools"
COMPLETION_KEY = "completion"
# a prompt: its text, or chat messages ({"role", "content"} each)
PromptInput = str | list[dict[str, Any]]
# a dataset row: its prompt and its other fields
PromptRow = tuple[PromptInput, dict[str, Any]]


class DatasetError(ValueError):
    """A dataset file is malformed; the message names the file and the line (or row)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its position in the dataset (`id`), text (as rendered by the chat template, when one is used),
    token ids (BOS first when the tokenizer has one and no template is used), the dataset row's other fields
    (what a reward function may read, e.g. `answer`) and, rendered by a chat template, the chat messages it was
    rendered from (what a multi-turn episode continues: `rlhfuse.agents`; empty without a template)."""

    id: int
    text: str
    token_ids: tuple[int, ...]
    fields: Mapping[str, Any] = field(default_factory=dict)
    messages: tuple[Mapping[str, Any], ...] = ()


def read_prompt_file(path: str | Path, prompt_key: str = "prompt") -> list[PromptInput]:
    """Read prompts (texts, or chat messages) from a .jsonl or .parquet file or a `save_to_disk` folder;
    malformed rows raise DatasetError naming file:line (or row)."""
    return [text for text, _ in read_prompt_rows(path, prompt_key)]


def read_prompt_rows(source: str | Path | Any, prompt_key: str = "prompt") -> list[PromptRow]:
    """(prompt text or messages, the row's other fields) of every row of `source`: a .jsonl or .parquet file, a
    folder saved with `datasets.Dataset.save_to_disk`, or a `datasets.Dataset` (the Python API's); malformed rows
    raise DatasetError naming file:line (or row)."""
    if not isinstance(source, str | Path):
        return dataset_rows(source, prompt_key)
    path = Path(source)
    if path.is_dir():
        return _read_saved_dataset(path, prompt_key)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt file {path} does not exist: set data.path to a local .jsonl or .parquet file or a folder "
            "saved with datasets' save_to_disk"
        )
    if path.suffix == ".parquet":
        return _read_parquet(path, prompt_key)
    if path.suffix not in (".jsonl", ".json"):
        raise DatasetError(
            f"{path}: unsupported prompt file type {path.suffix!r}: use .jsonl or .parquet (or a folder saved "
            "with datasets' save_to_disk)"
        )
    texts: list[PromptRow] = []
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
            where = f"{path}:{lineno}"
            texts.append((_prompt_of(row, prompt_key, where), _fields_of(row, prompt_key, where)))
    if not texts:
        raise DatasetError(f"{path}: no prompts found (empty file)")
    return texts


def _read_parquet(path: Path, prompt_key: str) -> list[PromptRow]:
    import pyarrow.parquet as pq  # pyarrow comes with `datasets` (a dependency); imported only when needed

    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"{path}: not a readable Parquet file ({err}): re-export it") from None
    return _rows_of(rows, prompt_key, str(path))


def _read_saved_dataset(path: Path, prompt_key: str) -> list[PromptRow]:
    """A folder written by `Dataset.save_to_disk` (a `DatasetDict`'s holds one folder per split)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DatasetError(
            f"{path} is a folder but not one saved with datasets' save_to_disk (no dataset_info.json or "
            "dataset_dict.json in it): set data.path to such a folder or to a .jsonl or .parquet file"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        raise DatasetError(
            f"{path} holds a DatasetDict with splits {splits}: set data.path={path / splits[0]} (one split's "
            "folder)"
        )
    return dataset_rows(loaded, prompt_key, str(path))


def dataset_rows(dataset: Any, prompt_key: str = "prompt", where: str | None = None) -> list[PromptRow]:
    """The rows of a `datasets.Dataset` (any other object: DatasetError naming what to pass instead)."""
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        raise DatasetError(
            f"a DatasetDict with splits {list(dataset)} was given for the prompts: pass one split, e.g. "
            f"dataset[{next(iter(dataset), 'train')!r}]"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise DatasetError(
            f"prompts must be a datasets.Dataset, a .jsonl or .parquet file or a save_to_disk folder, got "
            f"{type(dataset).__name__}: wrap rows with datasets.Dataset.from_list(rows)"
        )
    return _rows_of(dataset.to_list(), prompt_key, where or dataset_label(dataset))


def dataset_label(dataset: Any) -> str:
    """How an in-memory `datasets.Dataset` is named in messages and in the run's recorded configuration: its
    size and a hash of its rows (so that a resume with other rows is told so)."""
    digest = hashlib.sha256(json.dumps(dataset.to_list(), sort_keys=True, default=str).encode()).hexdigest()
    return f"datasets.Dataset(rows={dataset.num_rows}, sha256={digest[:12]})"


def _rows_of(rows: list[dict[str, Any]], prompt_key: str, where: str) -> list[PromptRow]:
    if not rows:
        raise DatasetError(f"{where}: no prompts found (no rows)")
    return [
        (_prompt_of(row, prompt_key, f"{where}: row {i}"), _fields_of(row, prompt_key, f"{where}: row {i}"))
        for i, row in enumerate(rows)
    ]


def _fields_of(row: dict[str, Any], prompt_key: str, where: str) -> dict[str, Any]:
    key = _format_key(row, prompt_key)
    # the other format's column is None in a table mixing both (Arrow fills absent columns): not a field
    fields = {
        k: v for k, v in row.items() if k != key and not (k in (prompt_key, MESSAGES_KEY) and v is None)
    }
    if key == MESSAGES_KEY and _ends_with_answer(row[MESSAGES_KEY]):
        fields[COMPLETION_KEY] = row[MESSAGES_KEY][-1]["content"]  # the SFT answer, for the reward
    if fields.get(TOOLS_KEY) is not None:
        fields[TOOLS_KEY] = _tools_of(fields[TOOLS_KEY], where)
    return fields


def _tools_of(value: object, where: str) -> list[dict[str, Any]]:
    """A row's `tools` column: the JSON schemas of the functions offered to the model (OpenAI's
    {"type": "function", "function": {...}} or the function's schema alone), as a list or its JSON text (how
    Parquet files often hold it); rendered into the prompt through the chat template's `tools`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{where}: {TOOLS_KEY!r} is a string but not JSON ({err.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DatasetError(
            f'{where}: {TOOLS_KEY!r} must be a list of JSON schemas ({{"type": "function", "function": '
            f'{{"name": ..., "parameters": ...}}}} each), got {value!r}'[:400]
        )
    return [dict(t) for t in value]


def _format_key(row: dict[str, Any], prompt_key: str) -> str:
    """The key holding the row's prompt: `prompt_key`, or `messages` when the row has no prompt (a None prompt is
    none: a table's row of the other format)."""
    if row.get(prompt_key) is None and row.get(MESSAGES_KEY) is not None:
        return MESSAGES_KEY
    return prompt_key


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
    if _format_key(row, prompt_key) == MESSAGES_KEY:
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
    """Chat messages, checked: {"role", "content"} with string values; OpenAI's tool calls kept for the template
    (an assistant message's `tool_calls` list, whose content may then be null, read as ""; a "tool" message's
    `name` or `tool_call_id`)."""
    fix = f'{key!r} must be a non-empty list of {{"role": ..., "content": ...}} objects with string values'
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: {fix}, got {value!r}"[:400])
    out = []
    for k, message in enumerate(value):
        calls = isinstance(message, dict) and isinstance(message.get("tool_calls"), list)
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and (isinstance(message.get("content"), str) or (calls and message.get("content") is None))
        ):
            raise DatasetError(
                f'{where}: message {k}: {fix} (an assistant message with "tool_calls" may have a null '
                f"content), got {message!r}"[:400]
            )
        out.append({**message, "content": message.get("content") or ""})
    return out


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
        messages: list[dict[str, Any]] = []
        if chat:
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
            try:
                text = tokenizer.render_chat(messages, tools=rows[i].get(TOOLS_KEY) if rows else None)
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
        prompts.append(
            Prompt(
                id=i,
                text=str(text),
                token_ids=tuple(ids),
                fields=rows[i] if rows else {},
                messages=tuple(messages),
            )
        )
    if too_long:
        shown = ", ".join(f"prompt {i} has {n} tokens" for i, n in too_long[:5])
        more = f" (and {len(too_long) - 5} more)" if len(too_long) > 5 else ""
        raise DatasetError(
            f"{len(too_long)} prompt(s) longer than data.max_prompt_length={max_length}: {shown}{more}; "
            f"raise data.max_prompt_length or set data.truncate=left (keep the end) or data.truncate=right"
        )
    return prompts


ROW_SOURCES = (*ARITHMETIC_TASKS, "guess")
"""The embedded sources whose prompts come with dataset rows (the answer, the number to guess)."""


def _row_task(config: DataConfig, seed: int) -> ArithmeticTask | GuessingTask:
    """The generated task of a `ROW_SOURCES` source."""
    if config.source == "guess":
        return GuessingTask(seed=seed)
    return ARITHMETIC_TASKS[config.source](seed=seed, max_operand=config.max_operand)


def load_prompts(config: DataConfig, tokenizer: Tokenizer, *, seed: int, dataset: Any = None) -> list[Prompt]:
    """The prompts of `config`'s source, or of `dataset` (a `datasets.Dataset` the Python API was given; then
    `config.path` is its label, `dataset_label`), tokenised."""
    rows: list[dict[str, Any]] | None = None
    texts: list[PromptInput]
    if config.source == "synthetic":
        texts = list(SyntheticTask(seed=seed).prompts(config.num_prompts))
    elif config.source in ROW_SOURCES:
        task = _row_task(config, seed)
        texts, rows = list(task.prompts(config.num_prompts)), task.rows(config.num_prompts)
    else:
        assert config.path is not None, "validated: data.source=file needs data.path"
        pairs = read_prompt_rows(config.path if dataset is None else dataset, config.prompt_key)
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
        return self.take(self.batch_size)

    def take(self, count: int) -> list[Prompt]:
        """The next `count` prompts (at most the dataset's): the rest of this epoch's permutation, or the next
        epoch's start when fewer than `count` are left (dynamic sampling takes extra prompts this way)."""
        if not 0 < count <= len(self.prompts):
            raise ValueError(
                f"take({count}): a count from 1 to the {len(self.prompts)} prompts of the dataset"
            )
        if self.offset + count > len(self.prompts):
            self.epoch, self.offset = self.epoch + 1, 0
        order = self._order(self.epoch)[self.offset : self.offset + count]
        self.offset += count
        return [self.prompts[i] for i in order]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
