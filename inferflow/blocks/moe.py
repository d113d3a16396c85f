"""Mixture-of-experts FFN (``ffn: {type: moe, ...}``): a router picks ``n_experts_used`` of
``n_experts`` gated experts per token and sums their outputs weighted by the router's
probabilities; an optional shared expert (with an optional sigmoid gate) runs on every token.

Parameters (canonical names under ``feed_forward.``):
- ``router.weight`` (E, hidden);
- ``experts.{e}.w13.weight`` / ``experts.{e}.w2.weight``: expert e, a gated FFN of width
  ``expert_ffn_hidden`` (a checkpoint's separate gate / up tensors map to ``experts.{e}.w1`` /
  ``w3``; a tensor stacking every expert along its first axis maps to the name with ``{e}``);
- ``shared.w13.weight`` / ``shared.w2.weight``: the shared expert (a gated FFN), where
  ``hparams.shared_ffn_hidden`` > 0; ``shared_gate.weight`` (1, hidden) with ``shared_gate:
  sigmoid``.

Experts are plain linear layers: runtime quantization (``--quant``) quantizes each of them.

Each token's output is computed from its own row only (the experts it picked, in expert order),
whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from inferflow.blocks.ffn import FFNS, FFNArgs, GatedFFN
from inferflow.blocks.linear import Linear
from inferflow.blocks.options import Options
from inferflow.blocks.split import WHOLE, TensorSplit
from inferflow.errors import SpecError


@dataclass(frozen=True)
class MoEOptions(Options):
    routing: Literal["softmax_topk", "topk_softmax"] = field(
        default="softmax_topk",
        metadata={
            "doc": "softmax_topk: softmax over all experts, then the top k (renormalised when "
            "hparams.moe_normalize; Mixtral, Qwen2-MoE); topk_softmax: the top k logits, then a "
            "softmax over them"
        },
    )
    shared_gate: Literal["none", "sigmoid"] = field(
        default="none",
        metadata={"doc": "sigmoid: the shared expert's output times sigmoid(x . shared_gate)"},
    )


class MoEFFN(nn.Module):
    Options = MoEOptions

    def __init__(self, args: FFNArgs, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        h, opts = args.h, args.options
        assert isinstance(opts, MoEOptions)
        if split.size > 1:
            raise SpecError("ffn: moe: tensor parallelism does not split experts yet")
        if h.n_experts < 1 or not 1 <= h.n_experts_used <= h.n_experts:
            raise SpecError(
                f"ffn: moe needs hparams.n_experts >= 1 and 1 <= n_experts_used <= n_experts; "
                f"got n_experts {h.n_experts}, n_experts_used {h.n_experts_used}"
            )
        if args.bias:
            raise SpecError("ffn: moe has no biases; set network.ffn_bias: false")
        self.act, self.k, self.opts = args.act, h.n_experts_used, opts
        self.normalize = h.moe_normalize
        self.router = Linear(args.hidden, h.n_experts)
        expert = FFNArgs(args.hidden, h.expert_ffn_hidden, args.act, False, h)
        self.experts = nn.ModuleList(GatedFFN(expert) for _ in range(h.n_experts))
        self.shared: GatedFFN | None = None
        self.shared_gate: Linear | None = None
        if h.shared_ffn_hidden:
            shared = FFNArgs(args.hidden, h.shared_ffn_hidden, args.act, False, h, args.options)
            self.shared = GatedFFN(shared)
            if opts.shared_gate == "sigmoid":
                self.shared_gate = Linear(args.hidden, 1)
        elif opts.shared_gate != "none":
            raise SpecError(
                "ffn: moe: shared_gate without a shared expert (hparams.shared_ffn_hidden is 0)"
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) in x's dtype, expert ids (N, k)) of each token."""
        logits = self.router(x)
        if self.opts.routing == "softmax_topk":
            w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.k, dim=-1)
            if self.normalize:
                w = w / w.sum(dim=-1, keepdim=True)
        else:
            top, ids = torch.topk(logits, self.k, dim=-1)
            w = torch.softmax(top.float(), dim=-1)
        return w.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # (in expert order: a row's sum is its own)
            rows, slot = torch.where(ids == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out


FFNS.add("moe", MoEFFN)
