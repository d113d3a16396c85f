"""Position blocks: ``rope``, ``alibi``, ``sinusoidal``, ``learned`` and ``none``.

Every block answers three questions for the attention layers (a block that does not take part
in one answers with identity / None):
- ``embed(positions)``: an absolute embedding added to the token embeddings, (N, hidden);
- ``rotate(q, k, positions)``: rotary encoding of q (N, H, D) and k (N, KVH, D); ``rotate_``
  does it in place where it can (rope: a C kernel);
- ``bias(q_pos, k_pos)``: an additive attention bias (H, Tq, Tk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from inferflow import kernels
from inferflow.blocks.options import NoOptions
from inferflow.blocks.options import Options as _Options
from inferflow.blocks.rope_scaling import ROPE_SCALINGS, scaling_schema
from inferflow.errors import SpecError
from inferflow.registry import Registry


@dataclass(frozen=True)
class PositionArgs:
    """What a position block may need: the stack's numbers (hparams) and the block's own options
    (its class's ``Options``, parsed from the spec's ``network.position`` entry)."""

    hidden: int  # the width of an embedding table (a factorised embedding's)
    n_heads: int
    head_dim: int
    max_positions: int
    options: _Options = NoOptions()
    theta: float = 10000.0  # hparams.rope_theta
    rotary_dim: int = 0  # hparams.rotary_dim (0: head_dim)
    scaling: dict[str, Any] | None = None  # hparams.rope_scaling
    buckets: int = 32  # hparams.rel_buckets
    max_distance: int = 128  # hparams.rel_max_distance
    bidirectional: bool = False  # an encoder's stack


@dataclass(frozen=True)
class RopeOptions(_Options):
    pairing: Literal["half", "adjacent"] = field(
        default="half",
        metadata={
            "doc": "half: dims i and i + d/2 rotate together (HF); adjacent: 2i and 2i + 1 (GPT-J, llama GGUF files)"
        },
    )
    direction: Literal["forward", "reverse"] = field(
        default="forward", metadata={"doc": "reverse: rotate by -angle"}
    )
    theta: float | None = field(
        default=None, metadata={"doc": "rope base (unset: hparams.rope_theta)"}
    )
    local_theta: float | None = field(
        default=None, metadata={"doc": "rope base of sliding-window layers (Gemma 3)"}
    )
    partial: float | None = field(
        default=None, metadata={"doc": "rotate this fraction of each head's dims"}
    )
    rotary_dim: int | None = field(
        default=None, metadata={"doc": "rotate this many dims of each head (unset: hparams)"}
    )
    scaling: dict[str, Any] | None = field(
        default=None,
        metadata={
            "doc": "{type: linear | llama3 | yarn, factor, ...} (unset: the checkpoint's)",
            "schema": scaling_schema,
        },
    )


@dataclass(frozen=True)
class LearnedOptions(_Options):
    offset: int = field(default=0, metadata={"doc": "position p reads row p + offset"})
    offset_in_table: bool = field(
        default=False,
        metadata={
            "doc": "the checkpoint's max_positions rows count the offset rows (RoBERTa, MPNet); "
            "false: they come on top (OPT)"
        },
    )


@dataclass(frozen=True)
class SinusoidalOptions(_Options):
    offset: int = field(default=0, metadata={"doc": "positions shifted (fairseq: padding_idx + 1)"})
    variant: Literal["fairseq", "paper"] = field(
        default="fairseq",
        metadata={"doc": "fairseq: frequencies 10000^(-i/(d/2-1)); paper: 10000^(-2i/d)"},
    )
    layout: Literal["halves", "interleaved"] = field(
        default="halves",
        metadata={
            "doc": "halves: [sin | cos] (fairseq, HF); interleaved: sin, cos, sin, cos, ... "
            "(the PyTorch tutorial's pe[:, 0::2] = sin, pe[:, 1::2] = cos)"
        },
    )


class PositionBlock(nn.Module):
    Options: type[_Options] = NoOptions  # the block's own options (its spec entry's keys)

    has_bias = False  # True for blocks whose bias() is not None
    # True for blocks that only add embed() to the first layer's input: the later stages of a
    # layer-split model leave them (and their weights) out; every other block is on every stage
    input_only = False
    # False where keep_heads cannot cut bias() per head: tensor parallelism refuses the block
    splits_heads = True

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        return None

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> bool:
        """``rotate`` in place where a block can (True), for callers that own q and k; False
        (nothing changed) where it cannot, and the caller takes ``rotate``'s copies."""
        return False

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return None

    def group_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """bias() of a decode step's sequences at once: q_pos (B,), k_pos (B, S) ->
        (B, H, 1, S); a block may answer in one op instead of one call per sequence."""
        if not self.has_bias:
            return None
        rows = [self.bias(q_pos[b : b + 1], k_pos[b]) for b in range(q_pos.shape[0])]
        return torch.stack(rows)  # type: ignore[arg-type]

    def keep_heads(self, heads: slice) -> None:
        """Tensor parallelism: bias() answers for these heads only (a no-op without a bias)."""


POSITIONS: Registry[type[PositionBlock]] = Registry("position")
ROPE_PAIRINGS = ("half", "adjacent")


@POSITIONS.register("none")
class NoPosition(PositionBlock):
    def __init__(self, args: PositionArgs) -> None:
        super().__init__()


class Positions(PositionBlock):
    """Several position mechanisms at once (``network.position`` as a list, e.g. MPNet's learned
    absolute table plus a relative attention bias): their embeddings add, their biases add, and
    at most one of them rotates. Children are named by their type (``pos_embed.learned``,
    ``pos_embed.relative``)."""

    def __init__(self, blocks: dict[str, PositionBlock]) -> None:
        super().__init__()
        for name, block in blocks.items():
            self.add_module(name, block)
        self.parts = list(blocks.values())
        rotating = [n for n, b in blocks.items() if type(b).rotate is not PositionBlock.rotate]
        if len(rotating) > 1:
            raise SpecError(
                f"network.position: {', '.join(rotating)} both rotate q and k; a stack allows "
                "at most one rotary mechanism"
            )
        # (lists: not registered a second time as children)
        self._rotary = [blocks[n] for n in rotating]
        self.has_bias = any(b.has_bias for b in self.parts)
        self.input_only = all(b.input_only for b in self.parts)
        self.splits_heads = all(b.splits_heads for b in self.parts)

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        out = [e for e in (b.embed(positions) for b in self.parts) if e is not None]
        return sum(out[1:], out[0]) if out else None

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary[0].rotate(q, k, positions) if self._rotary else (q, k)

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> bool:
        return bool(self._rotary) and self._rotary[0].rotate_(q, k, positions)

    def _sum(self, biases: list[torch.Tensor | None]) -> torch.Tensor | None:
        out = [b for b in biases if b is not None]
        return sum(out[1:], out[0]) if out else None

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return self._sum([b.bias(q_pos, k_pos) for b in self.parts])

    def group_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return self._sum([b.group_bias(q_pos, k_pos) for b in self.parts])

    def keep_heads(self, heads: slice) -> None:
        for b in self.parts:
            b.keep_heads(heads)


# --- rotary -------------------------------------------------------------------------------


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    # the int64 arange then float division follows HF's default rope init bit for bit
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@POSITIONS.register("rope")
class Rotary(PositionBlock):
    Options = RopeOptions

    """Rotary embedding on the first ``rotary_dim`` dims of each head.

    ``pairing: half`` rotates (i, i + d/2) (HF / GPT-NeoX layout); ``adjacent`` rotates
    (2i, 2i+1) (GPT-J layout, and llama GGUF files, whose q/k rows llama.cpp's converter permutes).
    """

    inv_freq: torch.Tensor

    def __init__(self, args: PositionArgs, local: bool = False) -> None:
        super().__init__()
        o = args.options if isinstance(args.options, RopeOptions) else RopeOptions()
        self.pairing = o.pairing
        # reverse: rotate by -angle (checkpoints trained with the other sign convention)
        self.direction = {"forward": 1.0, "reverse": -1.0}[o.direction]
        if self.pairing not in ROPE_PAIRINGS:
            raise SpecError(
                f"network.position.pairing: {self.pairing!r} is not one of: {', '.join(ROPE_PAIRINGS)}"
            )
        if o.rotary_dim:
            self.rotary_dim = int(o.rotary_dim)
        elif o.partial is not None:
            self.rotary_dim = round(args.head_dim * float(o.partial))
        else:
            self.rotary_dim = args.rotary_dim or args.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= args.head_dim:
            raise SpecError(
                f"network.position: rotary dim {self.rotary_dim} must be even and in 1..{args.head_dim}"
            )
        theta = o.local_theta if local else o.theta
        self.theta = float(theta if theta is not None else args.theta)
        inv = _inv_freq(self.rotary_dim, self.theta)
        self.att_scale = 1.0
        scaling = o.scaling if o.scaling is not None else args.scaling
        if scaling:
            fn = ROPE_SCALINGS.get(scaling["type"])
            inv, self.att_scale = fn(inv, scaling, self.rotary_dim, self.theta)
        self.register_buffer("inv_freq", inv, persistent=False)
        self._cached: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (N, rd/2)
        cos, sin = freqs.cos() * self.att_scale, freqs.sin() * (self.att_scale * self.direction)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]  # (N, 1, rd/2)

    def _rotate_one(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr, rest = x[..., :rd], x[..., rd:]
        if self.pairing == "half":
            x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def _angles(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # every layer of one forward rotates at the same positions: compute cos / sin once
        if self._cached is None or self._cached[0] is not positions or self._cached[1] != dtype:
            self._cached = (positions, dtype, *self.cos_sin(positions, dtype))
        return self._cached[2], self._cached[3]

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> bool:
        """The C kernel's in-place rotation, bit for bit ``rotate`` without its copies, where it
        runs: float32 on the CPU, no autograd, each head's dims contiguous, q and k not
        overlapping. q and k side by side in one row (the fused qkv projection's output) take
        one call."""
        N, H, D = q.shape
        if not all(
            t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad
            and t.dim() == 3 and t.shape[0] == N == positions.shape[0] and t.shape[2] == D
            and t.stride(2) == 1 and t.stride(1) == D
            for t in (q, k)
        ):  # fmt: skip
            return False  # (mismatched shapes: rotate raises the error)
        fn = kernels.rope_in_place()
        if fn is None:
            return False
        side_by_side = k.stride(0) == q.stride(0) and k.data_ptr() == q.data_ptr() + 4 * H * D
        if not side_by_side and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
            return False  # one buffer, not side by side: they might overlap
        cos, sin = self._angles(positions, torch.float32)
        c, s, pairs = cos[:, 0], sin[:, 0], self.pairing == "adjacent"
        if side_by_side:
            fn(q.as_strided((N, H + k.shape[1], D), q.stride()), c, s, pairs)
        else:
            fn(q, c, s, pairs)
            fn(k, c, s, pairs)
        return True

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._angles(positions, q.dtype)
        qk = self._rotate_one(torch.cat((q, k), dim=1), cos, sin)  # (N, H + KVH, D): one pass
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]


# --- additive biases and absolute embeddings ----------------------------------------------


def alibi_slopes(n_heads: int) -> torch.Tensor:
    # geometric slopes of the ALiBi paper, with the interleaved extra heads for non-powers of 2
    p2 = 2 ** math.floor(math.log2(n_heads))
    base = 2 ** (-(2 ** -(math.log2(p2) - 3)))
    slopes = base ** torch.arange(1, 1 + p2, dtype=torch.float32)
    if p2 != n_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * p2) - 3)))
        n_extra = min(p2, n_heads - p2)
        extra = extra_base ** torch.arange(1, 1 + 2 * n_extra, 2, dtype=torch.float32)
        slopes = torch.cat([slopes, extra])
    return slopes


@POSITIONS.register("alibi")
class Alibi(PositionBlock):
    slopes: torch.Tensor
    has_bias = True

    def __init__(self, args: PositionArgs) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(args.n_heads), persistent=False)

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        # slope * key position: differs from slope * (k - q) by a per-row constant (softmax-invariant)
        b = self.slopes[:, None, None] * k_pos.float()[None, None, :]
        return b.expand(-1, q_pos.shape[0], -1)

    def group_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return self.slopes[None, :, None, None] * k_pos.float()[:, None, None, :]

    def keep_heads(self, heads: slice) -> None:
        self.slopes = self.slopes[heads].clone()


SINUSOIDAL_VARIANTS = ("fairseq", "paper")


@POSITIONS.register("sinusoidal")
class Sinusoidal(PositionBlock):
    """Fixed sinusoid table; ``offset`` shifts positions (fairseq's padding_idx + 1).

    Frequencies 10000^(-i / (d/2 - 1)) in the ``fairseq`` variant (fairseq, tensor2tensor,
    M2M100), 10000^(-2i / d) in the ``paper`` variant ("Attention is all you need", Marian).
    ``layout``: the sines then the cosines (``halves``), or each frequency's sine and cosine
    side by side (``interleaved``: PyTorch's nn.Transformer tutorial and its many copies).
    """

    freqs: torch.Tensor
    input_only = True
    Options = SinusoidalOptions

    def __init__(self, args: PositionArgs) -> None:
        super().__init__()
        o = args.options if isinstance(args.options, SinusoidalOptions) else SinusoidalOptions()
        self.offset, variant, self.interleaved = o.offset, o.variant, o.layout == "interleaved"
        if variant not in SINUSOIDAL_VARIANTS:
            raise SpecError(
                f"network.position.variant: {variant!r} is not one of: {', '.join(SINUSOIDAL_VARIANTS)}"
            )
        half = args.hidden // 2
        step = math.log(10000.0) / (half - 1 if variant == "fairseq" else half)
        self.register_buffer(
            "freqs", torch.exp(torch.arange(half, dtype=torch.float32) * -step), persistent=False
        )

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        ang = (positions + self.offset).float()[:, None] * self.freqs[None, :]
        if self.interleaved:  # (N, half, 2) -> (N, hidden): sin_0, cos_0, sin_1, cos_1, ...
            return torch.stack((ang.sin(), ang.cos()), dim=-1).flatten(1)
        return torch.cat((ang.sin(), ang.cos()), dim=-1)


@POSITIONS.register("learned")
class Learned(PositionBlock):
    """Learned absolute table; ``offset`` shifts positions (OPT stores 2 unused rows first)."""

    input_only = True
    Options = LearnedOptions

    def __init__(self, args: PositionArgs) -> None:
        super().__init__()
        o = args.options if isinstance(args.options, LearnedOptions) else LearnedOptions()
        self.offset = o.offset
        self.weight = nn.Parameter(torch.zeros(args.max_positions + self.offset, args.hidden))

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        return nn.functional.embedding(positions + self.offset, self.weight)


@POSITIONS.register("relative")
class RelativeBias(PositionBlock):
    """T5's learned relative position bias: one (buckets, heads) table per stack, shared by its
    layers; exact buckets for small distances, logarithmic ones up to ``max_distance``. Keys
    before and after the query get their own buckets in encoders (``bidirectional``). Every
    stage of a layer-split model holds the table; tensor parallelism does not cut it."""

    has_bias = True
    splits_heads = False

    def __init__(self, args: PositionArgs) -> None:
        super().__init__()
        self.buckets, self.max_distance = args.buckets, args.max_distance
        self.bidirectional = args.bidirectional
        self.weight = nn.Parameter(torch.zeros(self.buckets, args.n_heads))

    def _bucket(self, rel: torch.Tensor) -> torch.Tensor:
        n = self.buckets
        out = torch.zeros_like(rel)
        if self.bidirectional:
            n //= 2
            out += (rel > 0).long() * n
            rel = rel.abs()
        else:
            rel = -rel.clamp(max=0)
        exact = n // 2
        large = (
            exact
            + (
                torch.log(rel.float() / exact) / math.log(self.max_distance / exact) * (n - exact)
            ).long()
        )
        large = large.clamp(max=n - 1)
        return out + torch.where(rel < exact, rel, large)

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        rel = k_pos[None, :] - q_pos[:, None]  # (T, S)
        return self.weight[self._bucket(rel)].permute(2, 0, 1)  # (H, T, S)

    def group_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        rel = k_pos - q_pos[:, None]  # (B, S)
        return self.weight[self._bucket(rel)].permute(0, 2, 1)[:, :, None]  # (B, H, 1, S)
