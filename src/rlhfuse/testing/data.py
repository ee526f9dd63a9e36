"""Random, valid batches for tests and device checks: left-padded prompts, right-padded responses of varied
lengths (the shapes every execution path sees), from a seeded generator.

Legend: B batch rows, P prompt tokens, R response tokens, T = P + R.
"""

from __future__ import annotations

import dataclasses

import torch

from rlhfuse.core.types import Rollout, TrainBatch


def random_batch(
    samples: int,
    *,
    vocab: int = 128,
    prompt: int = 5,
    response: int = 7,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> TrainBatch:
    """A TrainBatch with left-padded prompts (at least 2 tokens) and right-padded responses (at least 1)."""
    g = torch.Generator().manual_seed(seed)
    t = prompt + response
    ids = torch.randint(1, vocab, (samples, t), generator=g)
    mask = torch.ones(samples, t, dtype=torch.long)
    resp = torch.zeros(samples, response, dtype=dtype)
    for b in range(samples):
        p_len = int(torch.randint(2, prompt + 1, (1,), generator=g))
        r_len = int(torch.randint(1, response + 1, (1,), generator=g))
        mask[b, : prompt - p_len] = 0
        mask[b, prompt + r_len :] = 0
        ids[b, mask[b] == 0] = 0
        resp[b, :r_len] = 1
    rand = lambda: torch.randn(samples, response, generator=g, dtype=dtype)  # noqa: E731
    return TrainBatch(ids, mask, resp, -1.0 + 0.1 * rand(), 0.3 * rand(), rand(), rand())


def random_rollout(n: int, *, vocab: int = 128, prompt: int = 5, response: int = 7, seed: int = 0) -> Rollout:
    """A Rollout of n rows: left-padded prompts (at least 1 token), right-padded responses, ~70% finished."""
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(1, vocab, (n, prompt), generator=g)
    r_ids = torch.randint(1, vocab, (n, response), generator=g)
    p_mask = torch.ones(n, prompt, dtype=torch.long)
    r_mask = torch.zeros(n, response, dtype=torch.long)
    for b in range(n):
        p_len = int(torch.randint(1, prompt + 1, (1,), generator=g))
        r_len = int(torch.randint(1, response + 1, (1,), generator=g))
        p_mask[b, : prompt - p_len] = 0
        p_ids[b, : prompt - p_len] = 0
        r_mask[b, :r_len] = 1
        r_ids[b, r_len:] = 0
    finished = torch.rand(n, generator=g) < 0.7
    return Rollout(p_ids, p_mask, r_ids, r_mask, torch.arange(n), torch.zeros(n, dtype=torch.long), finished)


def two_row_rollout(pad: int = 0) -> Rollout:
    """A hand-made Rollout on the CPU, as a generator returns it: row 0 prompt [pad, 5, 6] with the finished
    response [7, 2]; row 1 prompt [8, 9, 10] with the response [11, 12, 13] cut at the length limit."""
    return Rollout(
        prompt_ids_BP=torch.tensor([[pad, 5, 6], [8, 9, 10]]),
        prompt_mask_BP=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids_BR=torch.tensor([[7, 2, pad], [11, 12, 13]]),
        response_mask_BR=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        prompt_index_B=torch.tensor([0, 1]),
        sample_index_B=torch.tensor([0, 0]),
        finished_B=torch.tensor([True, False]),
    )


def assert_same_rollout(
    got: Rollout, want: Rollout, *, logprob_atol: float = 1e-5, label: object = ""
) -> None:
    """`got` holds `want`'s samples: every token, mask and index field equal, the sampler's log-probs within
    `logprob_atol` (their last bits depend on the batch a sample was decoded in; 0 = bit for bit) or both
    absent."""
    a, b = got.sampler_logprobs_BR, want.sampler_logprobs_BR
    assert (a is None) == (b is None), (label, "sampler_logprobs_BR", a, b)
    if a is not None and b is not None:
        torch.testing.assert_close(a, b, atol=logprob_atol, rtol=0, msg=f"{label} sampler_logprobs_BR")
    rest = [dataclasses.replace(r, sampler_logprobs_BR=None) for r in (got, want)]
    for f in dataclasses.fields(Rollout):
        x, y = (getattr(r, f.name) for r in rest)
        assert (x is None and y is None) or torch.equal(x, y), (label, f.name)
