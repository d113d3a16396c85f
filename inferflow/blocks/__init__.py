"""Atomic blocks; importing this package registers every name a spec's network may use."""

from inferflow.blocks.activation import ACTIVATIONS
from inferflow.blocks.attention import ATTN_BIAS, QKV_LAYOUTS, Attention, AttnArgs, CrossAttention
from inferflow.blocks.ffn import FFNS, FFNArgs
from inferflow.blocks.head import HEADS
from inferflow.blocks.moe import MoEFFN
from inferflow.blocks.norm import NORMS
from inferflow.blocks.position import (
    POSITIONS,
    ROPE_PAIRINGS,
    SINUSOIDAL_VARIANTS,
    PositionArgs,
)
from inferflow.blocks.residual import RESIDUALS
from inferflow.blocks.rope_scaling import ROPE_SCALINGS

__all__ = [
    "ACTIVATIONS",
    "ATTN_BIAS",
    "FFNS",
    "FFNArgs",
    "HEADS",
    "MoEFFN",
    "NORMS",
    "POSITIONS",
    "QKV_LAYOUTS",
    "RESIDUALS",
    "ROPE_PAIRINGS",
    "ROPE_SCALINGS",
    "SINUSOIDAL_VARIANTS",
    "Attention",
    "AttnArgs",
    "CrossAttention",
    "PositionArgs",
]
