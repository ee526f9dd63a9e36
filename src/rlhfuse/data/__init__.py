"""Prompt data, tokenizers and the embedded tasks (`rlhfuse.data.synthetic`, `rlhfuse.data.arithmetic`)."""

from rlhfuse.data.arithmetic import ArithmeticTask
from rlhfuse.data.data_config import DataConfig
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

__all__ = [
    "ArithmeticTask",
    "DataConfig",
    "DatasetError",
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
