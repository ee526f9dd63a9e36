"""A thin wrapper over a `tokenizers.Tokenizer` that knows its special tokens, stop tokens and chat template.

The embedded tasks use a word-level vocabulary built here and saved as a standard `tokenizer.json`, so the same
class also loads the tokenizer of a real Hugging Face checkpoint directory. A directory is read and written the
way `transformers` lays it out:

- `tokenizer.json`: the `tokenizers` model (vocabulary, merges, pre-tokenizer, added tokens);
- `tokenizer_config.json`: the special tokens as text (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and
  the chat template (`chat_template`), overridden by a `chat_template.jinja` file when there is one;
- `generation_config.json`: the stop tokens (`eos_token_id`, an id or a list of ids) and `pad_token_id`.

Special ids come from `config.json` first, then `generation_config.json`, then `tokenizer_config.json`, then the
embedded names (`<pad>`, `<bos>`, `<eos>`). The chat template is rendered with jinja2 the way transformers'
`apply_chat_template` does (a sandboxed environment, `trim_blocks`/`lstrip_blocks`, `messages`,
`add_generation_prompt`, `bos_token`/`eos_token`, `raise_exception`), and the rendered text is encoded without
adding a BOS: the template writes any BOS itself, so none is duplicated.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, pre_tokenizers

from rlhfuse._resources import read_json

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"

Message = Mapping[str, Any]
# tokenizer_config.json keys not copied on export: the template and added tokens are written from this object,
# the others describe how transformers loaded the source, not the tokenizer
_NOT_EXPORTED = ("chat_template", "added_tokens_decoder", "backend", "is_local", "local_files_only")


class ChatTemplateError(ValueError):
    """A chat template does not compile or fails to render; the message names the file and the prompt."""


class Tokenizer:
    """Text <-> token ids, with `pad_id`, `bos_id`, `eos_id`, the stop ids and the chat template resolved once."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        pad_id: int,
        bos_id: int | None,
        eos_id: int,
        extra_stop_ids: Iterable[int] = (),
        chat_template: str | None = None,
        template_source: str | None = None,
        hf_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.eos_id = eos_id
        # every id that ends a response: the EOS first, then the others of generation_config.json's eos list
        self.stop_ids: tuple[int, ...] = (eos_id, *sorted(set(extra_stop_ids) - {eos_id}))
        self.chat_template = chat_template
        # where the template came from (a file, or file:key), for error messages
        self.template_source = template_source or "the chat template"
        # the source tokenizer_config.json, kept so that a re-export keeps its other keys
        self.hf_config: dict[str, Any] = dict(hf_config or {})
        self._compiled: Any = None

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special))

    def token_to_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def id_to_token(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        found = self.backend.id_to_token(token_id)
        return None if found is None else str(found)

    # ------------------------------------------------------------------------------------------ chat template
    def _template(self) -> Any:
        if self._compiled is None:
            assert self.chat_template is not None, "no chat template"
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise jinja2.TemplateError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as err:
                raise ChatTemplateError(
                    f"{self.template_source}: the chat template does not compile ({err.message}, template line "
                    f"{err.lineno}): fix it, or set data.chat_template=none to feed prompts as plain text"
                ) from None
        return self._compiled

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to `messages` (each {"role", "content"}), ending with the assistant's
        generation prompt; `tools`: JSON schemas offered to the model (the template's `tools` variable, as
        transformers' `apply_chat_template(tools=...)` passes them; None: no tools). ChatTemplateError names the
        template's file when it fails."""
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        template = self._template()
        try:
            return str(
                template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    tools=[dict(t) for t in tools] if tools else None,
                    bos_token=self.id_to_token(self.bos_id) or "",
                    eos_token=self.id_to_token(self.eos_id) or "",
                    pad_token=self.id_to_token(self.pad_id) or "",
                )
            )
        except Exception as err:  # jinja2 raises TemplateError, a template's own code anything
            raise ChatTemplateError(
                f"{self.template_source}: the chat template fails to render ({type(err).__name__}: {err}): fix "
                "the template or the messages, or set data.chat_template=none to feed prompts as plain text"
            ) from None

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat, without an added BOS (the template writes it if the model wants one)."""
        return self.encode(
            self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools),
            add_bos=False,
        )

    # ------------------------------------------------------------------------------------------ files
    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` and `tokenizer_config.json` (special tokens, chat template) into `directory`,
        as transformers' AutoTokenizer reads them; returns the tokenizer.json path."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path))
        config: dict[str, Any] = {
            "clean_up_tokenization_spaces": False,
            **{k: v for k, v in self.hf_config.items() if k not in _NOT_EXPORTED},
        }
        if config.get("tokenizer_class") in (None, "TokenizersBackend"):
            # the class every transformers version loads a bare tokenizer.json with (5.x's TokenizersBackend is
            # the same thing under a name 4.x does not know)
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
        for key, token_id in (
            ("bos_token", self.bos_id),
            ("eos_token", self.eos_id),
            ("pad_token", self.pad_id),
        ):
            token = self.id_to_token(token_id)
            if token is not None:
                config[key] = token
            else:
                config.pop(key, None)
        if "unk_token" not in config and self.token_to_id(UNK) is not None:
            config["unk_token"] = UNK
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        stale = directory / TEMPLATE_FILE  # the template now lives in tokenizer_config.json
        if stale.is_file():
            stale.unlink()
        return path

    def save_generation_config(self, directory: str | Path) -> Path:
        """Write `generation_config.json`: the stop tokens (`eos_token_id`, a list when there are several),
        `pad_token_id` and `bos_token_id`, as transformers' GenerationConfig reads them."""
        path = Path(directory) / GENERATION_CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        eos: int | list[int] = self.stop_ids[0] if len(self.stop_ids) == 1 else list(self.stop_ids)
        config = {"bos_token_id": self.bos_id, "eos_token_id": eos, "pad_token_id": self.pad_id}
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_words(cls, words: Iterable[str], *, chat_template: str | None = None) -> Tokenizer:
        """A word-level tokenizer over `words` (whitespace-split), special tokens first: pad=0 bos=1 eos=2 unk=3.
        Without `chat_template` (most embedded tasks) prompts are fed as plain text."""
        vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for word in words:
            if word in vocab:
                raise ValueError(f"duplicate word {word!r} in the vocabulary")
            vocab[word] = len(vocab)
        backend = _HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
        backend.add_special_tokens(list(SPECIAL_TOKENS))
        return cls(
            backend,
            pad_id=vocab[PAD],
            bos_id=vocab[BOS],
            eos_id=vocab[EOS],
            chat_template=chat_template,
            template_source="the embedded task's tokenizer",
        )

    @classmethod
    def from_dir(cls, directory: str | Path, *, model_dir: str | Path | None = None) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) from `directory`; the special
        and stop ids from `config.json` / `generation_config.json` of `model_dir` (default `directory`)."""
        directory = Path(directory)
        model_dir = directory if model_dir is None else Path(model_dir)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {directory}: rlhfuse loads tokenizers in the `tokenizers` JSON format "
                "(save one with `tokenizer.save_pretrained(dir)` from transformers, or set model.tokenizer_path)"
            )
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(
                f"{path} is not a readable tokenizer file ({str(err).splitlines()[0][:200]}): re-save it with "
                "`tokenizer.save_pretrained(dir)`, or point model.tokenizer_path at a complete one"
            ) from None
        model_config = _json_object(model_dir / "config.json")
        generation = _json_object(model_dir / GENERATION_CONFIG)
        tok_config = _json_object(directory / TOKENIZER_CONFIG)
        ids: dict[str, int | None] = {"pad": None, "bos": None, "eos": None}
        for key in ids:
            for found in (model_config, generation):
                value = _first_id(found.get(f"{key}_token_id"))
                if ids[key] is None and value is not None:
                    ids[key] = value
            token = _token_text(tok_config.get(f"{key}_token"))
            if ids[key] is None and token is not None:
                ids[key] = backend.token_to_id(token)
        for key, token in (("pad", PAD), ("bos", BOS), ("eos", EOS)):
            if ids[key] is None:
                ids[key] = backend.token_to_id(token)
        if ids["eos"] is None:
            raise ValueError(
                f"cannot tell the end-of-sequence token of {directory}: set eos_token_id in its config.json "
                f"or {GENERATION_CONFIG}"
            )
        eos = int(ids["eos"])
        pad = int(ids["pad"]) if ids["pad"] is not None else eos
        stops = generation.get("eos_token_id")
        extra_stops = [s for s in (stops if isinstance(stops, list) else [stops]) if isinstance(s, int)]
        vocab = int(backend.get_vocab_size(with_added_tokens=True))
        bad = [s for s in extra_stops if not 0 <= s < vocab]
        if bad:
            raise ValueError(
                f"{model_dir / GENERATION_CONFIG}: eos_token_id {bad} outside the vocabulary of {path} "
                f"({vocab} tokens): fix the file or delete it"
            )
        template, source = _chat_template(directory, tok_config)
        return cls(
            backend,
            pad_id=pad,
            bos_id=ids["bos"],
            eos_id=eos,
            extra_stop_ids=extra_stops,
            chat_template=template,
            template_source=source,
            hf_config=tok_config,
        )


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when the file does not exist."""
    if not path.is_file():
        return {}
    value = read_json(path, ValueError)
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a JSON object: fix it")
    return value


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):  # some HF configs list several eos ids; the first is the main one
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, tok_config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(template, where it came from): chat_template.jinja first (as transformers), then tokenizer_config.json's
    `chat_template` (a string, or a list of {"name", "template"} of which "default" is taken)."""
    file = directory / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8"), str(file)
    value = tok_config.get("chat_template")
    where = f"{directory / TOKENIZER_CONFIG} (key chat_template)"
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is None:
        return None, None
    if not isinstance(value, str):
        raise ChatTemplateError(f"{where}: chat_template must be a string, got {type(value).__name__}")
    return value, where
