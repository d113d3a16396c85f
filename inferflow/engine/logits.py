"""Logits processors and truncation filters: small composable functions built once per request.

A processor maps float32 logits (V,) and the sequence so far to new logits; a filter masks
tokens to -inf. Definitions follow the references users compare against:

- repetition penalty (CTRL, as transformers): over prompt and output tokens, a positive logit is
  divided by r, a negative one multiplied by r;
- presence / frequency penalty (OpenAI, as vLLM): over output tokens, ``logit -= presence *
  [count > 0] + frequency * count``;
- top-k, top-p (nucleus), min-p (keep p >= min_p * p_max), typical (Meister et al.: keep the
  tokens whose surprise is closest to the entropy, smallest set reaching mass typical_p) and
  tail-free (TFS, z: cut where the normalised |2nd derivative| of the sorted probabilities sums
  past z, as llama.cpp). Every filter keeps at least the most likely token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Processor = Callable[[torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor]
NEG_INF = float("-inf")


def repetition_penalty(r: float) -> Processor:
    def apply(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
        seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long)
        if seen.numel() == 0:
            return logits
        x = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(x > 0, x / r, x * r)
        return logits

    return apply


def presence_frequency_penalty(presence: float, frequency: float) -> Processor:
    def apply(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
        if not output:
            return logits
        counts = torch.bincount(torch.tensor(list(output)), minlength=logits.shape[-1]).float()
        return logits - presence * (counts > 0).float() - frequency * counts

    return apply


def logit_bias(bias: dict[int, float]) -> Processor:
    ids = torch.tensor(list(bias), dtype=torch.long)
    vals = torch.tensor(list(bias.values()), dtype=torch.float32)

    def apply(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
        logits = logits.clone()
        logits[ids] += vals
        return logits

    return apply


def ban_until(banned: Sequence[int], min_new: int) -> Processor:
    """End tokens are masked until ``min_new`` tokens were generated."""
    ids = torch.tensor(sorted(set(banned)), dtype=torch.long)

    def apply(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
        if len(output) >= min_new or ids.numel() == 0:
            return logits
        return logits.index_fill(0, ids, NEG_INF)

    return apply


# --- truncation filters (on logits already divided by the temperature) ------------------------


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


def _sorted_probs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # stable: tied logits stay in id order, as inferflow.engine.batch_sampling orders them
    s, idx = torch.sort(logits, descending=True, stable=True)
    return torch.softmax(s, dim=-1), idx


def _keep_sorted(
    logits: torch.Tensor, idx: torch.Tensor, drop_sorted: torch.Tensor
) -> torch.Tensor:
    """Mask the tokens ``idx[drop_sorted]``; the first in ``idx`` order always stays."""
    drop_sorted[0] = False
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted), NEG_INF)


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    probs, idx = _sorted_probs(logits)
    # drop a token when the mass before it already reaches p
    return _keep_sorted(logits, idx, (probs.cumsum(-1) - probs) >= p)


def min_p(logits: torch.Tensor, m: float) -> torch.Tensor:
    if m <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < m * probs.max(), NEG_INF)


def typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    if mass >= 1.0:
        return logits
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -(p * torch.nan_to_num(logp, neginf=0.0)).sum()
    shift = (-logp - entropy).abs()  # distance of each token's surprise from the entropy
    order = torch.argsort(shift)
    ps = p[order]
    return _keep_sorted(logits, order, (ps.cumsum(-1) - ps) >= mass)


def tail_free(logits: torch.Tensor, z: float) -> torch.Tensor:
    if z >= 1.0 or logits.shape[-1] < 3:
        return logits
    probs, idx = _sorted_probs(logits)
    d2 = (probs[:-1] - probs[1:])[:-1] - (probs[:-1] - probs[1:])[1:]  # (V - 2,)
    d2 = d2.abs()
    total = d2.sum()
    if total <= 0:
        return logits
    cum = (d2 / total).cumsum(-1)
    past = (cum > z).nonzero()
    keep = int(past[0]) if past.numel() else probs.numel()  # llama.cpp's last_idx
    drop = torch.arange(probs.numel()) >= max(keep, 1)
    return _keep_sorted(logits, idx, drop)
