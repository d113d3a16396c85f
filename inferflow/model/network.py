"""What the engines see of a network, typed once: ``Network`` and ``PagedDecoder``.

The networks are plain ``nn.Module`` subclasses (DecoderOnly, EncoderOnly, EncoderDecoder, and
rank 0's PartitionedModel); these protocols name the part of them the engines call, so that
``model.spec`` is a ``Spec`` rather than whatever ``nn.Module.__getattr__`` returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from inferflow.model.batch import FlatBatch
from inferflow.spec.types import Spec


class Network(Protocol):
    """Any loaded network. Calling it runs ``forward`` on a flat batch: logits for a decoder,
    final hidden states for an encoder. Which other methods it has depends on
    ``spec.network.type``, which each engine checks before it narrows the type."""

    @property
    def spec(self) -> Spec: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def __call__(self, batch: FlatBatch) -> torch.Tensor: ...


@runtime_checkable
class PagedDecoder(Network, Protocol):
    """A decoder-only network, whole (DecoderOnly) or partitioned (PartitionedModel): what the
    continuous-batching engine drives over its paged KV cache."""

    def kv_geometry(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) this network keeps K/V for."""
        ...
