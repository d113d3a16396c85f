"""Beam search inside the continuous-batching engine.

A beam request starts as one sequence; after its prompt, each step takes the top 2W (beam,
token) continuations by summed log-probability over all live beams (W = beam_width), keeps the
first W that do not end the sequence, and moves those ending in an end token within the top W
to the finished hypotheses (the best W are kept). A kept continuation reuses its parent's
sequence the first time, and forks the parent's KV blocks (shared, copy-on-write) for every
further child; parents with no child are released. The request's logits processors (penalties,
bias, end tokens banned below min_new_tokens) act on each beam's log-probabilities, as in
transformers' beam search. Each beam waits (nothing to compute) until all of its group's beams have logits.

At the last step (max_new_tokens or the context reached) every candidate ranked among the top W
finishes, ended or not. The search ends when W hypotheses have finished (transformers'
``early_stopping=True``) or after that last step; the n best by ``logprob / len **
length_penalty`` (len counts the generated tokens, end token included) are returned, all at
the end — beam outputs are not streamed, since a prefix can still lose to another beam.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from inferflow.engine.kv_cache import PagedKVCache
from inferflow.engine.request import FINISHED, Request, RequestOutput
from inferflow.engine.scheduler import Scheduler


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]
    logprob: float
    ended: bool  # with an end token (finish reason "stop"), else cut at the length limit

    def score(self, length_penalty: float) -> float:
        return self.logprob / max(1, len(self.tokens)) ** length_penalty


@dataclass
class BeamState:
    width: int
    length_penalty: float
    # False: after W finished, go on while the best live beam, at its current length, would
    # still beat the worst finished one (transformers' early_stopping=False heuristic)
    early_stopping: bool = True
    finished: list[Hypothesis] = field(default_factory=list)
    best_live: float = float("-inf")  # score of the best live beam after the last step

    def select(
        self,
        outputs: list[list[int]],
        scores: list[float],
        logprobs: list[torch.Tensor],
        end_ids: set[int],
        last: bool,
    ) -> list[tuple[int, int, float]]:
        """From each beam's (processed) next-token log-probabilities: (parent beam, token, summed
        logprob) of the next live beams, best first. A candidate ranked among the top W that
        ends in an end token (or any, at the ``last`` step) becomes a finished hypothesis."""
        total = torch.stack(logprobs) + torch.tensor(scores, dtype=torch.float32)[:, None]
        vocab = total.shape[1]
        values, flat = torch.topk(total.flatten(), min(2 * self.width, total.numel()))
        ranked = [
            (*divmod(f, vocab), v) for v, f in zip(values.tolist(), flat.tolist(), strict=True)
        ]
        return self.choose(ranked, outputs, end_ids, last)

    def choose(
        self,
        ranked: list[tuple[int, int, float]],
        outputs: list[list[int]],
        end_ids: set[int],
        last: bool,
    ) -> list[tuple[int, int, float]]:
        """``select`` from candidates already ranked best first: (parent, token, summed logprob)."""
        picks = []
        for rank, (parent, tok, v) in enumerate(ranked):
            ended = tok in end_ids
            if ended or last:
                if rank < self.width:
                    self._finish(Hypothesis([*outputs[parent], tok], v, ended))
                continue
            picks.append((parent, tok, v))
            if len(picks) == self.width:
                break
        self.best_live = float("-inf")
        if picks:
            parent, _, v = picks[0]
            self.best_live = v / (len(outputs[parent]) + 1) ** self.length_penalty
        return picks

    def _finish(self, h: Hypothesis) -> None:
        self.finished.append(h)  # the best W are kept
        self.finished.sort(key=lambda x: x.score(self.length_penalty), reverse=True)
        del self.finished[self.width :]

    @property
    def done(self) -> bool:
        if len(self.finished) < self.width:
            return False
        if self.early_stopping:
            return True
        return self.best_live <= self.finished[-1].score(self.length_penalty)


class BeamSteps:
    """The engine's beam-search steps (``Engine`` mixes them in and holds what they use)."""

    requests: dict[str, list[Request]]
    beams: dict[str, BeamState]
    scheduler: Scheduler
    cache: PagedKVCache
    tokenizer: object | None
    eos_ids: set[int]
    max_len: int
    _ids: Iterator[int]

    def _finish(self, req: Request, reason: str) -> None:
        raise NotImplementedError

    def _beam_step(self, gid: str) -> list[RequestOutput]:
        """Once every live beam of the group has logits: choose the next beams (reusing or
        forking their parents' blocks), or end the search with its n best hypotheses."""
        group, state = self.requests[gid], self.beams[gid]
        live = [r for r in group if r.status != FINISHED]
        if any(r.pending is None for r in live):
            return []  # siblings still computing (chunked prefill, preemption)
        p, head = live[0].params, live[0]  # all live beams have the same length
        last = len(head.output_ids) + 1 >= p.max_new_tokens or len(head.tokens) + 1 >= self.max_len
        picks = state.select(
            [r.output_ids for r in live],
            [r.beam_logprob for r in live],
            [
                r.sampler.process(torch.log_softmax(r.pending, -1), r.prompt_ids, r.output_ids)
                for r in live
            ],
            set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids),
            last,
        )
        if last or state.done:
            for r in live:
                self._prune(r)
            return self._end_beams(gid)
        children, used = [], set()
        for parent, tok, score in picks:  # fork before any parent takes its own token
            child = live[parent] if parent not in used else self._fork_beam(live[parent])
            used.add(parent)
            children.append((child, tok, score))
        for i, r in enumerate(live):
            r.pending = None
            if i not in used:  # no child: its blocks go back
                self._prune(r)
        for child, tok, score in children:
            child.output_ids.append(tok)
            child.beam_logprob = score
            if child not in group:
                group.append(child)
                self.scheduler.join(child)
        return []

    def _prune(self, beam: Request) -> None:
        self.scheduler.remove(beam)
        self._finish(beam, "pruned")

    def _fork_beam(self, parent: Request) -> Request:
        return Request(
            f"{parent.group}/b{next(self._ids)}",
            parent.prompt_ids,
            parent.params,
            parent.arrival,
            parent.sampler,
            list(parent.output_ids),
            self.cache.fork(parent.kv),
            group=parent.group,
            beam_logprob=parent.beam_logprob,
        )

    def _end_beams(self, gid: str) -> list[RequestOutput]:
        """The n best finished hypotheses, as the group's final outputs (and requests)."""
        state, group = self.beams.pop(gid), self.requests[gid]
        first = group[0]
        results, outs = [], []
        for i, h in enumerate(state.finished[: first.params.n]):  # best first
            reason = "stop" if h.ended else "length"
            shown = h.tokens[:-1] if h.ended else h.tokens
            text = self.tokenizer.decode(shown) if self.tokenizer is not None else ""  # type: ignore[attr-defined]
            results.append(
                Request(
                    gid,
                    first.prompt_ids,
                    first.params,
                    first.arrival,
                    first.sampler,
                    list(h.tokens),
                    status=FINISHED,
                    finish_reason=reason,
                    text=text,
                    group=gid,
                    index=i,
                    beam_logprob=h.logprob,
                )
            )
            outs.append(RequestOutput(gid, list(h.tokens), text, True, reason, index=i))
        group[:] = results  # what generate() returns for this prompt
        return outs
