"""The decoder-only network: one causal stack with an output head.

``forward`` takes a flat batch (inferflow.model.batch) and returns logits.
"""

from __future__ import annotations

import torch
from torch import nn

from inferflow.blocks.head import HEADS
from inferflow.model.batch import FlatBatch
from inferflow.model.stack import Stack, StackPart
from inferflow.spec.types import Spec


class DecoderOnly(nn.Module):
    """``part``: only what one rank of a partitioned model holds (inferflow.parallel)."""

    def __init__(self, spec: Spec, part: StackPart | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.dec = Stack(spec, spec.hparams.n_layers, part=part)
        # (head, embedding) module paths: quantization may give a tied head its own weight
        tied = spec.network.output.tied and (part is None or part.head)
        self.tied_outputs = [("dec.output", "dec.tok_embed")] if tied else []
        # a task head (network.head: classify on the last token, a decoder's
        # *ForSequenceClassification): its parameters are head.*
        net, h = spec.network, spec.hparams
        self.head = (
            HEADS.get(net.head)(h.hidden, h.labels, net.head_options)
            if net.head and part is None
            else None
        )

    def kv_geometry(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) this model keeps K/V for: the KV cache's shape."""
        layers = self.dec.layers()
        attn = layers[0].self_attn
        return len(layers), attn.n_kv_heads, attn.a.head_dim

    def hidden_states(self, batch: FlatBatch) -> torch.Tensor:
        return self.dec.hidden_states(batch)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.dec.logits(h)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """Logits (R, vocab) for ``batch.logits_rows`` (default: each sequence's last token)."""
        rows = batch.logits_rows if batch.logits_rows is not None else batch.default_logits_rows()
        return self.logits(self.dec.hidden_states(batch, rows))
