"""Lossless speculative decoding of the tail (docs/paper.md §6): n-gram drafts from a sample's prompt group, verified in
one forward pass of k+1 positions over the engine's KV slots.

Legend: B running samples, K draft tokens per row of one verify step (<= `speculative_tokens`).

- **Drafts** (`GroupIndex`): an n-gram index over the prompt and every response the engine has generated (or is
  generating) for the same prompt group: the sibling samples of one prompt repeat each other's phrases, and
  long responses repeat themselves. A sample's draft is what followed the most recent earlier occurrence of
  its longest suffix (n = `max_ngram` down to 1) in any of the group's sequences, up to k tokens.
- **Verification** (`GenerationEngine._verify`): row b feeds [last token, d_1..d_K] into its slot, the model
  gives K+1 distributions, and position t of the sample is sampled from the verified distribution with the
  sample's own uniform u(s, t) exactly as plain decoding samples it; drafts are accepted while the sampled token
  equals the draft, the first mismatch keeps the sampled token and stops. So the tokens are plain decoding's,
  token for token (up to floating-point ties), not only in distribution. The rejected positions are trimmed
  off the slot, which again holds prompt + tokens[:-1].
- **When** (`SpeculationCosts`): `ngram` verifies whenever some running sample has a draft; `auto` only when
  the predicted tokens per second of a verify step beat a plain decode step's, from costs the engine measures
  as it runs (below). Neither choice changes a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlhfuse.models import MULTI_POSITION_BACKENDS

SpeculativeMode = Literal["off", "ngram", "auto"]
SPECULATIVE_MODES: tuple[str, ...] = ("off", "ngram", "auto")


def speculation_problems(
    mode: str, tokens: int, max_new_tokens: int, attention_backend: str | None = None
) -> list[str]:
    """What is wrong with `generator.speculative=mode generator.speculative_tokens=tokens` (checked by the config
    and again when an engine is built, before any generation)."""
    problems = []
    if mode not in SPECULATIVE_MODES:
        problems.append(f"generator.speculative={mode!r} is unknown: use one of {list(SPECULATIVE_MODES)}")
        return problems
    if mode == "off":
        return problems
    if tokens < 1:
        problems.append(
            f"generator.speculative_tokens={tokens} must be >= 1 with generator.speculative={mode} (draft tokens "
            "verified per step): set it to e.g. 4, or generator.speculative=off"
        )
    elif tokens >= max_new_tokens:
        problems.append(
            f"generator.speculative_tokens={tokens} leaves no slot room: a verify step samples up to "
            f"speculative_tokens+1={tokens + 1} tokens but a response has at most generator.max_new_tokens="
            f"{max_new_tokens}; set generator.speculative_tokens <= {max_new_tokens - 1}"
        )
    if attention_backend is not None and attention_backend not in MULTI_POSITION_BACKENDS:
        problems.append(
            f"generator.speculative={mode} verifies several positions per slot in one cached forward pass, which "
            f"attention_backend={attention_backend!r} cannot do (backends that can: "
            f"{sorted(MULTI_POSITION_BACKENDS)}): use one of them or generator.speculative=off"
        )
    return problems


@dataclass
class GroupIndex:
    """The n-gram index of one prompt group: sequences (the prompt, then prompt + response of each sample seen)
    and, for every n-gram of length 1..max_ngram that has a successor, its latest indexed (sequence, end)
    occurrence. Tokens are only stored as they arrive; n-grams are indexed when a draft is asked for, so an
    engine that does not speculate (auto, at a large batch) pays a list append per token."""

    max_ngram: int
    sequences: list[list[int]] = field(default_factory=list)
    indexed: list[int] = field(
        default_factory=list
    )  # per sequence: successors at positions < this are indexed
    # ngram -> (sequence, end): sequences[sequence][end] is the token that followed it
    latest: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> int:
        """A new sequence, of which only n-grams with a successor at or after `start` will be indexed (a
        sample's prompt is indexed once, as the group's first sequence); returns its id for `extend`."""
        self.sequences.append(list(tokens))
        self.indexed.append(max(start, 1))
        return len(self.sequences) - 1

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        self.sequences[seq].extend(tokens)

    def _catch_up(self) -> None:
        for seq, stored in enumerate(self.sequences):
            for end in range(self.indexed[seq], len(stored)):
                for n in range(1, min(self.max_ngram, end) + 1):
                    self.latest[tuple(stored[end - n : end])] = (seq, end)
            self.indexed[seq] = max(self.indexed[seq], len(stored))

    def draft(self, seq: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `seq`."""
        self._catch_up()
        stored = self.sequences[seq]
        for n in range(min(self.max_ngram, len(stored)), 0, -1):
            hit = self.latest.get(tuple(stored[len(stored) - n :]))
            if hit is not None:
                other, end = hit
                return self.sequences[other][end : end + k]
        return []


class Drafter:
    """Every prompt group's `GroupIndex` on one engine, and which sequence each sample writes."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self.groups: dict[int, GroupIndex] = {}
        self.sample_seq: dict[int, tuple[int, int]] = {}  # row -> (group, sequence)

    def clear(self) -> None:
        self.groups.clear()
        self.sample_seq.clear()

    def track(self, row: int, group: int, prompt: Sequence[int], tokens: Sequence[int]) -> None:
        """Start indexing a sample (admitted fresh, or migrated in with the tokens it already has)."""
        if row in self.sample_seq:
            return
        index = self.groups.get(group)
        if index is None:
            index = self.groups[group] = GroupIndex(self.max_ngram)
            index.add_sequence(prompt)
        self.sample_seq[row] = (group, index.add_sequence([*prompt, *tokens], start=len(prompt)))

    def append(self, row: int, tokens: Sequence[int]) -> None:
        group, seq = self.sample_seq[row]
        self.groups[group].extend(seq, tokens)

    def draft(self, row: int, k: int) -> list[int]:
        if k <= 0:
            return []
        group, seq = self.sample_seq[row]
        return self.groups[group].draft(seq, k)


@dataclass
class LineFit:
    """Least-squares line `seconds = base + slope * rows` kept as running sums (O(1) per step: `auto` decides
    before every decode step, and refitting a window with numpy cost more than it saves on a tiny model)."""

    n: int = 0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    sizes: set[int] = field(default_factory=set)

    def add(self, rows: int, seconds: float) -> None:
        self.n += 1
        self.sum_x += rows
        self.sum_y += seconds
        self.sum_xx += rows * rows
        self.sum_xy += rows * seconds
        if len(self.sizes) < 2:
            self.sizes.add(rows)

    def line(self) -> tuple[float, float] | None:
        """(base, slope), each clipped at 0; None before two distinct batch sizes."""
        if len(self.sizes) < 2:
            return None
        var = self.n * self.sum_xx - self.sum_x**2
        slope = (self.n * self.sum_xy - self.sum_x * self.sum_y) / var
        base = (self.sum_y - slope * self.sum_x) / self.n
        return max(base, 0.0), max(slope, 0.0)


@dataclass
class SpeculationCosts:
    """What `auto` decides from, all measured by the engine as it runs.

    Step seconds are kept per batch-size band (B in [2^j, 2^(j+1)): 1, 2-3, 4-7, ...) as moving averages, for
    plain decode steps and verify steps separately (drafting and acceptance included). At batch B, when both
    are measured for B's band, verify when `verify / tokens_per_row < decode * (1 - margin)` (a plain step makes
    one token per row; `tokens_per_row` is measured over the verify steps, from an optimistic prior so that
    speculation is tried; the margin keeps measurement noise from choosing a verify step that only ties).
    Before a verify step of that band has been measured the first guess prices a forward pass by its
    positions: `a + b B (K+1)` against `a + b B` (the line fitted on the plain steps, None before two batch
    sizes: then no speculation). Both alternatives stay measured: after `explore_every` plain steps in a row
    one verify step is tried anyway (a changed acceptance is noticed), and after `explore_every` verify steps
    in a row one plain step runs (a machine whose load changed is noticed), so auto never keeps a choice the
    other measures better than for more than `explore_every` steps.
    """

    prior_tokens_per_row: float = 2.0
    prior_weight: float = 4.0
    explore_every: int = 64
    smoothing: float = 0.2
    margin: float = 0.05
    decode: LineFit = field(default_factory=LineFit)
    decode_s: dict[int, float] = field(default_factory=dict)
    verify_s: dict[int, float] = field(default_factory=dict)
    rows_verified: int = 0
    tokens_verified: int = 0
    plain_since_verify: int = 0
    verify_since_plain: int = 0

    def _average(self, table: dict[int, float], rows: int, seconds: float) -> None:
        band = rows.bit_length()
        old = table.get(band)
        table[band] = seconds if old is None else old + self.smoothing * (seconds - old)

    def observe_decode(self, rows: int, seconds: float) -> None:
        self.decode.add(rows, seconds)
        self._average(self.decode_s, rows, seconds)
        self.plain_since_verify += 1
        self.verify_since_plain = 0

    def observe_verify(self, rows: int, positions: int, seconds: float, tokens: int) -> None:
        self._average(self.verify_s, rows, seconds)
        self.rows_verified += rows
        self.tokens_verified += tokens
        self.plain_since_verify = 0
        self.verify_since_plain += 1

    @property
    def tokens_per_row(self) -> float:
        return (self.tokens_verified + self.prior_tokens_per_row * self.prior_weight) / (
            self.rows_verified + self.prior_weight
        )

    def pays(self, rows: int, draft_tokens: int) -> bool:
        """Whether a verify step of `rows` x (draft_tokens + 1) positions is predicted to beat a decode step."""
        band = rows.bit_length()
        if band in self.verify_s and band in self.decode_s:
            return self.verify_s[band] / self.tokens_per_row < self.decode_s[band] * (1 - self.margin)
        line = self.decode.line()
        if line is None:
            return False
        a, b = line
        return (a + b * rows * (draft_tokens + 1)) / self.tokens_per_row < a + b * rows

    def decide(self, rows: int, draft_tokens: int) -> bool:
        """`pays`, but an exploring plain step after `explore_every` verify ones, and an exploring verify step
        after `explore_every` plain ones."""
        if self.pays(rows, draft_tokens):
            return self.verify_since_plain < self.explore_every
        return self.decode.n > 0 and self.plain_since_verify >= self.explore_every
