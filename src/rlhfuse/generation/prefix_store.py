"""Finished samples' KV caches, kept for a later prompt that continues one (`generator.prefix_cache`).

A multi-turn episode's next turn is a new request whose prompt is the previous turn's prompt, its sampled tokens
and the answer's tokens (`rlhfuse.agents`). The engine keeps a finished sample's slot state (prompt + tokens[:-1],
what its cache holds: the last token was never fed) under those token ids; when a waiting request's prompt starts
with a kept sequence, the engine imports that state and prefills only the rest (`GenerationEngine`). One store is
shared by a pool's engines, so that it outlives an engine rebuilt for longer prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from rlhfuse.models.cache import SlotState


class PrefixStore:
    """At most `capacity` kept states, the oldest dropped first; each is taken (removed) by the first prompt that
    continues it. `hits` / `reused_tokens`: prompts that continued a kept state, and the positions they did not
    prefill."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(
                f"generator.prefix_cache={capacity}: keep at least one state (0 turns the store off)"
            )
        self.capacity = capacity
        self.entries: OrderedDict[tuple[int, ...], list[SlotState]] = OrderedDict()
        self.size = 0  # states kept
        self.hits = self.reused_tokens = 0

    def put(self, ids: Sequence[int], state: SlotState) -> None:
        """Keep `state`, the KV of the token ids `ids` (its positions that hold no token, a batch's left padding,
        dropped: the keys carry their rotary positions, so the rest attend as before). Samples with the same ids
        (a group's greedy samples) keep one state each."""
        key = tuple(ids)
        real_T = state.valid_T.nonzero().squeeze(1)
        if len(real_T) != len(key):
            raise ValueError(f"a kept state of {len(real_T)} positions for {len(key)} token ids")
        kept = SlotState(
            k_LHTD=state.k_LHTD[:, :, real_T],
            v_LHTD=state.v_LHTD[:, :, real_T],
            valid_T=state.valid_T[real_T],
        )
        self.entries.setdefault(key, []).append(kept)
        self.entries.move_to_end(key)
        self.size += 1
        while self.size > self.capacity:
            oldest = next(iter(self.entries))
            self._pop(oldest)

    def _pop(self, key: tuple[int, ...]) -> SlotState:
        states = self.entries[key]
        state = states.pop(0)
        if not states:
            del self.entries[key]
        self.size -= 1
        return state

    def clear(self) -> None:
        """Drop every kept state (the weights that computed them were replaced)."""
        self.entries.clear()
        self.size = 0

    def take(self, prompt: Sequence[int]) -> tuple[int, SlotState] | None:
        """The longest kept sequence that `prompt` strictly continues (at least one token left to prefill): its
        length and state, removed from the store; None when there is none."""
        best: tuple[int, ...] | None = None
        for key in self.entries:
            n = len(key)
            if n < len(prompt) and (best is None or n > len(best)) and tuple(prompt[:n]) == key:
                best = key
        if best is None:
            return None
        self.hits += 1
        self.reused_tokens += len(best)
        return len(best), self._pop(best)
