"""Prompts to the batch a generator takes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhfuse.core.types import PromptBatch
from rlhfuse.data.prompts import Prompt


def collate_prompts(prompts: Sequence[Prompt], pad_id: int) -> PromptBatch:
    """Left-pad token ids into a PromptBatch."""
    width = max(len(p.token_ids) for p in prompts)
    ids_BP = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask_BP = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        n = len(prompt.token_ids)
        ids_BP[b, width - n :] = torch.tensor(prompt.token_ids)
        mask_BP[b, width - n :] = 1
    return PromptBatch(ids_BP, mask_BP, torch.tensor([p.id for p in prompts]))
