"""Feed-forward blocks: ``gated`` (act(x W1) * x W3, then W2 — SwiGLU / GeGLU) and ``plain``.

Canonical names follow llama: w1 = gate (or the up projection of a plain FFN), w3 = up,
w2 = down. The gated block fuses w1 and w3 into one ``w13`` parameter ([w1; w3] rows).
"""

from __future__ import annotations

import torch
from torch import nn

from inferflow.blocks.activation import Activation
from inferflow.blocks.linear import Linear
from inferflow.registry import Registry


class GatedFFN(nn.Module):
    def __init__(self, hidden: int, inner: int, act: Activation, bias: bool) -> None:
        super().__init__()
        self.inner, self.act = inner, act
        self.w13 = Linear(hidden, 2 * inner, bias=bias)
        self.w2 = Linear(inner, hidden, bias=bias)

    def shard_rows(self, shard: str) -> slice:
        return {"w1": slice(0, self.inner), "w3": slice(self.inner, 2 * self.inner)}[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w13(x)
        return self.w2(self.act(h[:, : self.inner]) * h[:, self.inner :])


class PlainFFN(nn.Module):
    def __init__(self, hidden: int, inner: int, act: Activation, bias: bool) -> None:
        super().__init__()
        self.act = act
        self.w1 = Linear(hidden, inner, bias=bias)
        self.w2 = Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


FFNS: Registry[type[nn.Module]] = Registry("ffn")
FFNS.add("gated", GatedFFN)
FFNS.add("plain", PlainFFN)
