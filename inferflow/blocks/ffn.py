"""Feed-forward blocks: ``gated`` (act(x W1) * x W3, then W2 — SwiGLU / GeGLU) and ``plain``.

Canonical names follow llama: w1 = gate (or the up projection of a plain FFN), w3 = up,
w2 = down. The gated block fuses w1 and w3 into one ``w13`` parameter ([w1; w3] rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from inferflow import kernels
from inferflow.blocks.activation import Activation
from inferflow.blocks.linear import Linear
from inferflow.blocks.options import NoOptions, Options
from inferflow.blocks.split import WHOLE, TensorSplit
from inferflow.registry import Registry

if TYPE_CHECKING:
    from inferflow.spec.types import HParams


@dataclass(frozen=True)
class FFNArgs:
    """What an FFN block is built from: widths, activation, biases, the stack's hparams and
    the block's own options (its class's ``Options``, parsed from ``network.ffn``)."""

    hidden: int
    inner: int
    act: Activation
    bias: bool
    h: HParams
    options: Options = NoOptions()


class GatedFFN(nn.Module):
    """With a tensor-parallel ``split``: this rank's inner units (inferflow.blocks.split)."""

    Options = NoOptions

    def __init__(self, args: FFNArgs, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.full, self.split = args.inner, split
        self.inner, self.act = args.inner // split.size, args.act
        self.w13 = Linear(args.hidden, 2 * self.inner, bias=args.bias)
        self.w2 = Linear(self.inner, args.hidden, bias=args.bias)

    def shard_rows(self, shard: str) -> slice:
        return {"w1": slice(0, self.inner), "w3": slice(self.inner, 2 * self.inner)}[shard]

    def take_slice(self, child: str, leaf: str, shard: str | None, t: torch.Tensor) -> torch.Tensor:
        if self.split.size == 1:
            return t
        part, F = self.split.part(self.full), self.full
        if child == "w2":
            return self.split.row_parallel(leaf, t, part)
        return t[part] if shard is not None else torch.cat([t[:F][part], t[F:][part]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = max(1, PASS_BYTES // (2 * self.inner * x.element_size()))
        if x.dim() != 2 or x.shape[0] <= step:
            return self._rows(x)
        # many rows (a prompt): a few at a time, each row's operations unchanged
        return torch.cat([self._rows(x[i : i + step]) for i in range(0, x.shape[0], step)])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w13(x)
        if self.act is F.silu and h.dim() == 2 and kernels.cpu_float32(h):
            fn = kernels.silu_gate()  # (the one-call decode's gate: the same bits)
            if fn is not None:
                return self.w2(fn(h))
        return self.w2(self.act(h[:, : self.inner]) * h[:, self.inner :])


# The gated hidden rows (2 x inner values a row) one pass of GatedFFN holds: a few MiB stay in
# the CPU's caches between W13, the gate and W2, and stay below glibc's 32 MiB mmap ceiling,
# past which every call's output is fresh pages (Qwen2.5-1.5B's 512 prompt rows: 37 MB; W13 at
# 480 rows took 34 ms against 23 ms at 464).
PASS_BYTES = 8 << 20


class PlainFFN(nn.Module):
    Options = NoOptions

    def __init__(self, args: FFNArgs, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.act, self.full, self.split = args.act, args.inner, split
        self.w1 = Linear(args.hidden, args.inner // split.size, bias=args.bias)
        self.w2 = Linear(args.inner // split.size, args.hidden, bias=args.bias)

    def take_slice(self, child: str, leaf: str, shard: str | None, t: torch.Tensor) -> torch.Tensor:
        if self.split.size == 1:
            return t
        part = self.split.part(self.full)
        return self.split.row_parallel(leaf, t, part) if child == "w2" else t[part]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


FFNS: Registry[type[nn.Module]] = Registry("ffn")
FFNS.add("gated", GatedFFN)
FFNS.add("plain", PlainFFN)
