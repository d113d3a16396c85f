"""One stack of transformer layers, assembled from registered blocks as the spec says: the
decoder of every network type and the encoder of encoder-only / encoder-decoder networks.

Module paths equal canonical tensor names (``dec.{i}.self_attn.wqkv.weight``,
``enc.{i}.feed_forward.w1.weight``), so weight binding needs no second name table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from inferflow.blocks import (
    ACTIVATIONS,
    FFNS,
    NORMS,
    POSITIONS,
    RESIDUALS,
    Attention,
    AttnArgs,
    CrossAttention,
    FFNArgs,
    PositionArgs,
)
from inferflow.blocks.linear import Embedding, Linear
from inferflow.blocks.position import (
    NoPosition,
    PositionBlock,
    Positions,
    RopeOptions,
    Rotary,
)
from inferflow.blocks.split import WHOLE, TensorSplit
from inferflow.errors import SpecError
from inferflow.model.batch import FlatBatch
from inferflow.model.fused import FusedDecode
from inferflow.spec.types import HParams, NetworkSpec, Spec


class Layer(nn.Module):
    """``cache_layer``: the layer's row in the KV cache (its index among the layers this
    process holds)."""

    def __init__(
        self,
        net: NetworkSpec,
        h: HParams,
        cache_layer: int,
        window: int | None,
        causal: bool = True,
        cross: bool = False,
        split: TensorSplit = WHOLE,
        memory_hidden: int = 0,
    ) -> None:
        super().__init__()
        self.wiring = RESIDUALS.get(net.residual)
        if cross and not self.wiring.cross:
            allowed = ", ".join(n for n, w in RESIDUALS.items() if w.cross)
            raise SpecError(
                f"network.residual: {net.residual!r} has no place for cross-attention; "
                f"an encoder_decoder network allows: {allowed}"
            )
        norm = NORMS.get(net.norm)
        for name in self.wiring.norms + (("cross_norm",) if cross else ()):
            self.add_module(name, norm(h.hidden, h.norm_eps))
        a = net.attention
        args = AttnArgs(
            layer=cache_layer,
            hidden=h.hidden,
            n_heads=h.n_heads,
            n_kv_heads=h.n_kv_heads,
            head_dim=h.head_dim,
            bias=a.bias,
            qkv_layout=a.qkv_layout,
            qk_norm=NORMS.get(a.qk_norm) if a.qk_norm else None,
            norm_eps=h.norm_eps,
            window=window,
            softcap=a.softcap,
            scale=a.scale,
            causal=causal,
            memory_hidden=memory_hidden,
        )
        self.self_attn = Attention(args, split)
        self.cross_attn = CrossAttention(args) if cross else None
        ffn = FFNArgs(
            h.hidden,
            h.ffn_hidden,
            ACTIVATIONS.get(net.activation),
            net.ffn_bias,
            h,
            net.ffn_options,
        )
        self.feed_forward = FFNS.get(net.ffn)(ffn, split)
        self.local = window is not None
        # tensor parallelism: sums the branches' partial outputs across the group
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # learned scalars on the residual stream (network.gates)
        g = net.gates
        self.attn_gate = nn.Parameter(torch.empty(1)) if g.branches else None
        self.ffn_gate = nn.Parameter(torch.empty(1)) if g.branches else None
        self.mix = nn.Parameter(torch.empty(2)) if g.embedding_skip else None

    def forward(
        self, x: torch.Tensor, batch: FlatBatch, pos: PositionBlock, x0: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.mix is not None:  # the input mixed with the embedding output
            assert x0 is not None
            x = self.mix[0] * x + self.mix[1] * x0
        attn = lambda t: self.self_attn(t, batch, pos)  # noqa: E731
        ffn: Callable[[torch.Tensor], torch.Tensor] = self.feed_forward
        ga, gf = self.attn_gate, self.ffn_gate
        if ga is not None and gf is not None:
            attn = lambda t: ga * self.self_attn(t, batch, pos)  # noqa: E731
            ffn = lambda t: gf * self.feed_forward(t)  # noqa: E731
        r, cross = self.reduce, self.cross_attn
        if r is not None:
            if self.wiring.delta is not None:  # parallel branches: one all-reduce per layer
                return x + r(self.wiring.delta(self, x, attn, ffn))
            attn_one, ffn_one = attn, ffn
            attn = lambda t: r(attn_one(t))  # noqa: E731
            ffn = lambda t: r(ffn_one(t))  # noqa: E731
        if cross is None:
            return self.wiring.forward(self, x, attn, ffn)
        return self.wiring.forward(self, x, attn, ffn, lambda t: cross(t, batch))


def _scale(value: str | float | None, named: str, hidden: int) -> float | None:
    if value is None:
        return None
    if value == named:
        return math.sqrt(hidden) if named == "sqrt_hidden" else 1 / math.sqrt(hidden)
    return float(value)


def _positions(
    net: NetworkSpec, h: HParams, causal: bool, part: StackPart
) -> tuple[PositionBlock, PositionBlock | None]:
    """The stack's position block (one, or ``Positions`` of several when the spec lists them)
    and, where the spec gives ``local_theta``, the rope of its sliding-window layers."""
    blocks: dict[str, PositionBlock] = {}
    local: PositionBlock | None = None
    for name, opts in net.positions:
        # learned / sinusoidal tables live in the embedding width (factorised embeddings)
        args = PositionArgs(
            h.embed_dim,
            h.n_heads,
            h.head_dim,
            h.max_positions,
            opts,
            theta=h.rope_theta,
            rotary_dim=h.rotary_dim,
            scaling=h.rope_scaling,
            buckets=h.rel_buckets,
            max_distance=h.rel_max_distance,
            bidirectional=not causal,
        )
        cls = POSITIONS.get(name)
        if name in blocks:
            raise SpecError(f"network.position: {name!r} is listed twice")
        # an input embedding takes part only where the embeddings are (the first stage)
        blocks[name] = (cls if part.embedding or not cls.input_only else NoPosition)(args)
        if isinstance(opts, RopeOptions) and opts.local_theta is not None:
            local = Rotary(args, local=True)  # sliding-window layers' own rope base (Gemma 3)
    if len(blocks) > 1 and local is not None:
        raise SpecError("network.position: local_theta needs a single position mechanism")
    pos = next(iter(blocks.values())) if len(net.positions) == 1 else Positions(blocks)
    for block in (pos, local):
        if block is not None and part.split.size > 1:
            block.keep_heads(part.split.part(h.n_heads))
    return pos, local


@dataclass(frozen=True)
class StackPart:
    """The share of a stack one rank of a partitioned model holds (inferflow.parallel): layers
    [first, last), the embeddings (first stage), the final norm and head (last stage), and its
    tensor-parallel split of every layer."""

    first: int
    last: int
    embedding: bool
    head: bool
    split: TensorSplit = WHOLE


class Stack(nn.Module):
    """Children: tok_embed (absent when ``embed`` is shared), pos_embed, type_embed,
    embed_norm, embed_proj (a factorised embedding's projection), "0".."L-1", output_norm, and
    for a decoder the head ``output`` (absent when tied) with ``logits_bias`` for a tied head
    with a bias. A ``part`` keeps only what one rank holds;
    its layers keep their global names and use cache rows 0.. in order."""

    def __init__(
        self,
        spec: Spec,
        n_layers: int,
        causal: bool = True,
        cross: bool = False,
        head: bool = True,
        embed: Embedding | None = None,
        part: StackPart | None = None,
        hparams: HParams | None = None,
        memory_hidden: int = 0,
    ) -> None:
        super().__init__()
        net, h = spec.network, hparams or spec.hparams
        part = part or StackPart(0, n_layers, True, True)
        head = head and part.head
        self.layer_ids = range(part.first, part.last)
        if embed is None and (part.embedding or (head and net.output.tied)):
            self.tok_embed = Embedding(h.vocab_size, h.embed_dim)
        self._shared = [embed]  # a list: not registered as this stack's child
        self.pos_embed, self.pos_local = _positions(net, h, causal, part)
        first = part.embedding
        self.type_embed = (
            Embedding(h.type_vocab_size, h.embed_dim)
            if net.embedding.token_types and first
            else None
        )
        norm = NORMS.get(net.norm)
        self.embed_norm = norm(h.embed_dim, h.norm_eps) if net.embedding.norm and first else None
        # a factorised embedding: a narrower table (ALBERT, ELECTRA), projected to the width
        project = net.embedding.projection
        if project == "auto":
            project = h.embed_dim != h.hidden
        if not project and h.embed_dim != h.hidden:
            raise SpecError(
                f"hparams: embed_dim {h.embed_dim} differs from hidden {h.hidden}, but "
                "network.embedding.projection is false; set it true (or auto)"
            )
        if project and net.output.tied and head:
            raise SpecError(
                "network.embedding.projection: a projected (factorised) embedding cannot be "
                "tied to the output head; set network.output.tied: false"
            )
        self.embed_proj = Linear(h.embed_dim, h.hidden, bias=True) if project and first else None
        windows = self._windows(net, h, n_layers)
        for i in self.layer_ids:
            layer = Layer(
                net, h, i - part.first, windows[i], causal, cross, part.split, memory_hidden
            )
            self.add_module(str(i), layer)
        self.output_norm = norm(h.hidden, h.norm_eps) if net.final_norm and part.head else None
        self.output: Linear | None = None
        self.logits_bias: nn.Parameter | None = None
        self.has_head = head  # logits: by output, or tied, by the embedding table
        if head:
            if not net.output.tied:
                self.output = Linear(h.hidden, h.vocab_size, bias=net.output.bias)
            elif net.output.bias:  # BART / Marian: final_logits_bias beside a tied head
                self.logits_bias = nn.Parameter(torch.empty(h.vocab_size))
        self.embed_scale = _scale(net.embedding.scale, "sqrt_hidden", h.hidden)
        self.output_scale = _scale(net.output.scale, "inv_sqrt_hidden", h.hidden)
        self.final_softcap = net.output.softcap
        self._fused: FusedDecode | None = None
        self._fused_checked = False

    @staticmethod
    def _windows(net: NetworkSpec, h: HParams, n_layers: int) -> list[int | None]:
        sw = net.attention.sliding_window
        if sw is False:
            return [None] * n_layers
        size = h.sliding_window if sw is True else int(sw)
        if not size:
            raise SpecError(
                "network.attention.sliding_window: true, but the checkpoint declares no window size; give a number"
            )
        every = net.attention.global_every
        return [None if every and (i + 1) % every == 0 else size for i in range(n_layers)]

    @property
    def embedding(self) -> Embedding:
        shared = self._shared[0]
        return shared if shared is not None else self.tok_embed

    def layers(self) -> list[Layer]:
        return [getattr(self, str(i)) for i in self.layer_ids]

    def hidden_states(self, batch: FlatBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output for every row, or (``rows``) for those rows only."""
        return self.final_norm(self.run_layers(self.embed(batch), batch, rows))

    def embed(self, batch: FlatBatch) -> torch.Tensor:
        """The first layer's input (N, hidden): token (+ position, type) embeddings."""
        # the table may stay in host memory (partition.embeddings: host); the batch is on the
        # device that computes
        ids = batch.token_ids
        x = self.embedding(ids.to(self.embedding.device)).to(ids.device)  # (N, hidden)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        pe = self.pos_embed.embed(batch.positions)
        if pe is not None:
            x = x + pe.to(x.dtype)
        if self.type_embed is not None:  # single-segment inputs: token type 0
            types = batch.token_types
            x = x + (self.type_embed.weight[0] if types is None else self.type_embed(types))
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        return x

    def run_layers(
        self, x: torch.Tensor, batch: FlatBatch, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every row's output, or (``rows``) those rows' only: where they are strictly
        increasing, the one-call decode skips the others' attention and products in the last
        layer."""
        if rows is not None and rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
            return self.run_layers(x, batch)[rows]
        # every row, prompt or decode, goes through the one-call C decode where the stack has
        # one and the batch's KV views give slots (the engine's always do), else through the
        # modules: their operations are the C decode's bit for bit (tests/test_fused.py), so a
        # request's tokens get the same arithmetic whatever else is in the batch
        fused = self.fused_decode()
        out = fused.run(x, batch, rows) if fused is not None else None
        if out is not None:
            return out
        out = self._run_modules(x, batch)
        return out if rows is None else out[rows]

    def _run_modules(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        x0 = x  # the embedding output (network.gates.embedding_skip)
        for layer in self.layers():
            pos = self.pos_local if layer.local and self.pos_local is not None else self.pos_embed
            x = layer(x, batch, pos, x0)
        return x

    def fused_decode(self) -> FusedDecode | None:
        """The stack's one-call decode path (inferflow.model.fused), built on first use (after
        the weights are bound and quantized); None where the stack has none."""
        if not self._fused_checked:
            self._fused = FusedDecode.build(self)
            self._fused_checked = True
        return self._fused

    def forget_fused(self) -> None:
        """Decide again at the next use (after layers were swapped, e.g. quantized)."""
        self._fused, self._fused_checked = None, False

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_norm(x) if self.output_norm is not None else x

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states as the head reads them (scaled first where the spec says so)."""
        if self.output_scale is None:
            return h
        return h * torch.tensor(self.output_scale, dtype=h.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.head_input(h)
        if self.output is not None:
            out = self.output(h)
        else:
            out = nn.functional.linear(h, self.embedding.weight, self.logits_bias)
        if self.final_softcap is not None:
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, bias) of a float output layer, for a fused output layer that reads
        ``head_input(h)``; None when the head is quantized or soft-capped."""
        if self.final_softcap is not None:
            return None
        if self.output is None:
            return self.embedding.weight, self.logits_bias
        if type(self.output) is Linear:
            return self.output.weight, self.output.bias
        return None
