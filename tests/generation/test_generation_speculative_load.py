"""generator.speculative=auto on a loaded machine: rlhfuse's engine decodes beside a busy loop on each core, on
two workloads, one whose drafts are accepted (a peaky model repeats itself, as a warm one does) and one whose
are not (a flat model samples freely, so a draft rarely matches). On both the tokens equal speculative=off's.
auto verifies where the drafts pay under this load and falls back to plain decoding where they do not: on the
repeating workload most of its choices verify and a verify row yields well over one token; on the free one its
measured tokens per verify row fall to about one, and past its first tries it decodes plainly but for the
exploring verify step after every `explore_every` plain ones. Each choice is the one its measurements at that
moment gave (`SpeculationCosts.pays`, recorded as it decided). The timings are the machine's: nothing here
compares seconds with a bound."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
from rlhfuse.generation.speculative import SpeculationCosts
from rlhfuse.models import ModelConfig, Transformer

EOS, MAX_NEW, VOCAB, EXPLORE = 2, 40, 24, 16


@dataclass
class RecordingCosts(SpeculationCosts):
    """auto's cost model, recording each choice: whether verifying was priced cheaper, whether it verified, how
    many plain / verify steps in a row preceded it, and the rows of the step."""

    choices: list[tuple[bool, bool, int, int, int]] = field(default_factory=list)

    def decide(self, rows: int, draft_tokens: int) -> bool:
        pays = self.pays(rows, draft_tokens)
        runs = (self.plain_since_verify, self.verify_since_plain)
        verify = super().decide(rows, draft_tokens)
        self.choices.append((pays, verify, *runs, rows))
        return verify


def _model(hidden: int, sharpen: float) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_heads=4, num_kv_heads=2
    )
    model = Transformer(config, head="lm").double().eval()  # float64: a verify step samples as plain decoding
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def _prompts() -> PromptBatch:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (4, 6), generator=g)
    return PromptBatch(ids, torch.ones_like(ids), torch.arange(4))


def _decode(
    model: Transformer, mode: str, temperature: float, slots: int, costs: SpeculationCosts | None = None
) -> list[list[int]]:
    """Every sample's tokens over 5 batches of 4 prompts x 4 samples on one engine of `slots` slots (its costs
    kept from batch to batch, as across a run's iterations)."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, stop_token_ids=(EOS,))
    engine = GenerationEngine(
        model, params, num_slots=slots, max_len=6 + MAX_NEW, speculative=mode, speculative_tokens=3
    )
    if costs is not None:
        engine.costs = costs
    tokens = []
    for iteration in range(5):
        engine.add(requests_for(_prompts(), samples_per_prompt=4, seed=1, iteration=iteration))
        done = []
        while engine.has_work():
            done += engine.step()
        tokens += [r.tokens for r in sorted(done, key=lambda r: r.row)]
    return tokens


@pytest.mark.timeout(600)
def test_speculative_auto_verifies_where_drafts_pay_and_falls_back_where_not_beside_busy_loops() -> None:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        runs = {}
        # greedy on a small peaky model at 8 rows, whose steps cost about the same for 1 or k + 1 positions: a
        # prompt's samples repeat each other and drafts are accepted; sampled from a wider flat model at 16 rows,
        # whose verify steps cost several plain ones (long enough steps that the loops' time slices do not
        # decide them): they are not
        workloads = (("repeating", 32, 40.0, 0.0, 8), ("free", 512, 1.0, 1.0, 16))
        for name, hidden, sharpen, temperature, slots in workloads:
            model = _model(hidden, sharpen)
            costs = RecordingCosts(explore_every=EXPLORE, smoothing=0.1)  # a longer memory than the default
            runs[name] = (
                _decode(model, "off", temperature, slots),
                _decode(model, "auto", temperature, slots, costs),
                costs,
            )
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    for name, (off, auto, costs) in runs.items():
        verified, priced = sum(c[1] for c in costs.choices), sum(c[0] for c in costs.choices)
        full = [c for c in costs.choices if c[4] >= 8]
        print(f"{name}: {len(costs.choices)} choices, {verified} verified ({priced} priced cheaper); at 8+ rows "
              f"{len(full)}, {sum(c[1] for c in full)} verified; tokens per "
              f"verify row {costs.tokens_per_row:.2f}, seconds per step by batch band: verify {costs.verify_s}, "
              f"plain {costs.decode_s}")  # fmt: skip
        assert auto == off, f"{name}: speculation changed a token"
        assert len(costs.choices) > 4 * EXPLORE, (name, len(costs.choices))
        for pays, verify, plain_run, verify_run, _ in costs.choices:
            # a choice against what was measured is only the exploring step after EXPLORE of the other kind
            assert verify == pays or (plain_run if verify else verify_run) >= EXPLORE, (name, costs.choices)
    repeating, free = runs["repeating"][2], runs["free"][2]
    verified = sum(c[1] for c in repeating.choices)
    assert repeating.tokens_per_row > 1.5 and verified > 0.4 * len(repeating.choices), (
        repeating.tokens_per_row, verified, len(repeating.choices),
    )  # fmt: skip
    # the free workload: a verify row yields about one token, so verifying (k + 1 positions) is priced dearer
    # than a plain step and auto decodes plainly, past its first tries (made while the optimistic prior of
    # tokens per row still weighed) and at full batches (8-16 rows: steps of several milliseconds; the batch's
    # last few rows make steps short enough for a time slice of the loops to decide one either way)
    assert free.tokens_per_row < 1.3, free.tokens_per_row
    late = [c for c in free.choices[2 * EXPLORE :] if c[4] >= 8]
    assert len(late) > 2 * EXPLORE, len(late)
    assert sum(c[0] for c in late) <= len(late) / 10, late
    assert sum(c[1] for c in late) <= len(late) / EXPLORE + len(late) / 10, late
