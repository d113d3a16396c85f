"""Batched beam search (greedy at width 1) over a static batch of inputs, for encoder-decoder
and decoder-only models: ``beam_search(model, inputs, params, end_ids)``.

Each input is encoded once (encoder-decoder: all sources in one packed pass, cross-attention
K/V computed once per source) or its prompt computed once (decoder-only). Every step runs one
flat batch holding one new token per live hypothesis of every unfinished input, then the
output layer returns each hypothesis' 2W best continuations (``fused_topk``: the Amun output
layer) and each input's ``BeamState`` picks its next beams. Keys and values live in one
(layers, rows, length) cache whose rows are reordered when beams are chosen. An input whose
search is done leaves the batch at once (Amun's mini-batching), unless ``drop_finished`` is off
(the static-batch behaviour, kept for benchmarks/beam.py).

Scores follow transformers' ``generate(num_beams=W)``: log-probabilities after the logits
processors (end tokens banned below ``min_new_tokens``, ``no_repeat_ngram``), hypotheses
ranked by ``logprob / len ** length_penalty`` (generated tokens, end token included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inferflow.engine.beam import BeamState, Hypothesis
from inferflow.engine.output_layer import fused_topk, naive_topk
from inferflow.errors import RequestError
from inferflow.model.batch import FlatBatch, SeqSlice, check_inputs
from inferflow.model.encoder import EncoderDecoder


@dataclass(frozen=True)
class SearchParams:
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = True  # done at W finished; False: also while a live beam may win
    num_return: int = 1  # hypotheses returned per input, best first
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    no_repeat_ngram: int = 0  # 0: off; n: no n-gram occurs twice in a hypothesis

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


class RowCache:
    """Keys and values of R rows (hypotheses) in (layers, R, T, KVH, D) tensors, each row
    filled up to its own length. As a ``GroupKVView`` it serves a step with one new token
    per row; ``row(i)`` is row i's ``KVView`` (prompts, and blocks with an attention bias)."""

    def __init__(self, layers: int, rows: int, max_len: int, kvh: int, d: int, dtype: torch.dtype):
        self.k = torch.zeros((layers, rows, max_len, kvh, d), dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.lens = torch.zeros(rows, dtype=torch.long)
        self._pos = torch.arange(max_len, dtype=torch.long)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = torch.arange(k.shape[0])
        self.k[layer, rows, self.lens] = k
        self.v[layer, rows, self.lens] = v
        end = int(self.lens.max()) + 1
        pos = self._pos[:end].expand(k.shape[0], end)
        return self.k[layer, :, :end], self.v[layer, :, :end], pos, pos <= self.lens[:, None]

    def row(self, i: int) -> _Row:
        return _Row(self, i)

    def advance(self, n: torch.Tensor | int = 1) -> None:
        self.lens += n

    def select(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` (in that order; a row may repeat: beams sharing a parent)."""
        if idx.numel() == self.lens.numel() and torch.equal(idx, torch.arange(idx.numel())):
            return  # nothing moved (greedy search, no input finished): no copy
        self.k, self.v, self.lens = self.k[:, idx], self.v[:, idx], self.lens[idx]


class _Row:
    def __init__(self, cache: RowCache, i: int) -> None:
        self.cache, self.i = cache, i

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cache
        start, end = int(positions[0]), int(positions[-1]) + 1
        c.k[layer, self.i, start:end] = k
        c.v[layer, self.i, start:end] = v
        return c.k[layer, self.i, :end], c.v[layer, self.i, :end], c._pos[:end]


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
class _Beam:
    src: int  # which input
    tokens: list[int]  # decoder tokens: the prefix (start token / prompt), then generated ones
    out: list[int]  # generated tokens
    logprob: float


@dataclass
class SearchStats:
    """What a search computed: decoder passes and hypothesis rows over all of them."""

    steps: int = 0
    rows: int = 0


class _Search:
    def __init__(
        self,
        model: nn.Module,
        inputs: list[list[int]],
        params: SearchParams,
        end_ids: set[int],
        fused: bool,
        drop_finished: bool,
        stats: SearchStats,
    ) -> None:
        self.model, self.params, self.end_ids = model, params, end_ids
        self.drop_finished, self.stats = drop_finished, stats
        kind = model.spec.network.type
        if kind not in ("decoder_only", "encoder_decoder"):
            raise RequestError(
                f"spec {model.spec.name!r} is {kind}: beam search needs a decoder "
                "(decoder_only or encoder_decoder)"
            )
        h = model.spec.hparams
        self.memory = None
        if isinstance(model, EncoderDecoder):  # sources are checked and encoded once, here
            self.memory = [model.cross_memory(e) for e in model.encode(inputs)]
            prefixes = [[model.start_id] for _ in inputs]
        else:
            check_inputs(inputs, h.vocab_size, h.max_positions - 1, "prompt")
            prefixes = [list(x) for x in inputs]
        longest = max(len(p) for p in prefixes)
        self.max_new = min(params.max_new_tokens, h.max_positions - longest)
        self.states = [
            BeamState(params.beam_width, params.length_penalty, params.early_stopping)
            for _ in inputs
        ]
        self.beams = [_Beam(i, p, [], 0.0) for i, p in enumerate(prefixes)]
        dtype = next(model.parameters()).dtype
        self.cache = RowCache(
            h.n_layers, len(inputs), longest + self.max_new, h.n_kv_heads, h.head_dim, dtype
        )
        self.head = model.dec.head() if fused else None

    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        """Hidden states of each live beam's last new token (``seqs``: its new tokens)."""
        starts = self.cache.lens.tolist()
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
        pos = torch.cat([torch.arange(a, a + len(s)) for a, s in zip(starts, seqs, strict=True)])
        slices, at = [], 0
        for s in seqs:
            slices.append(SeqSlice(at, len(s)))
            at += len(s)
        one_each = all(len(s) == 1 for s in seqs)
        batch = FlatBatch(
            ids,
            pos,
            slices,
            [self.cache.row(i) for i in range(len(seqs))],
            group=self.cache if one_each else None,
        )
        if self.memory is not None:
            batch.cross = [self.memory[b.src] for b in self.beams]
        h = self.model.hidden_states(batch)
        self.cache.advance(torch.tensor([len(s) for s in seqs]))
        self.stats.steps += 1
        self.stats.rows += len(seqs)
        return h[torch.tensor([sl.start + sl.length - 1 for sl in slices])]

    def _candidates(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        banned = []
        for b in self.beams:
            ban = ngram_bans(b.tokens, p.no_repeat_ngram) if p.no_repeat_ngram else []
            if len(b.out) < p.min_new_tokens:
                ban = ban + sorted(self.end_ids)
            banned.append(ban)
        if self.head is not None:
            return fused_topk(self.model.dec.head_input(h), *self.head, k, banned)
        return naive_topk(h, self.model.logits, k, banned)

    def _select(
        self, src: int, rows: list[int], logp: torch.Tensor, toks: torch.Tensor, last: bool
    ) -> list[tuple[int, _Beam]]:
        """Input ``src``'s next beams from its live rows' candidates: (parent row, beam)."""
        W = self.params.beam_width
        beams = [self.beams[r] for r in rows]
        total = (torch.tensor([b.logprob for b in beams])[:, None] + logp[rows]).flatten()
        values, flat = total.topk(min(2 * W, total.numel()))
        per_row = toks.shape[1]
        ranked = [
            (f // per_row, int(toks[rows[f // per_row], f % per_row]), v)
            for v, f in zip(values.tolist(), flat.tolist(), strict=True)
        ]
        picks = self.states[src].choose(ranked, [b.out for b in beams], self.end_ids, last)
        return [
            (rows[i], _Beam(src, [*beams[i].tokens, t], [*beams[i].out, t], v)) for i, t, v in picks
        ]

    def run(self) -> list[list[Hypothesis]]:
        with torch.inference_mode():
            h = self._forward([b.tokens for b in self.beams])
            for step in range(self.max_new):
                logp, toks = self._candidates(h, 2 * self.params.beam_width)
                by_src: dict[int, list[int]] = {}
                for r, b in enumerate(self.beams):
                    by_src.setdefault(b.src, []).append(r)
                nxt: list[tuple[int, _Beam]] = []
                for src, rows in by_src.items():
                    state = self.states[src]
                    if not state.done:
                        picks = self._select(src, rows, logp, toks, step == self.max_new - 1)
                        if not state.done:
                            nxt += picks
                            continue
                    if not self.drop_finished:  # a static batch: the rows of a finished
                        nxt += [(r, self.beams[r]) for r in rows]  # input compute, unused
                if all(s.done for s in self.states):
                    break
                self.cache.select(torch.tensor([r for r, _ in nxt], dtype=torch.long))
                self.beams = [b for _, b in nxt]
                h = self._forward([b.tokens[-1:] for b in self.beams])
        return [s.finished[: self.params.num_return] for s in self.states]


def beam_search(
    model: nn.Module,
    inputs: list[list[int]],
    params: SearchParams,
    end_ids: set[int] | tuple[int, ...] = (),
    fused: bool = True,
    drop_finished: bool = True,
    stats: SearchStats | None = None,
) -> list[list[Hypothesis]]:
    """For each input (an encoder-decoder's source, or a decoder-only prompt), its
    ``num_return`` best hypotheses (generated tokens, summed log-probability). ``end_ids``
    default to the checkpoint's end token; ``stats`` (if given) counts the work done."""
    if not inputs:
        return []
    if not end_ids and model.spec.hparams.eos_id is not None:
        end_ids = (model.spec.hparams.eos_id,)
    search = _Search(
        model, inputs, params, set(end_ids), fused, drop_finished, stats or SearchStats()
    )
    return search.run()
