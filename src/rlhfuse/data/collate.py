"""Prompts to the batch a generator takes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhfuse.core.types import PromptBatch
from rlhfuse.data.prompts import Prompt


def collate_prompts(prompts: Sequence[Prompt], pad_id: int) -> PromptBatch:
    """Left-pad token ids into a PromptBatch."""
    return left_padded([p.token_ids for p in prompts], [p.id for p in prompts], pad_id)


def left_padded(token_ids: Sequence[Sequence[int]], ids: Sequence[int], pad_id: int) -> PromptBatch:
    """Token id lists left-padded into a PromptBatch whose prompts have the ids `ids`."""
    width = max(len(t) for t in token_ids)
    ids_BP = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    mask_BP = torch.zeros((len(token_ids), width), dtype=torch.long)
    for b, tokens in enumerate(token_ids):
        n = len(tokens)
        ids_BP[b, width - n :] = torch.tensor(tokens, dtype=torch.long)
        mask_BP[b, width - n :] = 1
    return PromptBatch(ids_BP, mask_BP, torch.tensor(list(ids)))
