"""Bradley-Terry strengths from (soft) pairwise wins: pure float64 math.

Not from a library: `choix` (the maintained implementation on PyPI) needs scipy, which this
project does not otherwise depend on, and the MM iterations are a few lines (Hunter 2004).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_PRIOR = 0.1
"""Pseudo-wins added each way to every compared pair, so a pair one item always wins keeps
finite strengths (the maximum-likelihood estimate would diverge)."""


def bradley_terry(
    wins: Sequence[Sequence[float]],
    *,
    prior: float = DEFAULT_PRIOR,
    max_iterations: int = 1000,
    tolerance: float = 1e-10,
) -> list[float]:
    """Strengths `s` (geometric mean 1) maximising prod (s_i / (s_i + s_j)) ** wins[i][j].

    `wins[i][j]` >= 0 is how often i beat j (soft counts allowed); pairs with
    wins[i][j] + wins[j][i] == 0 were not compared and get no prior. Uses Hunter's MM update
    s_i <- W_i / sum_j n_ij / (s_i + s_j) until the largest relative change is below `tolerance`.
    """
    n = len(wins)
    if any(len(row) != n for row in wins):
        raise ValueError("wins must be a square matrix")
    if any(w < 0 or not math.isfinite(w) for row in wins for w in row):
        raise ValueError("wins must be finite and >= 0")
    if prior < 0:
        raise ValueError(f"prior must be >= 0, got {prior}")
    w = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j and wins[i][j] + wins[j][i] > 0:
                w[i][j] = float(wins[i][j]) + prior
    for i in range(n):
        if n > 1 and sum(w[i]) == 0:
            raise ValueError(f"item {i} won nothing and has no prior: its strength would be 0")
    s = [1.0] * n
    for _ in range(max_iterations):
        new = [
            sum(w[i]) / sum((w[i][j] + w[j][i]) / (s[i] + s[j]) for j in range(n) if w[i][j] + w[j][i])
            if n > 1
            else 1.0
            for i in range(n)
        ]
        log_mean = sum(math.log(x) for x in new) / n
        new = [x / math.exp(log_mean) for x in new]
        change = max(abs(a - b) / b for a, b in zip(new, s, strict=True))
        s = new
        if change < tolerance:
            break
    return s


def win_probabilities(strengths: Sequence[float]) -> list[float]:
    """Each item's mean Bradley-Terry probability of beating each other item (0.5 for one item)."""
    n = len(strengths)
    if n < 2:
        return [0.5] * n
    return [
        sum(strengths[i] / (strengths[i] + strengths[j]) for j in range(n) if j != i) / (n - 1)
        for i in range(n)
    ]


__all__ = ["DEFAULT_PRIOR", "bradley_terry", "win_probabilities"]
