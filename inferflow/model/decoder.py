"""The decoder-only network, assembled from registered blocks as the spec says.

Module paths equal canonical tensor names (``dec.{i}.self_attn.wqkv.weight``), so weight binding
needs no second name table. ``forward`` takes a flat batch (inferflow.model.batch).
"""

from __future__ import annotations

import math

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
    PositionArgs,
)
from inferflow.blocks.linear import Embedding, Linear
from inferflow.blocks.position import PositionBlock
from inferflow.errors import SpecError
from inferflow.model.batch import FlatBatch
from inferflow.spec.types import HParams, NetworkSpec, Spec


class DecoderLayer(nn.Module):
    def __init__(self, net: NetworkSpec, h: HParams, layer: int, window: int | None) -> None:
        super().__init__()
        self.wiring = RESIDUALS.get(net.residual)
        norm = NORMS.get(net.norm)
        for name in self.wiring.norms:
            self.add_module(name, norm(h.hidden, h.norm_eps))
        a = net.attention
        self.self_attn = Attention(
            AttnArgs(
                layer=layer,
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
            )
        )
        self.feed_forward = FFNS.get(net.ffn)(
            h.hidden, h.ffn_hidden, ACTIVATIONS.get(net.activation), net.ffn_bias
        )
        self.local = window is not None

    def forward(self, x: torch.Tensor, batch: FlatBatch, pos: PositionBlock) -> torch.Tensor:
        return self.wiring.forward(
            self, x, lambda t: self.self_attn(t, batch, pos), self.feed_forward
        )


class DecoderStack(nn.Module):
    """Children: tok_embed, pos_embed, "0".."L-1", output_norm, output (absent when tied)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        net, h = spec.network, spec.hparams
        self.n_layers = h.n_layers
        self.spec_net = net
        self.tok_embed = Embedding(h.vocab_size, h.hidden)
        if net.embedding_norm:
            self.embed_norm = NORMS.get(net.norm)(h.hidden, h.norm_eps)
        pos_opts = {"theta": h.rope_theta, "rotary_dim": h.rotary_dim, "scaling": h.rope_scaling}
        pos_opts.update(net.position)
        if "partial" in net.position:
            pos_opts.pop("rotary_dim")
        args = PositionArgs(h.hidden, h.n_heads, h.head_dim, h.max_positions, pos_opts)
        pos_cls = POSITIONS.get(net.position["type"])
        self.pos_embed = pos_cls(args)
        # sliding-window layers may use their own rope base (Gemma 3's local_theta)
        self.pos_local = (
            pos_cls(args, theta_key="local_theta") if "local_theta" in net.position else None
        )
        windows = self._windows(net, h)
        for i in range(h.n_layers):
            self.add_module(str(i), DecoderLayer(net, h, i, windows[i]))
        self.output_norm = NORMS.get(net.norm)(h.hidden, h.norm_eps)
        if net.tied_output and net.output_bias:
            raise SpecError(
                "network.output: a tied output head cannot have its own bias; set tied: false"
            )
        self.output = (
            None if net.tied_output else Linear(h.hidden, h.vocab_size, bias=net.output_bias)
        )
        s = net.embedding_scale
        self.embed_scale = (
            math.sqrt(h.hidden) if s == "sqrt_hidden" else (float(s) if s is not None else None)
        )
        self.final_softcap = net.final_softcap

    @staticmethod
    def _windows(net: NetworkSpec, h: HParams) -> list[int | None]:
        sw = net.attention.sliding_window
        if sw is False:
            return [None] * h.n_layers
        size = h.sliding_window if sw is True else int(sw)
        if not size:
            raise SpecError(
                "network.attention.sliding_window: true, but the checkpoint declares no window size; give a number"
            )
        every = net.attention.global_every
        return [None if every and (i + 1) % every == 0 else size for i in range(h.n_layers)]

    def layers(self) -> list[DecoderLayer]:
        return [getattr(self, str(i)) for i in range(self.n_layers)]


class DecoderOnly(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.dec = DecoderStack(spec)
        # (head, embedding) module paths: quantization may give a tied head its own weight
        self.tied_outputs = [("dec.output", "dec.tok_embed")] if spec.network.tied_output else []

    def hidden_states(self, batch: FlatBatch) -> torch.Tensor:
        d = self.dec
        x = d.tok_embed(batch.token_ids)  # (N, hidden)
        if d.embed_scale is not None:
            x = x * torch.tensor(d.embed_scale, dtype=x.dtype)
        pe = d.pos_embed.embed(batch.positions)
        if pe is not None:
            x = x + pe.to(x.dtype)
        if d.spec_net.embedding_norm:
            x = d.embed_norm(x)
        for layer in d.layers():
            pos = d.pos_local if layer.local and d.pos_local is not None else d.pos_embed
            x = layer(x, batch, pos)
        return d.output_norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        d = self.dec
        if d.output is not None:
            out = d.output(h)
        else:
            out = nn.functional.linear(h, d.tok_embed.weight)
        if d.final_softcap is not None:
            out = torch.tanh(out / d.final_softcap) * d.final_softcap
        return out

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """Logits (R, vocab) for ``batch.logits_rows`` (default: each sequence's last token)."""
        h = self.hidden_states(batch)
        rows = batch.logits_rows if batch.logits_rows is not None else batch.default_logits_rows()
        return self.logits(h[rows])
