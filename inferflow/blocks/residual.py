"""Residual wiring of one transformer layer: where the norms sit and how branches combine.

A wiring is data (the norms it needs) plus a forward function; ``attn(h)`` and ``ffn(h)`` are
the layer's two branches;
``n`` is the layer module holding the norms by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inferflow.blocks.options import Options
from inferflow.registry import Registry

Branch = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Wiring:
    norms: tuple[str, ...]
    forward: Callable[..., torch.Tensor]  # (n, x, attn, ffn, cross=None) -> x
    cross: bool = False  # takes a cross-attention branch (``cross_norm``) between attn and ffn
    # parallel wirings: (n, x, attn, ffn) -> the update added to x; tensor parallelism sums it
    # across ranks in one all-reduce per layer instead of one per branch
    delta: Callable[..., torch.Tensor] | None = None


RESIDUALS: Registry[Wiring] = Registry("residual")


@dataclass(frozen=True)
class GateOptions(Options):
    """``network.gates``: learned scalars on a layer's residual stream (nanochat /
    modded-nanogpt style), each a parameter of the layer."""

    branches: bool = field(
        default=False,
        metadata={
            "doc": "each branch's output times a learned scalar before it is added "
            "(attn_gate, ffn_gate)"
        },
    )
    embedding_skip: bool = field(
        default=False,
        metadata={
            "doc": "each layer's input is mix[0] * x + mix[1] * x0, x0 the embedding output "
            "(mix: 2 learned scalars)"
        },
    )


def _pre(
    n: Any, x: torch.Tensor, attn: Branch, ffn: Branch, cross: Branch | None = None
) -> torch.Tensor:
    h = x + attn(n.attn_norm(x))
    if cross is not None:
        h = h + cross(n.cross_norm(h))
    return h + ffn(n.ffn_norm(h))


def _post(
    n: Any, x: torch.Tensor, attn: Branch, ffn: Branch, cross: Branch | None = None
) -> torch.Tensor:
    # original Transformer / BERT / BART: normalize after each residual add
    h = n.attn_norm(x + attn(x))
    if cross is not None:
        h = n.cross_norm(h + cross(h))
    return n.ffn_norm(h + ffn(h))


def _parallel_delta(n: Any, x: torch.Tensor, attn: Branch, ffn: Branch) -> torch.Tensor:
    # GPT-NeoX / GPT-J: both branches read x, each through its own norm
    return attn(n.attn_norm(x)) + ffn(n.ffn_norm(x))


def _parallel_shared_delta(n: Any, x: torch.Tensor, attn: Branch, ffn: Branch) -> torch.Tensor:
    # Phi / Falcon-7B: one norm feeds both branches
    h = n.attn_norm(x)
    return attn(h) + ffn(h)


def _adding(delta: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda n, x, attn, ffn: x + delta(n, x, attn, ffn)


def _sandwich(n: Any, x: torch.Tensor, attn: Branch, ffn: Branch) -> torch.Tensor:
    # Gemma 2/3: a norm before and after each branch
    h = x + n.post_attn_norm(attn(n.attn_norm(x)))
    return h + n.post_ffn_norm(ffn(n.ffn_norm(h)))


RESIDUALS.add("pre_norm", Wiring(("attn_norm", "ffn_norm"), _pre, cross=True))
RESIDUALS.add("post_norm", Wiring(("attn_norm", "ffn_norm"), _post, cross=True))
RESIDUALS.add(
    "parallel",
    Wiring(("attn_norm", "ffn_norm"), _adding(_parallel_delta), delta=_parallel_delta),
)
RESIDUALS.add(
    "parallel_shared_norm",
    Wiring(("attn_norm",), _adding(_parallel_shared_delta), delta=_parallel_shared_delta),
)
RESIDUALS.add(
    "sandwich", Wiring(("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm"), _sandwich)
)
