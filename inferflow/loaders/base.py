"""The loader contract: a WeightSource yields ``(name, tensor)`` lazily.

Tensors are float ``torch.Tensor`` (mmap-backed where the format allows) or ``QuantTensor`` for
already-quantized data. Names are the checkpoint's own; the model's name map turns them into
canonical names. A source that maps its file may also have ``release(name)``: the loader calls
it once a tensor is in its final form, so the file's pages need not stay resident.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Union

import numpy as np
import torch

from inferflow.quant.tensor import QuantTensor
from inferflow.registry import Registry

Weight = Union[torch.Tensor, QuantTensor]


class WeightSource(Protocol):
    @property
    def metadata(self) -> Mapping[str, Any]:
        """Format metadata (GGUF key/values, safetensors __metadata__, ...)."""

    def names(self) -> list[str]: ...

    def get(self, name: str) -> Weight: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype_name(self, name: str) -> str: ...

    def __iter__(self) -> Iterator[tuple[str, Weight]]: ...

    def close(self) -> None: ...


class TensorInfo(Protocol):
    name: str


# format name (the spec's ``source.format``) -> opener of a list of files
LOADERS: Registry[Callable[[Sequence[Path]], WeightSource]] = Registry("checkpoint format")


def release_pages(mm: np.ndarray | None, offset: int, nbytes: int) -> None:
    """Drop the whole pages of bytes [offset, offset + nbytes) of an np.memmap from this process's
    resident memory (``madvise(MADV_DONTNEED)``): they stay in the page cache, and a view still
    held faults them back in (a private mapping's own writes are dropped). Pages shared with a
    neighbouring tensor stay."""
    mapping = getattr(mm, "_mmap", None)  # np.memmap's mmap.mmap
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = -(-offset // page) * page
    end = (offset + nbytes) // page * page
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
