"""Prompt data, tokenizers and the embedded tasks (`rlhfuse.data.synthetic`, `rlhfuse.data.arithmetic`,
`rlhfuse.data.guessing`)."""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.data.arithmetic import ArithmeticTask, CalculatorTask
    from rlhfuse.data.data_config import DataConfig
    from rlhfuse.data.guessing import GuessingTask
    from rlhfuse.data.prompts import (
        DatasetError,
        Prompt,
        PromptLoader,
        load_prompts,
        read_prompt_file,
        read_prompt_rows,
        tokenize_prompts,
    )
    from rlhfuse.data.synthetic import SyntheticTask, topic_fraction
    from rlhfuse.data.tokenizer import Tokenizer

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (`rlhfuse-train --help` reads the configs without torch).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.data.arithmetic": ("ArithmeticTask", "CalculatorTask"),
    "rlhfuse.data.data_config": ("DataConfig",),
    "rlhfuse.data.guessing": ("GuessingTask",),
    "rlhfuse.data.prompts": (
        "DatasetError",
        "Prompt",
        "PromptLoader",
        "load_prompts",
        "read_prompt_file",
        "read_prompt_rows",
        "tokenize_prompts",
    ),
    "rlhfuse.data.synthetic": ("SyntheticTask", "topic_fraction"),
    "rlhfuse.data.tokenizer": ("Tokenizer",),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "ArithmeticTask",
    "CalculatorTask",
    "DataConfig",
    "DatasetError",
    "GuessingTask",
    "Prompt",
    "PromptLoader",
    "SyntheticTask",
    "Tokenizer",
    "load_prompts",
    "read_prompt_file",
    "read_prompt_rows",
    "tokenize_prompts",
    "topic_fraction",
]
