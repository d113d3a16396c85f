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

from dataclasses import dataclass, field

import torch


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
