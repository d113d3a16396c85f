"""Request state and the records passed between the engine's stages (plain dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferflow.engine.kv_cache import SeqBlocks
from inferflow.engine.sampling import Sampler, SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)  # identity: the scheduler's lists hold distinct requests
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    sampler: Sampler
    output_ids: list[int] = field(default_factory=list)
    kv: SeqBlocks = field(default_factory=SeqBlocks)
    status: str = WAITING
    started: bool = False  # has run (a preempted request waits again, already admitted)
    cached_tokens: int = 0  # prompt tokens the prefix cache served at its first admission
    finish_reason: str | None = None
    detok: Any = None  # incremental decoder when the engine has a tokenizer
    text: str = ""  # decoded output so far
    shown: int = 0  # characters of ``text`` already emitted (the rest may start a stop string)
    group: str = ""  # the id the caller knows (several requests share it when n > 1)
    index: int = 0  # which of the group's n samples
    forks: list[Request] = field(default_factory=list)  # siblings waiting for this prefill
    beam_logprob: float = 0.0  # beam search: summed logprob of output_ids
    pending: Any = None  # beam search: logits waiting for the rest of the group
    constraint: Any = None  # structured output: the sample's grammar matcher (constrain)
    draft: Any = None  # speculative decoding: tokens proposed for this step (speculative.Draft)

    @property
    def slots(self) -> int:
        """Running slots this request takes when admitted (its samples, or all its beams)."""
        if self.params.beam_width > 1 and not self.output_ids:
            return self.params.beam_width
        return 1 + len(self.forks)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class Scheduled:
    """``length`` tokens of ``req`` from position ``start`` run this step; ``sample`` when they
    reach the end of its known tokens (otherwise it is a prefill chunk)."""

    req: Request
    start: int
    length: int
    sample: bool


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new this step
    text: str  # new text this step (stop strings and end tokens are not shown)
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    prompt_token_ids: list[int] | None = None
    # with SamplingParams.logprobs: per new token, its logprob and the top-n (id, logprob) pairs
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # which of the request's n samples (SamplingParams.n)
    # with the first output of a sample (prompt_token_ids set): prompt tokens whose K/V came
    # from the prefix cache instead of being computed
    cached_tokens: int = 0
    error: str | None = None  # finish reason "error" caused by the request itself: why


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # log-softmax of the model's raw logits (before penalties / temperature)
    top: list[tuple[int, float]]
