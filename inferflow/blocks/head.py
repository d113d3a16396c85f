"""Task heads on top of a stack's final hidden states (``network.head: {type: ..., ...}``).

``classify``: sequence classification and cross-encoder scoring — each input's hidden states
pooled to one vector (``pooling``), optionally a hidden -> hidden ``dense`` layer with an
activation (BERT's pooler: tanh; RoBERTa's classification head: tanh; DistilBERT: relu;
ELECTRA: gelu), then ``out`` (labels, hidden). The label count is ``len(hparams.labels)``
(config.json's ``id2label``). Parameters: ``head.dense.weight`` / ``.bias``,
``head.out.weight`` / ``.bias``.

``norm`` (optional): a norm on the pooled vector before the rest (nanochat- and SetFit-style
heads: ``LayerNorm(mean(h))``); parameters ``head.norm.weight`` (/ ``.bias``). ``groups``: the
outputs are several independent choices (e.g. ``[6, 2]``: a 6-way and a 2-way one), each a
softmax of its own over its labels (the labels listed group after group); served as one label
per group.

``token_classify``: the same layers on every token's final state, a label (per group) for each
token (``*ForTokenClassification``: taggers, NER).

A decoder-only network takes ``classify`` too, pooling ``last`` (``*ForSequenceClassification``
of decoders: the ``score`` layer on the last token's state).

``pooler``: the same pooling and dense layer without an output (BERT's ``pooler_output``); a
model with one serves that vector as its embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from inferflow.blocks.activation import ACTIVATIONS
from inferflow.blocks.linear import Linear
from inferflow.blocks.norm import NORMS
from inferflow.blocks.options import Options
from inferflow.errors import SpecError
from inferflow.registry import Registry


def _dense_choices() -> list[str]:
    return ["none", *ACTIVATIONS.names()]


@dataclass(frozen=True)
class DenseOptions(Options):
    dense: str = field(
        default="tanh",
        metadata={
            "doc": "a hidden -> hidden layer with this activation on the pooled state (none: "
            "the pooled state itself)",
            "choices": _dense_choices,
        },
    )


_POOLING: Any = field(
    default="cls",
    metadata={"doc": "cls: the first token's state; mean: over the tokens; last: the last"},
)


@dataclass(frozen=True)
class PoolerOptions(DenseOptions):
    pooling: Literal["cls", "mean", "last"] = _POOLING


@dataclass(frozen=True)
class TokenClassifyOptions(DenseOptions):
    dense: str = field(
        default="none",
        metadata={
            "doc": "a hidden -> hidden layer with this activation before the output (none: "
            "straight to the output)",
            "choices": _dense_choices,
        },
    )
    bias: bool = field(default=True, metadata={"doc": "the output layer has a bias"})
    norm: str = field(
        default="none",
        metadata={
            "doc": "a norm on the pooled vector (token_classify: each token's), before the "
            "dense and output layers (none: no norm)",
            "choices": lambda: ["none", *NORMS.names()],
        },
    )
    norm_eps: float = field(default=1e-5, metadata={"doc": "that norm's epsilon"})
    groups: Any = field(
        default=None,
        metadata={
            "doc": "sizes of independent label groups, each a softmax of its own (e.g. [6, 2]; "
            "the labels listed group after group); null: one group of all the labels",
            "schema": {
                "anyOf": [
                    {"type": "null"},
                    {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
                ]
            },
        },
    )


@dataclass(frozen=True)
class ClassifyOptions(TokenClassifyOptions):
    pooling: Literal["cls", "mean", "last"] = _POOLING


def pool(h: torch.Tensor, pooling: str) -> torch.Tensor:
    """One input's hidden states (T, hidden) -> (hidden,)."""
    if pooling == "mean":
        return h.mean(dim=0)
    return h[0] if pooling == "cls" else h[-1]


class PoolerHead(nn.Module):
    """``pooler``: BERT's pooler output (dense + tanh on the [CLS] state), served as the
    model's embedding (``/v1/embeddings``, ``inferflow embed``) in place of plain pooling."""

    Options: type[DenseOptions] = PoolerOptions

    per_token = False  # token_classify: a result for every token, no pooling

    def __init__(self, hidden: int, labels: tuple[str, ...], options: object) -> None:
        super().__init__()
        assert isinstance(options, DenseOptions)
        self.pooling: str = getattr(options, "pooling", "none")
        self.dense = Linear(hidden, hidden, bias=True) if options.dense != "none" else None
        self.act = ACTIVATIONS.get(options.dense) if options.dense != "none" else None

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled states (B, hidden) through the dense layer and its activation."""
        if self.dense is not None and self.act is not None:
            x = self.act(self.dense(x))
        return x

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.pooled(pooled)


class ClassifyHead(PoolerHead):
    Options: type[DenseOptions] = ClassifyOptions

    def __init__(self, hidden: int, labels: tuple[str, ...], options: object) -> None:
        super().__init__(hidden, labels, options)
        assert isinstance(options, TokenClassifyOptions)
        if not labels:
            raise SpecError(
                "network.head: the checkpoint declares no labels (config.json id2label); set "
                "hparams.labels"
            )
        self.labels = labels
        self.groups: tuple[int, ...] = tuple(options.groups or (len(labels),))
        if sum(self.groups) != len(labels):
            raise SpecError(
                f"network.head.groups: {list(self.groups)} add up to {sum(self.groups)} outputs, "
                f"but there are {len(labels)} labels (hparams.labels / config.json id2label)"
            )
        self.norm = (
            NORMS.get(options.norm)(hidden, options.norm_eps) if options.norm != "none" else None
        )
        self.out = Linear(hidden, len(labels), bias=options.bias)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled states (B, hidden) -> logits (B, labels)."""
        if self.norm is not None:
            pooled = self.norm(pooled)
        return self.out(self.pooled(pooled))

    def spans(self) -> list[range]:
        """Each label group's outputs."""
        starts = [sum(self.groups[:i]) for i in range(len(self.groups))]
        return [range(a, a + n) for a, n in zip(starts, self.groups, strict=True)]


class TokenClassifyHead(ClassifyHead):
    """``token_classify``: a label for every token (taggers, NER: ``*ForTokenClassification``),
    the same layers on each token's final state."""

    Options = TokenClassifyOptions
    per_token = True


HEADS: Registry[type[PoolerHead]] = Registry("head")
HEADS.add("classify", ClassifyHead)
HEADS.add("token_classify", TokenClassifyHead)
HEADS.add("pooler", PoolerHead)
