"""A thin wrapper over a `tokenizers.Tokenizer` that knows its special-token ids.

The embedded default task uses a word-level vocabulary built here and saved as a standard `tokenizer.json`, so
the same class also loads the tokenizer of a real Hugging Face checkpoint directory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, pre_tokenizers

from rlhfuse._resources import read_json

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


class Tokenizer:
    """Text <-> token ids, with `pad_id`, `bos_id` and `eos_id` resolved once."""

    def __init__(self, backend: _HFTokenizer, *, pad_id: int, bos_id: int | None, eos_id: int) -> None:
        self.backend = backend
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.eos_id = eos_id

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

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` (the `tokenizers` format Hugging Face checkpoints use) into `directory`."""
        path = Path(directory) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path))
        return path

    @classmethod
    def from_words(cls, words: Iterable[str]) -> Tokenizer:
        """A word-level tokenizer over `words` (whitespace-split), special tokens first: pad=0 bos=1 eos=2 unk=3."""
        vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for word in words:
            if word in vocab:
                raise ValueError(f"duplicate word {word!r} in the vocabulary")
            vocab[word] = len(vocab)
        backend = _HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
        backend.add_special_tokens(list(SPECIAL_TOKENS))
        return cls(backend, pad_id=vocab[PAD], bos_id=vocab[BOS], eos_id=vocab[EOS])

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load `tokenizer.json` from a checkpoint directory; special ids from its `config.json` when present."""
        directory = Path(directory)
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
        ids: dict[str, int | None] = {"pad": None, "bos": None, "eos": None}
        config_path = directory / "config.json"
        if config_path.is_file():
            config = read_json(config_path, ValueError)
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} holds a {type(config).__name__}, not a JSON object: fix it")
            for key in ids:
                value = config.get(f"{key}_token_id")
                if isinstance(value, list):  # some HF configs list several eos ids
                    value = value[0] if value else None
                ids[key] = value if isinstance(value, int) else None
        for key, token in (("pad", PAD), ("bos", BOS), ("eos", EOS)):
            if ids[key] is None:
                ids[key] = backend.token_to_id(token)
        if ids["eos"] is None:
            raise ValueError(
                f"cannot tell the end-of-sequence token of {directory}: set eos_token_id in its config.json"
            )
        eos = int(ids["eos"])
        pad = int(ids["pad"]) if ids["pad"] is not None else eos
        return cls(backend, pad_id=pad, bos_id=ids["bos"], eos_id=eos)
