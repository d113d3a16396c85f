"""The one table of quantization formats: a row is (block size, bytes per block, codec).

Codecs work on raw blocks: ``dequantize_blocks(blocks: uint8 (n, bytes_per_block)) -> float32
(n, block_size)`` and, where Inferflow can write the format, ``quantize_blocks(float32 (n,
block_size)) -> uint8 (n, bytes_per_block)``. Quant settings live in metadata, never in names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferflow.registry import Registry

DequantizeBlocks = Callable[[torch.Tensor], torch.Tensor]
QuantizeBlocks = Callable[[torch.Tensor], torch.Tensor]
# (float32 blocks (n, block), importance (n, block) or None) -> uint8 blocks: the same layout,
# (scale, min) searched for the least importance-weighted squared error
SearchBlocks = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
METHODS = ("minmax", "search")  # how a writable format's codes are chosen


@dataclass(frozen=True)
class QuantFormat:
    name: str
    block_size: int  # weights per block (1 for plain float types)
    bytes_per_block: int
    dequantize_blocks: DequantizeBlocks
    quantize_blocks: QuantizeBlocks | None = None
    ggml_type: int | None = None  # GGML type id where the format is a GGML one
    inferflow_type: int | None = None  # GGUF tensor-type id of an Inferflow-only format
    quantize_search: SearchBlocks | None = None  # where the format has a searching quantizer

    @property
    def gguf_type(self) -> int | None:
        """The id a GGUF tensor info gives this format: GGML's own, else Inferflow's (>= 4096,
        which llama.cpp refuses), else None (GGUF cannot hold it)."""
        return self.ggml_type if self.ggml_type is not None else self.inferflow_type

    @property
    def bits_per_weight(self) -> float:
        """Actual bits per weight from the byte layout (scales and mins included)."""
        return self.bytes_per_block * 8 / self.block_size

    def nbytes(self, n_weights: int) -> int:
        if n_weights % self.block_size:
            raise ValueError(
                f"{self.name}: {n_weights} weights is not a multiple of block size {self.block_size}"
            )
        return n_weights // self.block_size * self.bytes_per_block


FORMATS: Registry[QuantFormat] = Registry("quant format")
# GGUF tensor-type id -> format name, for every format a GGUF file can hold (filled on register)
GGUF_TYPE_NAMES: dict[int, str] = {}
# Inferflow's own formats in GGUF: ids from 4096 up (GGML's end below 64), and a metadata key
# naming the ones a file uses ("Q3H=4103", ...), so a reader can tell what they are
INFERFLOW_GGUF_TYPE_MIN = 4096
GGUF_TYPES_KEY = "inferflow.tensor_types"


def register_format(fmt: QuantFormat) -> QuantFormat:
    if fmt.inferflow_type is not None and fmt.inferflow_type < INFERFLOW_GGUF_TYPE_MIN:
        raise ValueError(f"{fmt.name}: Inferflow GGUF type ids start at {INFERFLOW_GGUF_TYPE_MIN}")
    FORMATS.add(fmt.name, fmt)
    if fmt.gguf_type is not None:
        GGUF_TYPE_NAMES[fmt.gguf_type] = fmt.name
    return fmt


def get_format(name: str) -> QuantFormat:
    return FORMATS.get(name)
