"""Sentence embeddings from a decoder's final hidden states (spec ``embeddings: {pooling}``):
mean over the tokens or the last token's state, L2-normalised (as OpenAI's embeddings are)."""

from __future__ import annotations

import torch
from torch import nn

from inferflow.engine.generate import new_cache
from inferflow.errors import RequestError
from inferflow.model.batch import FlatBatch
from inferflow.spec.types import POOLINGS


@torch.inference_mode()
def embed(model: nn.Module, ids: list[int], pooling: str) -> torch.Tensor:
    if pooling not in POOLINGS:
        raise RequestError(f"pooling: {pooling!r} is not one of: {', '.join(POOLINGS)}")
    if not ids:
        raise RequestError("the input is empty: give at least one token")
    ctx = model.spec.hparams.max_positions
    if len(ids) > ctx:
        raise RequestError(f"the input has {len(ids)} tokens; the model's context is {ctx}")
    cache = new_cache(model, len(ids))
    h = model.hidden_states(FlatBatch.single(torch.tensor(ids), 0, cache)).float()
    v = h.mean(dim=0) if pooling == "mean" else h[-1]
    return torch.nn.functional.normalize(v, dim=0)
