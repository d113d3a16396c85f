"""Normalization blocks: ``layer``, ``rms`` and ``rms_offset`` (scale by 1 + w, Gemma's HF layout),
and the variants without learned parameters: ``layer_nobias`` (weight only), ``layer_plain`` and
``rms_plain`` (neither weight nor bias: OLMo's LayerNorm, nanochat-style RMSNorm).

Statistics are computed in float32 whatever the activation dtype, as the reference
implementations do, then cast back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from inferflow import kernels
from inferflow.registry import Registry

NormFactory = Callable[[int, float], nn.Module]
NORMS: Registry[NormFactory] = Registry("norm")


@NORMS.register("rms")
class RMSNorm(nn.Module):
    offset = 0.0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """The C kernel's case: 2-D contiguous float32 rows as wide as the weight, on the CPU, no
        autograd (anything else goes to torch, which also raises on a mismatch)."""
        w = self.weight
        return x.dim() == 2 and x.shape[1] == w.numel() and kernels.cpu_float32(x, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not self.offset:  # one fused op (same math in float32)
            fn = kernels.rms_norm() if self._kernel_takes(x) else None
            if fn is not None:
                return fn(x, self.weight, self.eps)
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


@NORMS.register("rms_offset")
class RMSNormOffset(RMSNorm):
    """Gemma's HF checkpoints store w - 1 (GGUF conversion adds the 1 back: use ``rms`` there)."""

    offset = 1.0


@NORMS.register("layer")
class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps
        ).to(x.dtype)


@NORMS.register("layer_nobias")
class LayerNormNoBias(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), None, self.eps
        ).to(x.dtype)


class _PlainNorm(nn.Module):
    """A norm without learned parameters: only its epsilon."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps


@NORMS.register("layer_plain")
class LayerNormPlain(_PlainNorm):
    """LayerNorm without a learned weight or bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)


@NORMS.register("rms_plain")
class RMSNormPlain(_PlainNorm):
    """RMSNorm without a learned weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
