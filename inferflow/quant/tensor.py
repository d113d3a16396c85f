"""QuantTensor: raw quantized blocks plus their format, dequantized on demand."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inferflow.errors import QuantError
from inferflow.quant.formats import QuantFormat, get_format


@dataclass
class QuantTensor:
    """A quantized tensor in torch (row-major) order.

    ``data`` holds the raw uint8 blocks of the whole tensor, row after row; blocks run along the
    last dimension (GGML's ne[0]), so ``shape[-1]`` is a multiple of the block size.
    """

    data: torch.Tensor  # uint8, (rows, bytes_per_row) or flat
    format: str
    shape: tuple[int, ...]
    # set by a loader whose file mapping backs ``data``: release(start, stop) lets the pages of
    # bytes [start, stop) of data go from resident memory once they are read (a later read
    # faults them in again from the file), so repacking a large tensor never holds its file
    # pages and its new layout whole at once
    release: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        fmt = self.qformat
        n = math.prod(self.shape)
        if self.shape and self.shape[-1] % fmt.block_size:
            raise QuantError(
                f"{self.format}: last dimension {self.shape[-1]} is not a multiple of the "
                f"block size {fmt.block_size}"
            )
        want = n // fmt.block_size * fmt.bytes_per_block
        if self.data.dtype != torch.uint8 or self.data.numel() != want:
            raise QuantError(
                f"{self.format} tensor of shape {list(self.shape)} needs {want} bytes of uint8 "
                f"blocks, got {self.data.numel()} of {self.data.dtype}"
            )

    @property
    def qformat(self) -> QuantFormat:
        return get_format(self.format)

    @property
    def bits_per_weight(self) -> float:
        return self.qformat.bits_per_weight

    @property
    def dtype(self) -> str:
        return self.format

    def numel(self) -> int:
        return math.prod(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.numel() == 0:  # e.g. a GGUF tensor with a zero dim: codecs need whole blocks
            return torch.zeros(self.shape, dtype=dtype)
        fmt = self.qformat
        blocks = self.data.reshape(-1, fmt.bytes_per_block)
        out = fmt.dequantize_blocks(blocks)
        return out.reshape(self.shape).to(dtype)

    def rows(self, start: int, stop: int) -> QuantTensor:
        """Rows [start, stop) of a 2-D tensor (no copy): how fused and sharded weights slice."""
        if len(self.shape) != 2:
            raise QuantError(f"row slicing needs a 2-D tensor, got shape {list(self.shape)}")
        per_row = self.shape[1] // self.qformat.block_size * self.qformat.bytes_per_block
        flat = self.data.reshape(-1)
        return QuantTensor(
            flat[start * per_row : stop * per_row], self.format, (stop - start, self.shape[1])
        )
