"""Embeddings from a network's final hidden states (spec ``embeddings: {pooling, normalize}``).

Encoder-only networks (BERT, MiniLM) attend in both directions; decoder-only networks run their
causal attention over the same packed batches. Many inputs go through in flat batches without
padding (``inferflow.model.batch.packed``), at most ``MAX_BATCH_TOKENS`` tokens a pass, so a
batch's results equal each input's alone. Pooling (``POOLINGS``): ``mean`` over the tokens,
``cls`` the first token's state (BERT's [CLS]), ``last`` the last token's, ``none`` one vector
per token. ``normalize`` L2-normalises every vector returned (each token's, under ``none``).
Inputs are never truncated: one longer than ``hparams.max_positions`` is an error.
"""

from __future__ import annotations

import torch

from inferflow.blocks.head import PoolerHead, pool
from inferflow.errors import RequestError
from inferflow.model.batch import check_inputs, packed
from inferflow.model.decoder import DecoderOnly
from inferflow.model.encoder import EncoderOnly
from inferflow.model.network import Network
from inferflow.spec.types import POOLINGS, Spec

MAX_BATCH_TOKENS = 8192  # tokens per forward pass; an input longer than this runs alone

# network types whose ``hidden_states`` take a packed batch of whole inputs
EMBEDDING_NETWORKS = ("encoder_only", "decoder_only")


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise RequestError(f"pooling: {pooling!r} is not one of: {', '.join(POOLINGS)}")


def spec_pooling(spec: Spec) -> tuple[str, bool]:
    """(pooling, normalize) a spec declares; an encoder-only network without an ``embeddings:``
    section pools the mean, L2-normalised (sentence-transformers' usual head)."""
    if spec.embedding_pooling is not None:
        return spec.embedding_pooling, spec.embedding_normalize
    if spec.network.type == "encoder_only":
        return "mean", True
    raise RequestError(
        f"spec {spec.name!r} declares no 'embeddings: {{pooling: {'|'.join(POOLINGS)}}}'; "
        "a decoder's embeddings need one (or give a pooling)"
    )


def resolve_pooling(
    spec: Spec, pooling: str | None = None, normalize: bool | None = None
) -> tuple[str, bool]:
    """(pooling, normalize): the caller's where given, else the spec's (``spec_pooling``)."""
    if pooling is None:
        pooling, spec_normalize = spec_pooling(spec)
    else:
        check_pooling(pooling)
        spec_normalize = spec.embedding_normalize
    return pooling, spec_normalize if normalize is None else normalize


def _pool(h: torch.Tensor, pooling: str) -> torch.Tensor:
    """One input's hidden states (T, hidden) -> (hidden,), or (T, hidden) for ``none``."""
    return h if pooling == "none" else pool(h, pooling)


def passes(inputs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of the inputs in each pass: consecutive inputs up to ``max_tokens`` tokens."""
    out: list[list[int]] = []
    used = max_tokens
    for i, ids in enumerate(inputs):
        if used + len(ids) > max_tokens:
            out.append([])
            used = 0
        out[-1].append(i)
        used += len(ids)
    return out


@torch.inference_mode()
def embed_batch(
    model: Network,
    inputs: list[list[int]],
    pooling: str,
    normalize: bool = True,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
) -> torch.Tensor | list[torch.Tensor]:
    """Embeddings of token-id inputs: a (B, hidden) float32 tensor, or for ``pooling="none"`` a
    list of B tensors (T_i, hidden)."""
    check_pooling(pooling)
    spec: Spec = model.spec
    if spec.network.type not in EMBEDDING_NETWORKS:
        raise RequestError(
            f"spec {spec.name!r} is {spec.network.type}: embeddings need one of "
            f"{', '.join(EMBEDDING_NETWORKS)}"
        )
    if not isinstance(model, (DecoderOnly, EncoderOnly)):  # a PartitionedModel
        raise RequestError(
            f"spec {spec.name!r}: embeddings need a model loaded whole, not one partitioned "
            "across devices (the spec's partition section)"
        )
    if not inputs:
        raise RequestError("no inputs: give at least one")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
    check_inputs(inputs, spec.hparams.vocab_size, spec.hparams.max_positions, "input")
    out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    # a pooler head (network.head: {type: pooler}) makes the embedding from its pooled state
    head = model.head if isinstance(model, EncoderOnly) else None
    pooler = head if type(head) is PoolerHead else None
    for idx in passes(inputs, max_batch_tokens):
        batch = packed([inputs[i] for i in idx])
        h = model.hidden_states(batch).float()  # (N, hidden)
        for i, s in zip(idx, batch.seqs, strict=True):
            states = h[s.start : s.start + s.length]
            if pooler is not None:
                out[i] = pooler(pool(states, pooler.pooling)[None])[0].float()
            else:
                out[i] = _pool(states, pooling)
    if normalize:
        out = [torch.nn.functional.normalize(v, dim=-1) for v in out]
    return out if pooling == "none" else torch.stack(out)


def embed(model: Network, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """One input's embedding: (hidden,), or (T, hidden) for ``pooling="none"``."""
    return embed_batch(model, [ids], pooling, normalize)[0]
