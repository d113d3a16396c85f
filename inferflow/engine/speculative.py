"""Speculative decoding: a small draft model proposes K tokens, the target checks them all in one
forward pass (Leviathan et al. 2023; Chen et al. 2023).

Acceptance rules (``rule``):

- ``exact``: draft token d with draft probability q(d) and target probability p(d) is accepted
  with probability min(1, p(d) / q(d)); at the first rejection a token is drawn from
  norm(max(0, p - q)); when all K pass, one more is drawn from the target. The output has the
  target's distribution exactly. At temperature 0 it reduces to "accept while d == argmax p".
- ``relaxed``: d is accepted when it lies in the target's own kept set (its top-k / top-p /
  min-p filtered distribution); a rejection draws from the target. Faster, not distribution
  preserving.

p and q are the distributions the sampling parameters define (temperature and the truncation
filters of inferflow.engine.sampling.truncate) over each model's logits; penalties and stateful
strategies are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from inferflow.engine.generate import new_cache
from inferflow.engine.sampling import SamplingParams, scaled, truncate
from inferflow.errors import RequestError
from inferflow.model.batch import ContiguousKVCache, FlatBatch
from inferflow.model.network import Network

RULES = ("exact", "relaxed")
# sampling settings that depend on the sequence or on sampler state: not in the verified p / q
STATEFUL = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_new_tokens",
    "mirostat",
    "fsd_alpha",
    "stop",  # stop strings need the detokenizer: use stop_token_ids
    "logprobs",
)


@dataclass
class SpecResult:
    token_ids: list[int]
    finish_reason: str
    proposed: int = 0  # draft tokens offered to the target
    accepted: int = 0  # of those, accepted
    target_passes: int = 0
    accepted_per_pass: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities the sampling parameters define over float32 logits (..., V)."""
    if params.temperature == 0:
        return nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    rows = scaled(logits.reshape(-1, logits.shape[-1]).float(), params.temperature)
    probs = [torch.softmax(truncate(row, params), dim=-1) for row in rows]
    return torch.stack(probs).reshape(logits.shape)


def verify(
    p: torch.Tensor,  # (K + 1, V) target distributions after the prefix and after each draft
    q: torch.Tensor,  # (K, V) draft distributions the drafts were drawn from
    drafts: Sequence[int],
    gen: torch.Generator,
    rule: str = "exact",
) -> tuple[list[int], int]:
    """Tokens to append (accepted drafts plus one drawn token) and the number accepted."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        if rule == "exact":
            ok = float(torch.rand((), generator=gen)) * float(q[i, d]) <= float(p[i, d])
        else:
            ok = float(p[i, d]) > 0
        if ok:
            out.append(d)
            continue
        resid = (p[i] - q[i]).clamp_min(0) if rule == "exact" else p[i]
        if float(resid.sum()) <= 0:  # p == q up to rounding: p itself is the residual
            resid = p[i]
        out.append(int(torch.multinomial(resid / resid.sum(), 1, generator=gen)))
        return out, i
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=gen)))
    return out, len(drafts)


class _Runner:
    """One model over one sequence: feeds the tokens its cache lacks, returns their logits."""

    def __init__(self, model: Network, max_len: int) -> None:
        self.model = model
        self.cache: ContiguousKVCache = new_cache(model, max_len)
        self.valid = 0  # leading tokens whose K/V in the cache are correct

    @torch.inference_mode()
    def logits(self, seq: list[int], rows: int) -> torch.Tensor:
        """Feed seq[valid:], return float32 logits (rows, V) of the last ``rows`` tokens fed."""
        new = seq[self.valid :]
        batch = FlatBatch.single(torch.tensor(new), self.valid, self.cache)
        batch.logits_rows = torch.arange(len(new) - rows, len(new))
        self.valid = len(seq)
        return self.model(batch).float()


def speculative_generate(
    target: Network,
    draft: Network,
    prompt_ids: list[int],
    params: SamplingParams,
    lookahead: int = 4,
    rule: str = "exact",
    eos_ids: Sequence[int] = (),
) -> SpecResult:
    if rule not in RULES:
        raise RequestError(f"unknown speculative rule {rule!r}; known: {', '.join(RULES)}")
    if lookahead < 1:
        raise RequestError(f"lookahead must be >= 1, got {lookahead}")
    if not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token")
    tv, dv = target.spec.hparams.vocab_size, draft.spec.hparams.vocab_size
    if tv != dv:
        raise RequestError(f"draft vocabulary ({dv}) differs from the target's ({tv})")
    defaults = SamplingParams()
    unsupported = [k for k in STATEFUL if getattr(params, k) != getattr(defaults, k)]
    if unsupported:
        raise RequestError(
            f"speculative decoding supports temperature and the truncation filters only; "
            f"unsupported here: {', '.join(unsupported)}"
        )
    max_new = min(params.max_new_tokens, target.spec.hparams.max_positions - len(prompt_ids))
    limit = len(prompt_ids) + max_new + lookahead + 1
    t, d = _Runner(target, limit), _Runner(draft, limit)
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    seq = list(prompt_ids)
    res = SpecResult([], "length")
    while len(res.token_ids) < max_new:
        k = min(lookahead, max_new - len(res.token_ids))
        drafts: list[int] = []
        qs = []
        for _ in range(k):  # the draft proposes k tokens, one forward each
            q = distribution(d.logits(seq + drafts, 1)[0], params)
            qs.append(q)
            drafts.append(int(torch.multinomial(q, 1, generator=gen)))
        p = distribution(t.logits(seq + drafts, k + 1), params)  # one target pass
        new, n_ok = verify(p, torch.stack(qs), drafts, gen, rule)
        res.proposed += k
        res.accepted += n_ok
        res.target_passes += 1
        res.accepted_per_pass.append(n_ok)
        # caches stay right up to the last accepted draft; later rows are recomputed next time
        t.valid = len(seq) + n_ok
        d.valid = min(d.valid, len(seq) + n_ok)
        for tok in new:
            res.token_ids.append(tok)
            seq.append(tok)
            if tok in stops:
                res.finish_reason = "stop"
                return res
            if len(res.token_ids) >= max_new:
                return res
    return res
