"""Long-tailed response (and prompt) length distributions for the generation simulator.

Responses follow a log-normal law capped at the maximum generation length (a capped sample is one the engine
truncated). Default parameters, and where they come from:

- LMSYS-Chat-1M (Zheng et al. 2023, Table 1): mean response 214.5 tokens, mean prompt 69.5 tokens.
- RLHFuse Fig. 2 (LMSYS-Chat-1M output-length CDFs of several models): P99.9 is more than 10x the median.
  A log-normal with sigma = 1.0 has P99.9 / median = exp(3.09) = 22 and mean / median = exp(0.5) = 1.65, so
  median = 214.5 / 1.65 = 130 tokens.
- Prompts: the paper's runs use HH-RLHF prompts, multi-turn dialogue prefixes, longer than LMSYS-Chat-1M's
  single turns. We assume a log-normal with median 128 and sigma 0.6 (mean about 154), capped at 512 tokens:
  an assumption, not a fit.
These are documented defaults; `LengthDistribution.fit` re-fits them from observed lengths (what the runtime
does as iterations run, docs/paper.md §2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal lengths, median `median`, log-space std `sigma`, clipped to [1, cap]."""

    median: float = 130.0
    sigma: float = 1.0

    def sample(self, n: int, cap: int, rng: np.random.Generator) -> NDArray[np.int64]:
        """`n` lengths, stratified (one draw per 1/n quantile band, then shuffled) so that the tail of a
        512-sample batch is represented the same way in every run with the same seed."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        u = (np.arange(n) + rng.random(n)) / n
        z = _norm_ppf(u)
        lengths = np.exp(math.log(self.median) + self.sigma * z)
        out = np.clip(np.ceil(lengths), 1, cap).astype(np.int64)
        rng.shuffle(out)
        return out

    def quantile(self, q: float) -> float:
        return float(math.exp(math.log(self.median) + self.sigma * float(_norm_ppf(np.array([q]))[0])))

    @classmethod
    def fit(cls, lengths: NDArray | list[int]) -> LengthDistribution:
        """Maximum-likelihood log-normal fit (capped samples are treated as observed: a slight under-estimate
        of the tail, which the runtime corrects as it sees more iterations)."""
        x = np.log(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))
        if x.size < 2:
            raise ValueError(f"fit needs at least 2 lengths (got {x.size})")
        return cls(median=float(math.exp(x.mean())), sigma=max(float(x.std(ddof=1)), 1e-3))


RESPONSES = LengthDistribution(median=130.0, sigma=1.0)
PROMPTS = LengthDistribution(median=128.0, sigma=0.6)
PROMPT_CAP = 512


def _norm_ppf(u: NDArray) -> NDArray:
    """Inverse standard normal CDF (Acklam's rational approximation, relative error < 1.2e-9)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)  # fmt: skip
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)  # fmt: skip
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)  # fmt: skip
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    u = np.clip(np.asarray(u, dtype=np.float64), 1e-12, 1 - 1e-12)
    out = np.empty_like(u)
    lo = u < 0.02425
    hi = u > 1 - 0.02425
    mid = ~(lo | hi)
    q = np.sqrt(-2 * np.log(u[lo]))
    out[lo] = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
        (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
    )
    q = np.sqrt(-2 * np.log(1 - u[hi]))
    out[hi] = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
        (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
    )
    q = u[mid] - 0.5
    r = q * q
    out[mid] = (
        (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
        * q
        / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    )
    return out
