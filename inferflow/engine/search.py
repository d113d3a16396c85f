"""Batched beam search (greedy at width 1) over a static batch of inputs, for encoder-decoder
and decoder-only models: ``beam_search(model, inputs, params, end_ids)``.

Each input is encoded once (encoder-decoder: all sources in one packed pass, cross-attention
K/V computed once per source and kept in a ``CrossBank``) or its prompt computed once
(decoder-only). Every step runs one flat batch holding one new token per live hypothesis of
every unfinished input, then the output layer returns each hypothesis' 2W best continuations
(``fused_topk``: the Amun output layer), all inputs' candidates are ranked in one padded pass
and each input's ``BeamState`` picks its next beams. Keys and values live in a ``RowCache``, one
row per hypothesis; rows never move (a parent's first child takes over its row). An input whose
search is done leaves the batch at once (Amun's mini-batching), unless ``drop_finished`` is off
(the static-batch behaviour, kept for benchmarks/beam.py).

Scores follow transformers' ``generate(num_beams=W)``: log-probabilities after the logits
processors (end tokens banned below ``min_new_tokens``, ``no_repeat_ngram``), hypotheses
ranked by ``logprob / len ** length_penalty`` (generated tokens, end token included).

Variable width (Yang et al. 2020, "A Streaming Approach For Efficient Batched Beam Search"):
``prune_delta`` drops candidates more than δ below the input's best candidate of the step,
``max_per_parent`` caps the live children of one beam; an input with no live beam left is
done. With neither set the search is the fixed-width one. Every decision of an input depends on
that input alone, which is what lets ``inferflow.engine.var_stream`` regroup inputs freely.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferflow.engine.beam import BeamState, Hypothesis
from inferflow.engine.output_layer import fused_topk, naive_topk
from inferflow.engine.row_cache import RowCache, StepRows
from inferflow.errors import RequestError, Stopped
from inferflow.model.batch import FlatBatch, SeqSlice, check_inputs
from inferflow.model.cross import CrossBank
from inferflow.model.decoder import DecoderOnly
from inferflow.model.encoder import EncoderDecoder
from inferflow.model.network import Network


@dataclass(frozen=True)
class SearchParams:
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = True  # done at W finished; False: also while a live beam may win
    num_return: int = 1  # hypotheses returned per input (at most), best first
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    no_repeat_ngram: int = 0  # 0: off; n: no n-gram occurs twice in a hypothesis
    prune_delta: float = math.inf  # drop candidates this far below the input's best (inf: off)
    max_per_parent: int | None = None  # live children of one beam at most (None: beam_width)

    def __post_init__(self) -> None:
        for name, low in (("beam_width", 1), ("num_return", 1), ("max_new_tokens", 1)):
            if getattr(self, name) < low:
                raise RequestError(f"{name}: must be at least {low}, got {getattr(self, name)}")
        for name in ("min_new_tokens", "no_repeat_ngram"):
            if getattr(self, name) < 0:
                raise RequestError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.num_return > self.beam_width:
            raise RequestError(
                f"num_return ({self.num_return}) exceeds beam_width ({self.beam_width})"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        if not self.prune_delta >= 0:  # NaN too
            raise RequestError(f"prune_delta: must be >= 0 (inf = off), got {self.prune_delta}")
        m = self.max_per_parent
        if m is not None and not 1 <= m <= self.beam_width:
            raise RequestError(
                f"max_per_parent: must be in [1, beam_width = {self.beam_width}], got {m}"
            )

    @property
    def per_parent(self) -> int:
        return self.beam_width if self.max_per_parent is None else self.max_per_parent


def ngram_bans(tokens: list[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram of ``tokens`` (transformers' NoRepeatNGram)."""
    if n <= 0 or len(tokens) + 1 < n:
        return []
    prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
    return [
        tokens[i + n - 1]
        for i in range(len(tokens) - n + 1)
        if tuple(tokens[i : i + n - 1]) == prefix
    ]


@dataclass
class Beam:
    src: int  # which input
    prefix: list[int]  # decoder tokens before the generated ones (start token / prompt), shared
    out: list[int]  # generated tokens
    logprob: float

    @property
    def tokens(self) -> list[int]:
        """Every decoder token: the prefix, then the generated ones."""
        return [*self.prefix, *self.out]

    @property
    def last_token(self) -> int:
        return self.out[-1] if self.out else self.prefix[-1]


@dataclass
class SearchStats:
    """What a search computed: decoder passes, hypothesis rows (beams expanded) over all of
    them, (streaming) how often the batch was refilled, and the most cache rows held at once
    (hypotheses in a step or waiting for one)."""

    steps: int = 0
    rows: int = 0
    refills: int = 0
    peak_rows: int = 0


def prune_mask(
    total: torch.Tensor,  # (I, R, C) summed log-probabilities of I inputs' R beams, each best first
    toks: torch.Tensor,  # (I, R, C)
    ends: torch.Tensor,  # end token ids
    params: SearchParams,
    last: torch.Tensor,  # (I,) bool: an input's last step
) -> torch.Tensor | None:
    """The candidates that variable-width search drops (None: none, the fixed-width search):
    those more than ``prune_delta`` below their input's best, and live children past the
    ``max_per_parent``-th of one beam (a candidate ending in an end token is no live child;
    none at an input's ``last`` step, where every candidate finishes instead of living on)."""
    mask = None
    if params.prune_delta < math.inf:
        mask = total < total.amax(dim=(1, 2), keepdim=True) - params.prune_delta
    # (a cap of beam_width never binds: the W best candidates of one beam come first)
    if params.per_parent < params.beam_width:
        live = ~torch.isin(toks, ends)
        extra = live & (live.cumsum(dim=2) > params.per_parent) & ~last[:, None, None]
        mask = extra if mask is None else mask | extra
    return mask


@dataclass
class Turn:
    """One input's part of a step: its search state, live beams, their rows among the step's
    candidates, and its new tokens at most."""

    state: BeamState
    beams: list[Beam]
    rows: list[int]
    limit: int


class Decoding:
    """What the static and the streaming search share: new inputs' first beams, one decoder
    pass over some rows of the cache, their candidates, and the inputs' next beams."""

    def __init__(
        self,
        model: Network,
        params: SearchParams,
        end_ids: set[int],
        fused: bool,
        stats: SearchStats,
    ) -> None:
        kind = model.spec.network.type
        if kind not in ("decoder_only", "encoder_decoder"):
            raise RequestError(
                f"spec {model.spec.name!r} is {kind}: beam search needs a decoder "
                "(decoder_only or encoder_decoder)"
            )
        if not isinstance(model, (DecoderOnly, EncoderDecoder)):  # a PartitionedModel
            raise RequestError(
                f"spec {model.spec.name!r}: beam search runs on a model loaded whole, "
                "not on one partitioned across devices (the spec's partition section)"
            )
        self.model, self.params, self.end_ids, self.stats = model, params, end_ids, stats
        self.enc_dec = isinstance(model, EncoderDecoder)
        self.dtype = next(model.parameters()).dtype  # the caches'
        self.bank: CrossBank | None = None  # encoder-decoder: the sources' cross memory
        self.slot: dict[int, int] = {}  # input -> its slot in the bank
        self.head = model.dec.head() if fused else None
        self.ends = torch.tensor(sorted(end_ids), dtype=torch.long)

    def limits(self, inputs: list[list[int]]) -> list[int]:
        """Each input's new tokens at most (checking every input first): an input's own limit,
        whatever else is searched with it."""
        h = self.model.spec.hparams
        if self.enc_dec:
            he = self.model.spec.encoder_hparams
            check_inputs(inputs, he.vocab_size, he.max_positions, "source")
            return [min(self.params.max_new_tokens, h.max_positions - 1)] * len(inputs)
        check_inputs(inputs, h.vocab_size, h.max_positions - 1, "prompt")
        return [min(self.params.max_new_tokens, h.max_positions - len(x)) for x in inputs]

    def start(self, srcs: list[int], inputs: list[list[int]]) -> list[Beam]:
        """The first beam of each input in ``srcs`` (encoder-decoder: sources encoded in one
        packed pass, cross-attention memory kept until ``release``)."""
        model = self.model
        if not isinstance(model, EncoderDecoder):
            return [Beam(s, list(inputs[s]), [], 0.0) for s in srcs]
        if self.bank is None:
            h = model.spec.hparams
            self.bank = CrossBank(h.n_layers, h.n_heads, h.head_dim, self.dtype)
        memories = model.cross_memories(model.encode([inputs[s] for s in srcs]))
        for s, memory in zip(srcs, memories, strict=True):
            self.slot[s] = self.bank.add(memory)
        return [Beam(s, [model.start_id], [], 0.0) for s in srcs]

    def release(self, src: int) -> None:
        if self.bank is not None and src in self.slot:
            self.bank.remove(self.slot.pop(src))

    def new_state(self) -> BeamState:
        p = self.params
        return BeamState(p.beam_width, p.length_penalty, p.early_stopping)

    def new_cache(self, inputs: list[list[int]], limits: list[int], capacity: int) -> RowCache:
        """Room for ``capacity`` rows (more are added as needed), each as long as any beam of
        ``inputs`` can grow: the largest prefix (prompt, or the start token) plus new tokens of
        one input."""
        h = self.model.spec.hparams
        prefixes = [1] * len(inputs) if self.enc_dec else [len(x) for x in inputs]
        return RowCache(
            h.n_layers,
            max(a + n for a, n in zip(prefixes, limits, strict=True)),
            h.n_kv_heads,
            h.head_dim,
            self.dtype,
            capacity=capacity,
        )

    def forward(self, rows: StepRows, beams: list[Beam], first: bool) -> torch.Tensor:
        """Hidden states of each beam's last new token; ``beams`` hold the rows of ``rows``, each
        computing its prefix (``first``) or its last token (a finished input's beams kept in a
        static batch compute theirs again)."""
        seqs = [b.prefix if first else [b.last_token] for b in beams]
        lengths = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
        one_each = all(n == 1 for n in lengths)
        if one_each:  # each row's new token goes at its length
            pos = rows.lens.clone()
        else:
            starts = rows.lens.tolist()
            pos = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths, strict=True)])
        slices, at = [], 0
        for n in lengths:
            slices.append(SeqSlice(at, n))
            at += n
        batch = FlatBatch(
            ids,
            pos,
            slices,
            [rows.row(i) for i in range(len(seqs))],
            group=rows if one_each else None,
        )
        if self.bank is not None:
            batch.cross = self.bank.rows([self.slot[b.src] for b in beams], lengths)
        h = self.model.hidden_states(batch)
        rows.advance(torch.tensor(lengths))
        self.stats.steps += 1
        self.stats.rows += len(seqs)
        self.stats.peak_rows = max(self.stats.peak_rows, rows.cache.used)
        if one_each:  # every row is a sequence's last
            return h
        return h[torch.tensor([sl.start + sl.length - 1 for sl in slices])]

    def candidates(self, beams: list[Beam], h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each beam's 2W best next tokens: (log-probabilities, ids), each (R, 2W)."""
        p = self.params
        k = 2 * p.beam_width
        banned = []
        for b in beams:
            ban = ngram_bans(b.tokens, p.no_repeat_ngram) if p.no_repeat_ngram else []
            if len(b.out) < p.min_new_tokens:
                ban = ban + sorted(self.end_ids)
            banned.append(ban)
        if self.head is not None:
            return fused_topk(self.model.dec.head_input(h), *self.head, k, banned)
        return naive_topk(h, self.model.logits, k, banned)

    def select(
        self, inputs: list[Turn], logp: torch.Tensor, toks: torch.Tensor
    ) -> list[list[tuple[int, Beam]]]:
        """Each input's next beams from its live beams' candidates (``logp``, ``toks``: (rows,
        2W), each ``Turn``'s rows among them): (index of the parent in the turn's beams,
        child); none once the input's search is over: done, or no live beam left (variable
        width). One padded (inputs, W, 2W) pass ranks every input's candidates; each input's
        numbers are its own whatever else is in it."""
        W, C = self.params.beam_width, toks.shape[1]
        n = len(inputs)
        which = torch.tensor([i for i, t in enumerate(inputs) for _ in t.rows])
        at = torch.tensor([j for t in inputs for j in range(len(t.rows))])
        rows = torch.tensor([r for t in inputs for r in t.rows])
        scores = torch.tensor([b.logprob for t in inputs for b in t.beams])
        total = logp.new_full((n, W, C), -math.inf)
        total[which, at] = scores[:, None] + logp[rows]
        tk = toks.new_zeros((n, W, C))
        tk[which, at] = toks[rows]
        dropped = torch.ones((n, W, C), dtype=torch.bool)  # padding is no candidate
        dropped[which, at] = False
        # (an input's live beams have one length)
        last = [len(t.beams[0].out) == t.limit - 1 for t in inputs]
        pruned = prune_mask(total, tk, self.ends, self.params, torch.tensor(last))
        if pruned is not None:
            dropped |= pruned
            total = total.masked_fill(pruned, -math.inf)
        values, flat = total.view(n, -1).topk(2 * W)
        tok_ids = tk.view(n, -1).gather(1, flat).tolist()
        skip = dropped.view(n, -1).gather(1, flat).tolist()
        out: list[list[tuple[int, Beam]]] = []
        for t, vs, fs, ks, ds, is_last in zip(
            inputs, values.tolist(), flat.tolist(), tok_ids, skip, last, strict=True
        ):
            ranked = [(f // C, k, v) for v, f, k, d in zip(vs, fs, ks, ds, strict=True) if not d]
            picks = t.state.choose(ranked, [b.out for b in t.beams], self.end_ids, is_last)
            if t.state.done:
                out.append([])
                continue
            parents = t.beams
            out.append(
                [
                    (i, Beam(parents[i].src, parents[i].prefix, [*parents[i].out, tok], score))
                    for i, tok, score in picks
                ]
            )
        return out


def input_runs(beams: list[Beam]) -> list[tuple[int, list[int]]]:
    """(input, its rows) for each run of consecutive beams of one input."""
    runs: list[tuple[int, list[int]]] = []
    for r, b in enumerate(beams):
        if runs and runs[-1][0] == b.src:
            runs[-1][1].append(r)
        else:
            runs.append((b.src, [r]))
    return runs


StopCheck = Callable[[], bool]  # asked before every step: True stops the search (Stopped)


def check_stop(stop: StopCheck | None) -> None:
    if stop is not None and stop():
        raise Stopped("the search was stopped before it finished")


class _Search:
    def __init__(
        self,
        model: Network,
        inputs: list[list[int]],
        params: SearchParams,
        end_ids: set[int],
        fused: bool,
        drop_finished: bool,
        stats: SearchStats,
        stop: StopCheck | None = None,
    ) -> None:
        self.params, self.drop_finished, self.stop = params, drop_finished, stop
        self.core = Decoding(model, params, end_ids, fused, stats)
        self.limits = self.core.limits(inputs)
        if not drop_finished:  # rows of finished inputs go on: one limit for all
            self.limits = [min(self.limits)] * len(inputs)
        self.beams = self.core.start(list(range(len(inputs))), inputs)
        self.states = [self.core.new_state() for _ in inputs]
        self.over = [False] * len(inputs)  # done, or no live beam left (variable width)
        self.cache = self.core.new_cache(inputs, self.limits, len(inputs) * params.beam_width)
        self.rows = self.cache.new_rows(len(inputs))  # each beam's cache row

    def _step(self, logp: torch.Tensor, toks: torch.Tensor) -> list[tuple[int, Beam]]:
        """Every unfinished input's next beams: (parent's place in ``beams``, child)."""
        runs = input_runs(self.beams)
        live = [(src, at) for src, at in runs if not self.over[src]]
        turns = [
            Turn(self.states[src], [self.beams[r] for r in at], at, self.limits[src])
            for src, at in live
        ]
        picked = dict(
            zip((src for src, _ in live), self.core.select(turns, logp, toks), strict=True)
        )
        nxt: list[tuple[int, Beam]] = []
        for src, at in runs:
            picks = picked.get(src)
            if picks is not None:
                self.over[src] = not picks
                if picks:
                    nxt += [(at[i], b) for i, b in picks]
                    continue
            if not self.drop_finished:  # a static batch: the rows of a finished
                nxt += [(r, self.beams[r]) for r in at]  # input compute, unused
        return nxt

    def run(self) -> list[list[Hypothesis]]:
        with torch.inference_mode():
            h = self.core.forward(self.cache.step(self.rows), self.beams, first=True)
            while True:
                check_stop(self.stop)
                logp, toks = self.core.candidates(self.beams, h)
                nxt = self._step(logp, toks)
                if all(self.over):
                    break
                self.rows = self.cache.fork(self.rows, [self.rows[r] for r, _ in nxt])
                self.beams = [b for _, b in nxt]
                h = self.core.forward(self.cache.step(self.rows), self.beams, first=False)
        return [s.finished[: self.params.num_return] for s in self.states]


def default_end_ids(model: Network, end_ids: set[int] | tuple[int, ...]) -> set[int]:
    if not end_ids and model.spec.hparams.eos_id is not None:
        return {model.spec.hparams.eos_id}
    return set(end_ids)


def beam_search(
    model: Network,
    inputs: list[list[int]],
    params: SearchParams,
    end_ids: set[int] | tuple[int, ...] = (),
    fused: bool = True,
    drop_finished: bool = True,
    stats: SearchStats | None = None,
    stop: StopCheck | None = None,
) -> list[list[Hypothesis]]:
    """For each input (an encoder-decoder's source, or a decoder-only prompt), its
    ``num_return`` best hypotheses (generated tokens, summed log-probability; fewer where
    variable-width pruning finished fewer). ``end_ids`` default to the checkpoint's end token;
    ``stats`` (if given) counts the work done; ``stop`` (if given) is asked before every step
    and ends the search with ``Stopped`` when it answers True."""
    if not inputs:
        return []
    search = _Search(
        model,
        inputs,
        params,
        default_end_ids(model, end_ids),
        fused,
        drop_finished,
        stats or SearchStats(),
        stop,
    )
    return search.run()
