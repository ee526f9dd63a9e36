"""Prompt data, tokenizers and the embedded default task (`rlhfuse.data.synthetic`)."""

from rlhfuse.data.config import DataConfig
from rlhfuse.data.prompts import (
    DatasetError,
    Prompt,
    PromptLoader,
    load_prompts,
    read_prompt_file,
    tokenize_prompts,
)
from rlhfuse.data.synthetic import SyntheticTask, topic_fraction
from rlhfuse.data.tokenizer import Tokenizer

__all__ = [
    "DataConfig",
    "DatasetError",
    "Prompt",
    "PromptLoader",
    "SyntheticTask",
    "Tokenizer",
    "load_prompts",
    "read_prompt_file",
    "tokenize_prompts",
    "topic_fraction",
]
