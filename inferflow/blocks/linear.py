"""Linear and embedding layers whose parameters start uninitialised.

Strict weight binding writes every parameter, so random init would only cost start-up time
(seconds for a 262k-row vocabulary). Quantized weights plug in here later (QuantLinear).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from inferflow.blocks.options import Options
from inferflow.errors import QuantError
from inferflow.kernels.quant_decode import QPlane
from inferflow.quant.tensor import QuantTensor


@dataclass(frozen=True)
class EmbeddingOptions(Options):
    """``network.embedding``: how each stack's input embedding is made."""

    scale: str | float | None = field(
        default=None,
        metadata={
            "doc": "token embeddings times sqrt_hidden or a number",
            "schema": {"anyOf": [{"const": "sqrt_hidden"}, {"type": "number"}]},
        },
    )
    norm: bool = field(
        default=False, metadata={"doc": "a norm right after the embeddings (BLOOM, BART, BERT)"}
    )
    token_types: bool = field(
        default=False,
        metadata={"doc": "token-type (segment) embeddings: type 0, or a text pair's types"},
    )
    shared: bool = field(
        default=True, metadata={"doc": "encoder-decoder: the encoder reads the decoder's table"}
    )
    projection: bool | str = field(
        default="auto",
        metadata={
            "doc": "a factorised embedding's projection embed_dim -> hidden after the norm "
            "(ALBERT, ELECTRA); auto: where hparams.embed_dim != hidden",
            "schema": {"anyOf": [{"type": "boolean"}, {"const": "auto"}]},
        },
    )


@dataclass(frozen=True)
class OutputOptions(Options):
    """``network.output``: a decoder's head."""

    tied: bool = field(default=False, metadata={"doc": "the head is the token embedding table"})
    bias: bool = field(
        default=False, metadata={"doc": "the head has a bias (a tied one: final_logits_bias)"}
    )
    softcap: float | None = field(default=None, metadata={"doc": "tanh soft-cap of the logits"})
    scale: str | float | None = field(
        default=None,
        metadata={
            "doc": "final hidden states times inv_sqrt_hidden (T5) or a number before the head",
            "schema": {"anyOf": [{"const": "inv_sqrt_hidden"}, {"type": "number"}]},
        },
    )


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """A lookup table: a float ``weight``, or (``keep_blocks``) a checkpoint's quantized rows,
    or (``share_plane``) the C plane of a tied head over the same table; a lookup dequantizes
    only the rows it reads (the same values as the float table)."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))
        self.blocks: QuantTensor | None = None
        self.plane: QPlane | None = None
        self.dtype = self.weight.dtype

    def _drop_weight(self, shape: tuple[int, ...], what: str) -> None:
        if tuple(shape) != tuple(self.weight.shape):
            raise QuantError(
                f"embedding {what} of shape {list(shape)} for a table of {list(self.weight.shape)}"
            )
        del self.weight

    def keep_blocks(self, table: QuantTensor) -> None:
        """Serve lookups from ``table`` (num, dim); the float ``weight`` goes."""
        self._drop_weight(table.shape, "blocks")
        self.blocks = table

    def share_plane(self, plane: QPlane) -> None:
        """Serve lookups from a tied head's ``plane`` (no bytes of its own); the float
        ``weight`` goes."""
        self._drop_weight(plane.shape, "plane")
        self.plane = plane

    @property
    def device(self) -> torch.device:
        quantized = self.blocks is not None or self.plane is not None
        return torch.device("cpu") if quantized else self.weight.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.plane is not None:
            rows = self.plane.rows(ids.reshape(-1)).to(self.dtype)
            return rows.reshape(*ids.shape, self.plane.k)
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        num, dim = self.blocks.shape
        rows = self.blocks.data.reshape(num, -1)[ids.reshape(-1)]  # (N, bytes per row)
        picked = QuantTensor(rows, self.blocks.format, (rows.shape[0], dim))
        return picked.dequantize(self.dtype).reshape(*ids.shape, dim)
