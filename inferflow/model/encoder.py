"""Encoder-only (BERT family) and encoder-decoder networks.

The encoder runs bidirectional attention over each source, packed without padding
(``inferflow.model.batch.packed``). An encoder-decoder's decoder layers attend to the encoder
output through cross-attention whose keys and values are computed once per source
(``cross_memory``), kept in a ``CrossBank`` and named per sequence of each decoder batch
(``FlatBatch.cross``, ``inferflow.model.cross``).
"""

from __future__ import annotations

import torch
from torch import nn

from inferflow.blocks.head import HEADS
from inferflow.errors import RequestError, SpecError
from inferflow.model.batch import FlatBatch, check_inputs, packed
from inferflow.model.cross import CrossMemory
from inferflow.model.stack import Stack
from inferflow.spec.types import Spec


class EncoderOnly(nn.Module):
    """``forward`` returns the final hidden states (N, hidden) of a packed batch."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.enc = Stack(spec, spec.hparams.n_layers, causal=False, head=False)
        net, h = spec.network, spec.hparams
        # a task head (network.head): its parameters are head.*
        self.head = HEADS.get(net.head)(h.hidden, h.labels, net.head_options) if net.head else None

    def hidden_states(self, batch: FlatBatch) -> torch.Tensor:
        return self.enc.hidden_states(batch)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        return self.hidden_states(batch)


class EncoderDecoder(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        h, he = spec.hparams, spec.encoder_hparams
        self.dec = Stack(spec, h.n_layers, causal=True, cross=True, memory_hidden=he.hidden)
        shared = self.dec.tok_embed if spec.network.embedding.shared else None
        if shared is not None and (he.vocab_size, he.embed_dim) != (h.vocab_size, h.embed_dim):
            raise SpecError(
                f"network.embedding.shared: the encoder's table ({he.vocab_size} x "
                f"{he.embed_dim}) differs from the decoder's ({h.vocab_size} x {h.embed_dim}); "
                "set shared: false"
            )
        self.enc = Stack(spec, he.n_layers, causal=False, head=False, embed=shared, hparams=he)
        self.tied_outputs = [("dec.output", "dec.tok_embed")] if spec.network.output.tied else []

    @property
    def start_id(self) -> int:
        h = self.spec.hparams
        start = h.decoder_start_id if h.decoder_start_id is not None else h.bos_id
        if start is None:
            raise RequestError(
                f"spec {self.spec.name!r}: the checkpoint declares no decoder start token; "
                "set hparams.decoder_start_id"
            )
        return start

    def encode(self, sources: list[list[int]]) -> list[torch.Tensor]:
        """Each source's encoder output (S_i, hidden), all sources in one packed pass."""
        h = self.spec.encoder_hparams
        check_inputs(sources, h.vocab_size, h.max_positions, "source")
        batch = packed(sources)
        out = self.enc.hidden_states(batch)
        return [out[s.start : s.start + s.length] for s in batch.seqs]

    def cross_memory(self, enc_out: torch.Tensor) -> CrossMemory:
        return self.cross_memories([enc_out])[0]

    def cross_memories(self, enc_outs: list[torch.Tensor]) -> list[CrossMemory]:
        """Each source's cross memory, every layer's projection run once over all sources."""
        every, per_layer = torch.cat(enc_outs), []
        for layer in self.dec.layers():
            assert layer.cross_attn is not None
            per_layer.append(layer.cross_attn.memory(every))
        ends = torch.tensor([e.shape[0] for e in enc_outs]).cumsum(0).tolist()
        return [
            [(k[:, end - e.shape[0] : end], v[:, end - e.shape[0] : end]) for k, v in per_layer]
            for e, end in zip(enc_outs, ends, strict=True)
        ]

    def hidden_states(self, batch: FlatBatch) -> torch.Tensor:
        return self.dec.hidden_states(batch)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.dec.logits(h)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """Decoder logits for ``batch.logits_rows`` (default: each sequence's last token);
        ``batch.cross`` names each sequence's cross memory."""
        h = self.hidden_states(batch)
        rows = batch.logits_rows if batch.logits_rows is not None else batch.default_logits_rows()
        return self.logits(h[rows])
