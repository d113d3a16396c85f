"""Speculative decoding inside the engine: a proposer drafts up to ``lookahead`` tokens for a
decoding request, the target checks them all in the request's next step (its one token fed back
plus the drafts, each computed as a decode row: inferflow.engine.forward), and the engine keeps
the accepted prefix and one token of the target's (Leviathan et al. 2023; Chen et al. 2023).

Proposers (``method``):

- ``ngram``: prompt lookup, no draft model: the tokens that followed the latest earlier
  occurrence of the sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``).
  Helps where the output repeats the prompt (code edits, extraction, summaries that quote).
- ``draft``: a small decoder with the target's vocabulary, with a paged KV cache of its own,
  run for all proposing requests together, one token per pass.

Acceptance rules (``rule``):

- ``exact``: draft token d with draft probability q(d) and target probability p(d) is accepted
  with probability min(1, p(d) / q(d)); at the first rejection a token is drawn from
  norm(max(0, p - q)); when all pass, one more is drawn from the target. The output has the
  target's distribution exactly; at temperature 0 it is "accept while d is the target's argmax",
  the tokens plain greedy decoding gives.
- ``relaxed``: d is accepted when it lies in the target's own kept set (its top-k / top-p /
  min-p filtered distribution); a rejection draws from the target. Faster, not distribution
  preserving.

p and q are the distributions the sampling parameters define (temperature and the truncation
filters of inferflow.engine.sampling.truncate). A request whose next token depends on more than
that (penalties, logit bias, min_new_tokens, mirostat, FSD, a grammar, beam search) is decoded
without speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from inferflow.engine import batch_sampling as B
from inferflow.engine.forward import Rows, forward_rows
from inferflow.engine.kv_cache import KVCacheFull, PagedKVCache, SeqBlocks
from inferflow.engine.request import Request
from inferflow.engine.sampling import SamplingParams, scaled, truncate
from inferflow.errors import InferflowError
from inferflow.model.network import Network, PagedDecoder

log = logging.getLogger(__name__)

RULES = ("exact", "relaxed")
METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"
    # tokens drafted per step at most; 3: a step of 4 rows costs about 1.4 times one row on
    # SmolLM2's quantized blocks (the kernels take x rows four at a time), 6 rows twice
    lookahead: int = 3
    ngram_max: int = 4
    # a 1-token match proposes poorly (benchmarks/speculative.py: acceptance 11% against 41%
    # on free text at 2, where drafts then cost more than they give)
    ngram_min: int = 2
    rule: str = "exact"
    # drafts only while a step's decode rows, drafts included, stay within this many (None: no
    # bound): a step's cost grows with its rows, and where several requests decode together
    # drafts cost more than they save (benchmarks/speculative.py: 0.83-0.96x at 4-8 requests
    # with 3 drafts each)
    max_rows: int | None = 4
    # a request whose drafts are accepted less often than this, over its last `trial` drafted
    # tokens, drafts nothing for the next 16 of its tokens, then 32, ... up to 512 while that
    # lasts (0: never pause). Drafts cost rows and, with a draft model, its passes; a draft
    # model that rarely agrees (SmolLM2 cut to 8 layers: 1-3%) made a request 3x slower
    min_acceptance: float = 0.2
    trial: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InferflowError(
                f"speculative method {self.method!r} is unknown; known: {', '.join(METHODS)}"
            )
        if self.rule not in RULES:
            raise InferflowError(
                f"speculative rule {self.rule!r} is unknown; known: {', '.join(RULES)}"
            )
        if self.lookahead < 1:
            raise InferflowError(f"lookahead: must be >= 1, got {self.lookahead}")
        if self.max_rows is not None and self.max_rows < 2:
            raise InferflowError(f"max_rows: must be >= 2 (or None), got {self.max_rows}")
        if not 0 <= self.min_acceptance <= 1:
            raise InferflowError(f"min_acceptance: must be in [0, 1], got {self.min_acceptance}")
        if self.trial < 1:
            raise InferflowError(f"trial: must be >= 1, got {self.trial}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InferflowError(
                f"n-gram lengths: need 1 <= min <= max, got min {self.ngram_min}, "
                f"max {self.ngram_max}"
            )


@dataclass
class Draft:
    tokens: list[int]
    # (len(tokens), V) distributions the tokens were drawn from; None: chosen deterministically
    # (prompt lookup, a greedy draft model), q = 1 at the token
    q: torch.Tensor | None = None

    def truncate(self, n: int) -> None:
        self.tokens = self.tokens[:n]
        self.q = None if self.q is None else self.q[:n]


@dataclass
class SpecStats:
    proposed: int = 0  # draft tokens the target checked
    accepted: int = 0  # of those, accepted
    steps: int = 0  # request steps that checked drafts
    pauses: int = 0  # times a request stopped drafting for its low acceptance

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class _Trial:
    """A request's drafting since its last judgement (SpecConfig.min_acceptance)."""

    proposed: int = 0
    accepted: int = 0
    backoff: int = 0  # tokens of the last pause (0: none yet, or acceptance recovered)
    resume_at: int = 0  # generated tokens before which it drafts nothing


def speculable(req: Request) -> bool:
    """Whether the request's next tokens depend on its logits and sampling parameters alone."""
    s = req.sampler
    return (
        not s.processors
        and s.anti is None
        and not req.params.mirostat
        and req.constraint is None
        and req.params.beam_width == 1
    )


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
        if rule == "exact":  # (u < p / q with u uniform on [0, 1): probability min(1, p / q))
            ok = float(torch.rand((), generator=gen)) * float(q[i, d]) < float(p[i, d])
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


def accept(
    logits: torch.Tensor, draft: Draft, params: SamplingParams, gen: torch.Generator, rule: str
) -> tuple[list[int], int]:
    """The target's float32 logits (K + 1, V) after the request's last token and after each of
    the K drafts: the tokens to append and how many drafts they accept."""
    if params.temperature == 0:  # (the argmax plain greedy decoding takes, row by row)
        best = B.argmax_rows(logits)
        n = 0
        while n < len(draft.tokens) and draft.tokens[n] == best[n]:
            n += 1
        return [*draft.tokens[:n], best[n]], n
    p = distribution(logits, params)
    q = draft.q
    if q is None:
        q = nn.functional.one_hot(torch.tensor(draft.tokens), p.shape[-1]).float()
    return verify(p, q, draft.tokens, gen, rule)


class NgramProposer:
    """Prompt lookup: no model, no state."""

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        return [Draft(self.lookup(r.tokens, k)) for r, k in zip(reqs, ks, strict=True)]

    def lookup(self, toks: list[int], k: int) -> list[int]:
        """The k tokens (or fewer) after the latest earlier occurrence of the longest tail of
        ``toks`` of ngram_min..ngram_max tokens that occurs earlier; [] if none does."""
        for n in range(min(self.cfg.ngram_max, len(toks) - 1), self.cfg.ngram_min - 1, -1):
            tail = toks[-n:]
            for i in range(len(toks) - n - 1, -1, -1):
                if toks[i : i + n] == tail:
                    return toks[i + n : i + n + k]
        return []

    def forget(self, req: Request) -> None:
        pass


class DraftProposer:
    """A draft decoder with a paged KV cache of its own (as many blocks as the target's, so a
    request the target holds fits here too). A request's draft K/V stay valid for its tokens
    between steps: each step feeds only what the draft model has not seen."""

    def __init__(self, model: Network, num_blocks: int, block_size: int) -> None:
        if model.spec.network.type != "decoder_only" or not isinstance(model, PagedDecoder):
            raise InferflowError(
                f"draft spec {model.spec.name!r}: a draft model must be a decoder_only "
                f"network, not {model.spec.network.type}"
            )
        self.model: PagedDecoder = model
        dtype = next(model.parameters()).dtype
        self.cache = PagedKVCache(*model.kv_geometry(), block_size, num_blocks, dtype)
        self.seqs: dict[Request, SeqBlocks] = {}

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        live = []
        for i, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            seq = self.seqs.setdefault(r, SeqBlocks())
            # K/V of the request's tokens stay; those of drafts it did not keep are rewritten
            # (and the last token is fed again when its logits are needed)
            seq.num_computed = min(seq.num_computed, len(r.tokens) - 1)
            try:
                self.cache.reserve(seq, len(r.tokens) + k - 1)
            except KVCacheFull:  # no drafts for it this step
                self.forget(r)
                continue
            live.append(i)
        for step in range(max(ks)):
            now = [i for i in live if ks[i] > step]
            if not now:
                break
            items = []
            for i in now:
                r, seq = reqs[i], self.seqs[reqs[i]]
                fed = (r.tokens + drafts[i].tokens)[seq.num_computed :]
                decode = seq.num_computed >= len(r.prompt_ids)
                items.append(Rows(seq, seq.num_computed, fed, decode))
            logits = forward_rows(self.model, self.cache, items)
            for i, it, row in zip(now, items, logits, strict=True):
                self.seqs[reqs[i]].num_computed = it.start + len(it.tokens)
                params, gen = reqs[i].params, reqs[i].sampler.gen
                if params.temperature == 0:
                    drafts[i].tokens.append(int(row.argmax()))
                    continue
                q = distribution(row, params)
                qs[i].append(q)
                drafts[i].tokens.append(int(torch.multinomial(q, 1, generator=gen)))
        for d, dist in zip(drafts, qs, strict=True):
            d.q = torch.stack(dist) if dist else None
        return drafts

    def forget(self, req: Request) -> None:
        seq = self.seqs.pop(req, None)
        if seq is not None:
            self.cache.release(seq)


Proposer = NgramProposer | DraftProposer


def proposer_for(
    cfg: SpecConfig, target: Network, draft: Network | None, num_blocks: int, block_size: int
) -> Proposer:
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if draft is None:
        raise InferflowError("speculative method 'draft' needs a draft model (--draft SPEC)")
    tv, dv = target.spec.hparams.vocab_size, draft.spec.hparams.vocab_size
    if tv != dv:
        raise InferflowError(
            f"draft spec {draft.spec.name!r}: its vocabulary ({dv}) differs from the target's "
            f"({tv}); a draft model must share the target's tokenizer"
        )
    return DraftProposer(draft, num_blocks, block_size)


class Speculator:
    """The engine's side of speculative decoding: drafts for the requests about to decode
    before a step's schedule, the check of each one's drafts after its forward pass."""

    def __init__(
        self,
        cfg: SpecConfig,
        target: Network,
        draft: Network | None,
        num_blocks: int,
        block_size: int,
    ) -> None:
        self.cfg = cfg
        self.proposer = proposer_for(cfg, target, draft, num_blocks, block_size)
        self.stats = SpecStats()
        self.trials: dict[Request, _Trial] = {}

    def propose(self, running: list[Request], max_len: int) -> None:
        """Set ``draft`` of the running requests about to decode (their one new token not yet
        fed) that can take drafts (``speculable``), as many as their limits and the step's rows
        (SpecConfig.max_rows) leave room for; None for the others."""
        decoding = []
        for r in running:
            r.draft = None
            if r.output_ids and r.kv.num_computed == len(r.tokens) - 1:
                decoding.append(r)
        lookahead = self.cfg.lookahead
        if self.cfg.max_rows is not None and decoding:
            lookahead = min(lookahead, (self.cfg.max_rows - len(decoding)) // len(decoding))
        reqs, ks = [], []
        for r in decoding if lookahead >= 1 else []:
            # (a step with k drafts may give k + 1 tokens)
            room = min(r.params.max_new_tokens - len(r.output_ids), max_len - len(r.tokens))
            k = min(lookahead, room - 1)
            paused = r in self.trials and len(r.output_ids) < self.trials[r].resume_at
            if k >= 1 and speculable(r) and not paused:
                reqs.append(r)
                ks.append(k)
        if not reqs:
            return
        try:
            drafts = self.proposer.propose(reqs, ks)
        except Exception:  # drafts only save time: these requests decode without them
            log.warning("speculative proposals failed; decoding without them", exc_info=True)
            return
        for r, d in zip(reqs, drafts, strict=True):
            r.draft = d if d.tokens else None

    def check(self, req: Request, rows: torch.Tensor) -> tuple[list[int], int]:
        """The tokens ``req``'s drafts give against the target's float32 ``rows`` (after its
        token fed back and after each draft), and how many drafts they accept; the request's
        draft is cleared."""
        draft, req.draft = req.draft, None
        toks, n = accept(rows, draft, req.params, req.sampler.gen, self.cfg.rule)
        self.stats.proposed += len(draft.tokens)
        self.stats.accepted += n
        self.stats.steps += 1
        self._judge(req, len(draft.tokens), n)
        return toks, n

    def _judge(self, req: Request, proposed: int, accepted: int) -> None:
        """Count a check into the request's trial; once `trial` drafts are in, pause its
        drafting where too few were accepted (the pause doubling while that lasts)."""
        if self.cfg.min_acceptance <= 0:
            return
        t = self.trials.setdefault(req, _Trial())
        t.proposed += proposed
        t.accepted += accepted
        if t.proposed < self.cfg.trial:
            return
        if t.accepted < self.cfg.min_acceptance * t.proposed:
            t.backoff = min(max(2 * t.backoff, 16), 512)
            t.resume_at = len(req.output_ids) + t.backoff
            self.stats.pauses += 1
            log.debug(
                "request %s: %d of %d drafts accepted; no drafts for %d tokens",
                req.id, t.accepted, t.proposed, t.backoff,
            )  # fmt: skip
        else:
            t.backoff = 0
        t.proposed = t.accepted = 0

    def forget(self, req: Request) -> None:
        """A finished request's drafting state (the draft model's cache included)."""
        self.trials.pop(req, None)
        self.proposer.forget(req)
