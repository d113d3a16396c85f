"""Sampling parameters and a sampler built once per request (temperature, top-k, top-p, seed).

The continuous-batching engine extends this with the remaining strategies; the contract stays:
``make_sampler(params)`` returns a callable from float32 logits (V,) to a token id.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inferflow.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature: must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k: must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")


Sampler = Callable[[torch.Tensor], int]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest top-p nucleus."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    return logits


def make_sampler(params: SamplingParams) -> Sampler:
    if params.temperature == 0:
        return lambda logits: int(torch.argmax(logits))
    gen = torch.Generator()
    gen.manual_seed(
        params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    )

    def sample(logits: torch.Tensor) -> int:
        x = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    return sample
