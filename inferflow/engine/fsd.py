"""Frustratingly simple decoding (FSD, Yang et al. 2024): an anti-language model built on the fly
from the sequence's own prefix penalises continuations that repeat it.

Among the top ``k`` tokens of the model, pick ``argmax (1 - alpha) * P_LM(v) - alpha * P_anti(v)``.
P_anti is an n-gram model of the prefix (prompt and output) with backoff: for order ``n`` down to
1, the first order whose context (the last order - 1 tokens) occurred in the prefix gives
``P_anti(v) = discount ** (n - order) * count(context + v) / count(context + *)``; an unseen
context at every order gives 0 (the unigram order always matches once the prefix is non-empty).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import torch


class NGramAntiLM:
    """Counts of every n-gram (orders 1..n) of a growing token sequence, updated incrementally."""

    def __init__(self, n: int, discount: float = 0.5) -> None:
        self.n, self.discount = n, discount
        self.next: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
        self.seen = 0  # tokens of the sequence already counted

    def extend(self, tokens: Sequence[int]) -> None:
        for i in range(self.seen, len(tokens)):
            for order in range(1, self.n + 1):
                if i - order + 1 < 0:
                    break
                ctx = tuple(tokens[i - order + 1 : i])
                self.next[ctx][tokens[i]] += 1
        self.seen = len(tokens)

    def probs(self, tokens: Sequence[int], candidates: torch.Tensor) -> torch.Tensor:
        """P_anti of each candidate token after ``tokens`` (float32, same shape as candidates)."""
        self.extend(tokens)
        for order in range(self.n, 0, -1):
            if order - 1 > len(tokens):
                continue
            ctx = tuple(tokens[len(tokens) - order + 1 :]) if order > 1 else ()
            counts = self.next.get(ctx)
            if counts:
                total = sum(counts.values())
                scale = self.discount ** (self.n - order)
                return torch.tensor(
                    [scale * counts.get(int(c), 0) / total for c in candidates],
                    dtype=torch.float32,
                )
        return torch.zeros(candidates.shape, dtype=torch.float32)


def fsd_choose(
    logits: torch.Tensor, anti: NGramAntiLM, tokens: Sequence[int], alpha: float, k: int
) -> int:
    probs = torch.softmax(logits.float(), dim=-1)
    p, cand = torch.topk(probs, min(k, probs.numel()))
    score = (1 - alpha) * p - alpha * anti.probs(tokens, cand)
    return int(cand[int(torch.argmax(score))])
