"""VAR-STREAM: streaming variable-width beam search over an offline batch of inputs (Yang et al.
2020, "A Streaming Approach For Efficient Batched Beam Search"): ``stream_search(model, inputs,
params, refill=EPS, batch_size=B)``.

Inputs wait in a queue; whenever the live beams drop to at most EPS x n (n = B x W, W = beam
width), new inputs join (their sources encoded in one pass) until n beams are live again, each
joining with one beam. Each step expands every live beam of the smallest hypothesis length, and
only those, so a step batches beams of one length; longer inputs wait until the newcomers catch
up. As the newcomers widen (up to W beams each) a step grows past n beams, up to W x n: at most n
inputs are in the batch, each with at most W beams, which is also the most rows the cache holds.
A static batch instead runs until its slowest input is done, its last steps nearly empty.

Every decision of an input (candidates, pruning, finished hypotheses, its length limit) depends
on that input alone (``inferflow.engine.search.Decoding``), so the hypotheses are those of
``beam_search`` with the same parameters on the same inputs; only the grouping of rows into
steps differs. Floating point can still see the grouping: a GEMM may round a row differently
with another number of rows, which could only flip an exact near-tie (see tests/test_var_stream.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator

import torch

from inferflow.engine.beam import BeamState, Hypothesis
from inferflow.engine.search import (
    Beam,
    Decoding,
    SearchParams,
    SearchStats,
    StopCheck,
    Turn,
    check_stop,
    default_end_ids,
    input_runs,
)
from inferflow.errors import RequestError
from inferflow.model.network import Network

log = logging.getLogger(__name__)


def check_stream_args(refill: float | None, batch_size: int) -> None:
    """A search's ``refill`` (None: not streaming) and ``batch_size``."""
    if refill is not None and not 0.0 <= refill <= 1.0:  # NaN too
        raise RequestError(f"refill: must be in [0, 1], got {refill}")
    if batch_size < 1:
        raise RequestError(f"batch_size: must be at least 1, got {batch_size}")


class _Stream:
    def __init__(
        self,
        model: Network,
        inputs: list[list[int]],
        params: SearchParams,
        end_ids: set[int],
        refill: float,
        batch_size: int,
        fused: bool,
        stats: SearchStats,
        stop: StopCheck | None = None,
    ) -> None:
        self.inputs, self.params, self.stats, self.stop = inputs, params, stats, stop
        self.core = Decoding(model, params, end_ids, fused, stats)
        self.limits = self.core.limits(inputs)  # every input checked before anything runs
        self.queue = deque(range(len(inputs)))
        self.capacity = batch_size * params.beam_width  # n, in beams
        self.low = refill * self.capacity
        self.beams: list[Beam] = []  # live beams, an input's together
        self.rows: list[int] = []  # each beam's cache row
        self.states: dict[int, BeamState] = {}
        self.cache = self.core.new_cache(inputs, self.limits, self.capacity)

    def _admit(self) -> None:
        """Refill, once few beams are live: new inputs until n beams are live again (an input
        joins with one beam, its start)."""
        live = len(self.beams)
        n = min(len(self.queue), self.capacity - live)
        if n <= 0 or live > self.low:  # (low >= 0: an empty batch refills while inputs wait)
            return
        srcs = [self.queue.popleft() for _ in range(n)]
        self.beams += self.core.start(srcs, self.inputs)
        self.rows += self.cache.new_rows(n)
        for s in srcs:
            self.states[s] = self.core.new_state()
        self.stats.refills += 1
        log.debug("refill: %d inputs join %d live beams", n, live)

    def _group(self) -> list[int]:
        """Places in ``beams`` of the next step's beams: every beam of the smallest hypothesis
        length (an input's live beams have one length)."""
        shortest = min(len(b.out) for b in self.beams)
        return [i for i, b in enumerate(self.beams) if len(b.out) == shortest]

    def _expand(self, places: list[int]) -> list[tuple[int, list[Hypothesis]]]:
        """One step over the beams at ``places``: the inputs that are over, with their
        hypotheses."""
        beams = [self.beams[i] for i in places]
        rows = [self.rows[i] for i in places]
        h = self.core.forward(self.cache.step(rows), beams, first=not beams[0].out)
        logp, toks = self.core.candidates(beams, h)
        runs = input_runs(beams)
        turns = [Turn(self.states[s], [beams[r] for r in at], at, self.limits[s]) for s, at in runs]
        parents: list[int] = []  # the children's parents' rows
        children: list[Beam] = []
        over: list[tuple[int, list[Hypothesis]]] = []
        for (src, at), picks in zip(runs, self.core.select(turns, logp, toks), strict=True):
            if not picks:
                state = self.states.pop(src)
                self.core.release(src)
                over.append((src, state.finished[: self.params.num_return]))
            parents += [rows[at[i]] for i, _ in picks]
            children += [b for _, b in picks]
        # the waiting beams keep their order; the children join behind them
        stepped = set(places)
        waiting = [i for i in range(len(self.beams)) if i not in stepped]
        new_rows = self.cache.fork(rows, parents)
        self.beams = [self.beams[i] for i in waiting] + children
        self.rows = [self.rows[i] for i in waiting] + new_rows
        return over

    def run(self) -> Iterator[tuple[int, list[Hypothesis]]]:
        while self.queue or self.beams:
            check_stop(self.stop)
            with torch.inference_mode():  # not held across a yield: the caller's code runs outside
                self._admit()
                over = self._expand(self._group())
            yield from over


def iter_stream_search(
    model: Network,
    inputs: list[list[int]],
    params: SearchParams,
    end_ids: set[int] | tuple[int, ...] = (),
    refill: float = 0.5,
    batch_size: int = 32,
    fused: bool = True,
    stats: SearchStats | None = None,
    stop: StopCheck | None = None,
) -> Iterator[tuple[int, list[Hypothesis]]]:
    """(input index, its best hypotheses) as each input finishes, in finishing order;
    ``stop`` as in ``beam_search``."""
    check_stream_args(refill, batch_size)
    if not inputs:
        return iter(())
    stream = _Stream(
        model,
        inputs,
        params,
        default_end_ids(model, end_ids),
        refill,
        batch_size,
        fused,
        stats or SearchStats(),
        stop,
    )
    return stream.run()


def stream_search(
    model: Network,
    inputs: list[list[int]],
    params: SearchParams,
    end_ids: set[int] | tuple[int, ...] = (),
    refill: float = 0.5,
    batch_size: int = 32,
    fused: bool = True,
    stats: SearchStats | None = None,
    stop: StopCheck | None = None,
) -> list[list[Hypothesis]]:
    """``beam_search``'s result (same hypotheses, same order) computed streaming: refilled with
    waiting inputs up to ``batch_size`` x beam width live beams whenever the live beams drop to
    ``refill`` x that (0 <= refill <= 1), each step expanding the beams of the smallest length."""
    out: list[list[Hypothesis]] = [[] for _ in inputs]
    for i, hyps in iter_stream_search(
        model, inputs, params, end_ids, refill, batch_size, fused, stats, stop
    ):
        out[i] = hyps
    return out
