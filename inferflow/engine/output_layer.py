"""The output layer of a beam search: each row's k best next tokens with their log-probabilities.

``fused_topk`` follows Amun (Junczys-Dowmunt et al., 2016): the head's logits are produced in
vocabulary chunks; one pass keeps a running max and sum of exponentials (the log-softmax
normaliser, online) and a running top-k, so neither the full logits nor a softmax are ever
materialised. ``naive_topk`` is the textbook path (full logits, log_softmax, topk) it is
benchmarked against (benchmarks/beam.py). Banned tokens (end tokens below the minimum length,
repeated n-grams) are left out of the candidates but still count in the normaliser, as when a
logits processor masks log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

CHUNK = 8192  # vocabulary rows per chunk


def _ban_index(banned: Sequence[Sequence[int]] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not banned or not any(banned):
        return None
    rows = [r for r, toks in enumerate(banned) for _ in toks]
    cols = [t for toks in banned for t in toks]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


@torch.inference_mode()
def fused_topk(
    h: torch.Tensor,  # (R, hidden)
    weight: torch.Tensor,  # (V, hidden)
    bias: torch.Tensor | None,
    k: int,
    banned: Sequence[Sequence[int]] | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, token ids), each (R, k), best first."""
    R, V = h.shape[0], weight.shape[0]
    norm = torch.full((R, 1), float("-inf"))  # running log-sum-exp: the normaliser so far
    best_v = torch.empty((R, 0))
    best_i = torch.empty((R, 0), dtype=torch.long)
    bans = _ban_index(banned)
    for start in range(0, V, chunk):
        end = min(start + chunk, V)
        logits = torch.nn.functional.linear(
            h, weight[start:end], None if bias is None else bias[start:end]
        ).float()
        norm = torch.logaddexp(norm, torch.logsumexp(logits, dim=1, keepdim=True))
        if bans is not None:
            here = (bans[1] >= start) & (bans[1] < end)
            if bool(here.any()):
                logits = logits.index_put(
                    (bans[0][here], bans[1][here] - start), torch.tensor(float("-inf"))
                )
        v, i = logits.topk(min(k, end - start), dim=1)
        if best_v.shape[1]:
            v, pick = torch.cat((best_v, v), dim=1).topk(k, dim=1)
            i = torch.cat((best_i, i + start), dim=1).gather(1, pick)
        best_v, best_i = v, i
    return best_v - norm, best_i


@torch.inference_mode()
def naive_topk(
    h: torch.Tensor,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    k: int,
    banned: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits, log_softmax, banned tokens masked, topk."""
    logp = torch.log_softmax(logits_fn(h).float(), dim=-1)
    bans = _ban_index(banned)
    if bans is not None:
        logp = logp.index_put(bans, torch.tensor(float("-inf")))
    return logp.topk(k, dim=1)
