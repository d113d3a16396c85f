"""Sequence classification and cross-encoder scores (a spec's ``network.head: {type:
classify}``): each input's final hidden states pooled by the head, then its layers, in packed
batches without padding (``inferflow.engine.embed.passes``), so a batch's results equal each
input's alone. A text pair (query, document) is one input whose second text's tokens have token
type 1 where the tokenizer says so (BERT-style cross-encoders).

``probabilities``: softmax over the labels, or for a one-label head (a relevance score) the
sigmoid of its logit, as sentence-transformers' CrossEncoder and vLLM's score API give.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from inferflow.blocks.head import ClassifyHead, pool
from inferflow.engine.embed import MAX_BATCH_TOKENS, passes
from inferflow.errors import RequestError
from inferflow.model.batch import FlatBatch, check_inputs, packed
from inferflow.model.decoder import DecoderOnly
from inferflow.model.encoder import EncoderOnly
from inferflow.model.network import Network


def classify_head(model: Network) -> ClassifyHead:
    head = getattr(model, "head", None) if isinstance(model, EncoderOnly | DecoderOnly) else None
    if not isinstance(head, ClassifyHead):
        raise RequestError(
            f"model {model.spec.name!r} has no classification head: its spec declares no "
            "network.head (e.g. {type: classify})"
        )
    return head


def _passes(
    model: Network,
    inputs: list[list[int]],
    types: list[list[int]] | None,
    max_batch_tokens: int,
) -> Iterator[tuple[list[int], FlatBatch, torch.Tensor]]:
    """(input indices, their packed batch, its final hidden states) per forward pass."""
    h = model.spec.hparams
    if not inputs:
        raise RequestError("no inputs: give at least one")
    check_inputs(inputs, h.vocab_size, h.max_positions, "input")
    if types is not None:
        limit = h.type_vocab_size if model.spec.network.embedding.token_types else 1
        if any(t >= limit for ts in types for t in ts):
            raise RequestError(
                f"model {model.spec.name!r} takes token types below {limit}: it cannot tell the "
                "two texts of a pair apart"
            )
    for idx in passes(inputs, max_batch_tokens):
        batch = packed([inputs[i] for i in idx], None if types is None else [types[i] for i in idx])
        yield idx, batch, model.hidden_states(batch)  # type: ignore[attr-defined]


@torch.inference_mode()
def classify_batch(
    model: Network,
    inputs: list[list[int]],
    types: list[list[int]] | None = None,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
) -> torch.Tensor:
    """Logits (B, labels), float32, of token-id inputs (``types``: each token's segment)."""
    head = classify_head(model)
    if head.per_token:
        raise RequestError(
            f"model {model.spec.name!r} labels every token (network.head: token_classify): "
            "its results are per token"
        )
    out = torch.empty(len(inputs), len(head.labels))
    for idx, batch, states in _passes(model, inputs, types, max_batch_tokens):
        pooled = torch.stack(
            [pool(states[s.start : s.start + s.length], head.pooling) for s in batch.seqs]
        )
        out[idx] = head(pooled).float()
    return out


@torch.inference_mode()
def token_classify_batch(
    model: Network, inputs: list[list[int]], max_batch_tokens: int = MAX_BATCH_TOKENS
) -> list[torch.Tensor]:
    """Each input's per-token logits (T_i, labels), float32 (a ``token_classify`` head)."""
    head = classify_head(model)
    if not head.per_token:
        raise RequestError(
            f"model {model.spec.name!r} labels whole inputs (network.head: classify), not tokens"
        )
    out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    for idx, batch, states in _passes(model, inputs, None, max_batch_tokens):
        logits = head(states).float()
        for i, s in zip(idx, batch.seqs, strict=True):
            out[i] = logits[s.start : s.start + s.length]
    return out


def probabilities(logits: torch.Tensor, spans: list[range] | None = None) -> torch.Tensor:
    """Per-label probabilities: a softmax over each label group's outputs (``spans``; default:
    one group of all), or for a group of one label its sigmoid (a relevance score)."""
    out = torch.empty_like(logits)
    for r in spans or [range(logits.shape[-1])]:
        part = logits[..., r.start : r.stop]
        out[..., r.start : r.stop] = (
            torch.sigmoid(part) if len(r) == 1 else torch.softmax(part, dim=-1)
        )
    return out


def best_labels(probs: list[float], labels: tuple[str, ...], spans: list[range]) -> list[str]:
    """Each group's most probable label."""
    return [labels[max(r, key=probs.__getitem__)] for r in spans]
