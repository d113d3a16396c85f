"""Task heads on top of a stack's final hidden states (``network.head: {type: ..., ...}``).

``classify``: sequence classification and cross-encoder scoring — each input's hidden states
pooled to one vector (``pooling``), optionally a hidden -> hidden ``dense`` layer with an
activation (BERT's pooler: tanh; RoBERTa's classification head: tanh; DistilBERT: relu;
ELECTRA: gelu), then ``out`` (labels, hidden). The label count is ``len(hparams.labels)``
(config.json's ``id2label``). Parameters: ``head.dense.weight`` / ``.bias``,
``head.out.weight`` / ``.bias``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from inferflow.blocks.activation import ACTIVATIONS
from inferflow.blocks.linear import Linear
from inferflow.blocks.options import Options
from inferflow.errors import SpecError
from inferflow.registry import Registry


@dataclass(frozen=True)
class ClassifyOptions(Options):
    pooling: Literal["cls", "mean", "last"] = field(
        default="cls",
        metadata={"doc": "cls: the first token's state; mean: over the tokens; last: the last"},
    )
    dense: str = field(
        default="none",
        metadata={
            "doc": "a hidden -> hidden layer with this activation before the output (none: "
            "straight to the output)",
            "choices": lambda: ["none", *ACTIVATIONS.names()],
        },
    )
    bias: bool = field(default=True, metadata={"doc": "the output layer has a bias"})


def pool(h: torch.Tensor, pooling: str) -> torch.Tensor:
    """One input's hidden states (T, hidden) -> (hidden,)."""
    if pooling == "mean":
        return h.mean(dim=0)
    return h[0] if pooling == "cls" else h[-1]


class ClassifyHead(nn.Module):
    Options = ClassifyOptions

    def __init__(self, hidden: int, labels: tuple[str, ...], options: object) -> None:
        super().__init__()
        assert isinstance(options, ClassifyOptions)
        if not labels:
            raise SpecError(
                "network.head: the checkpoint declares no labels (config.json id2label); set "
                "hparams.labels"
            )
        self.labels, self.pooling = labels, options.pooling
        self.dense = Linear(hidden, hidden, bias=True) if options.dense != "none" else None
        self.act = ACTIVATIONS.get(options.dense) if options.dense != "none" else None
        self.out = Linear(hidden, len(labels), bias=options.bias)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled states (B, hidden) -> logits (B, labels)."""
        x = pooled
        if self.dense is not None and self.act is not None:
            x = self.act(self.dense(x))
        return self.out(x)


HEADS: Registry[type[ClassifyHead]] = Registry("head")
HEADS.add("classify", ClassifyHead)
