"""Rope frequency scalings by name (``network.position.scaling.type`` and the checkpoint's
``rope_scaling``): each maps the base inverse frequencies to scaled ones and an attention factor,
following transformers' ``modeling_rope_utils`` (the tests' reference)."""

from __future__ import annotations

import math
from typing import Any

import torch

from inferflow.registry import Registry

ROPE_SCALINGS: Registry[Any] = Registry("rope scaling")


def scaling_schema() -> dict[str, Any]:
    """The JSON Schema of a ``scaling`` option (its type: a registered name)."""
    num = {"type": "number"}
    props: dict[str, Any] = {
        "type": {"enum": ROPE_SCALINGS.names()},
        "factor": num,
        "low_freq_factor": num,
        "high_freq_factor": num,
        "original_max_positions": {"type": "integer"},
        "beta_fast": num,
        "beta_slow": num,
        "attention_factor": num,
        "mscale": num,
        "mscale_all_dim": num,
        "truncate": {"type": "boolean"},
    }
    return {
        "type": "object",
        "properties": props,
        "required": ["type"],
        "additionalProperties": False,
    }


@ROPE_SCALINGS.register("linear")
def _linear(
    inv: torch.Tensor, opts: dict[str, Any], dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    return inv / float(opts["factor"]), 1.0


@ROPE_SCALINGS.register("llama3")
def _llama3(
    inv: torch.Tensor, opts: dict[str, Any], dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    # Llama 3.1's frequency-dependent interpolation (as in HF _compute_llama3_parameters)
    factor = float(opts["factor"])
    low, high = float(opts.get("low_freq_factor", 1.0)), float(opts.get("high_freq_factor", 4.0))
    old_ctx = float(opts["original_max_positions"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled), 1.0


@ROPE_SCALINGS.register("yarn")
def _yarn(
    inv: torch.Tensor, opts: dict[str, Any], dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    # YaRN: blend interpolated and extrapolated frequencies by a ramp over the correction range
    factor = float(opts["factor"])
    old_ctx = float(opts["original_max_positions"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = opts.get("attention_factor")
    if att is None:
        if opts.get("mscale") and opts.get("mscale_all_dim"):
            att = mscale(factor, opts["mscale"]) / mscale(factor, opts["mscale_all_dim"])
        else:
            att = mscale(factor)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = corr_dim(float(opts.get("beta_fast", 32))), corr_dim(float(opts.get("beta_slow", 1)))
    if opts.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extra = 1 - ramp
    return (inv / factor) * (1 - extra) + inv * extra, float(att)
