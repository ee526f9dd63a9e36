"""Each iteration's prompts, drawn once and in iteration order (`PromptFeed`), so that a rollout stage generating
ahead of training (asynchronous RL) and the trainer see the same batches, and a checkpoint records the loader's
position after the last trained iteration however far ahead the draws went."""

from __future__ import annotations

from typing import Any

from rlhfuse.core.types import PromptBatch
from rlhfuse.data.collate import collate_prompts
from rlhfuse.data.prompts import PromptLoader


class PromptFeed:
    """Iteration `i`'s prompt batch (`batch(i)`): the loader's next batch when `i` is first asked for, the same
    batch after. `position(i)`: the loader's state as a checkpoint after iteration `i` records it (the state right
    after iteration i's own draws; draws made for later iterations are made again from it by a resumed run)."""

    def __init__(self, loader: PromptLoader, pad_token_id: int) -> None:
        self.loader, self.pad_token_id = loader, pad_token_id
        self.start_at(0)

    def start_at(self, iteration: int) -> None:
        """The next batch drawn is iteration `iteration + 1`'s (a fresh run: 0; a resume: the checkpoint's), from
        the loader's current position."""
        self._batches: dict[int, PromptBatch] = {}
        self._after: dict[int, dict[str, int]] = {iteration: self.loader.state_dict()}
        self._next = iteration + 1

    def batch(self, iteration: int) -> PromptBatch:
        while self._next <= iteration:
            self._batches[self._next] = collate_prompts(self.loader.next_batch(), self.pad_token_id)
            self._after[self._next] = self.loader.state_dict()
            self._next += 1
        if iteration not in self._batches:
            raise KeyError(
                f"PromptFeed.batch({iteration}): that iteration's prompts were released (or precede the start)"
            )
        return self._batches[iteration]

    def drawn(self) -> int:
        """The last iteration whose batch was drawn."""
        return self._next - 1

    def position(self, iteration: int) -> dict[str, Any]:
        """The loader's state to record after iteration `iteration`: its current one when nothing was drawn
        beyond it (extra draws within the iteration included: dynamic sampling's), else the state right after
        that iteration's batch."""
        if self._next == iteration + 1:
            return self.loader.state_dict()
        return dict(self._after[iteration])

    def release(self, iteration: int) -> None:
        """Iteration `iteration` is trained: its batch and the positions before it are dropped."""
        self._batches = {i: b for i, b in self._batches.items() if i > iteration}
        self._after = {i: p for i, p in self._after.items() if i >= iteration}
