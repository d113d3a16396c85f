"""Quantization: the format table, codecs (GGML types and Inferflow's own) and QuantTensor."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from inferflow.errors import QuantError
from inferflow.quant import ggml as _ggml  # noqa: F401  (registers the GGML formats)
from inferflow.quant import logscale as _logscale  # noqa: F401  (and its quantized-scale ones)
from inferflow.quant import minmax as _minmax  # noqa: F401  (registers Inferflow's min-max formats)
from inferflow.quant.formats import FORMATS, METHODS, QuantFormat, get_format
from inferflow.quant.logscale import LOGSCALE_FORMATS
from inferflow.quant.minmax import MINMAX_FORMATS
from inferflow.quant.tensor import QuantTensor


class FormatRow(NamedTuple):
    name: str
    block_size: int
    bytes_per_block: int
    bits_per_weight: float  # actual, scales and mins included
    writable: bool  # Inferflow can quantize to it (not only read it)


def format_table(names: list[str] | tuple[str, ...] | None = None) -> list[FormatRow]:
    """One row per format (all registered ones by default), e.g. for the README's size table."""
    rows = []
    for name in FORMATS.names() if names is None else names:
        f = get_format(name)  # an unknown name lists the known ones
        rows.append(
            FormatRow(
                f.name,
                f.block_size,
                f.bytes_per_block,
                f.bits_per_weight,
                f.quantize_blocks is not None,
            )
        )
    return rows


QUANTIZE_CHUNK = 1 << 12  # blocks quantized at a time: temporaries stay in cache (measured best)


def quantize(
    tensor: torch.Tensor,
    fmt: str | QuantFormat,
    method: str = "minmax",
    importance: torch.Tensor | None = None,
) -> QuantTensor:
    """Quantize a float tensor to ``fmt`` along its last dimension, keeping its (torch) shape.

    ``method`` (METHODS): "search" picks each block's grid for the least weighted squared error
    where the format has a searching quantizer (quant/minmax.py), weighting column j by
    ``importance[j]`` when given (an importance matrix row: one positive value per element of
    the last dimension); otherwise, and for "minmax", the format's own rule (GGML formats:
    the reference quantizers, bit-exact with gguf-py). The last dimension must be a multiple of
    the block size: we never pad silently, because padding would change the shape the model
    sees; pad (e.g. with zeros) and slice yourself.
    """
    if method not in METHODS:
        raise QuantError(f"unknown quantization method {method!r}; allowed: {', '.join(METHODS)}")
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    if f.quantize_blocks is None:
        writable = [r.name for r in format_table() if r.writable]
        raise QuantError(f"cannot quantize to {f.name}; writable formats: {', '.join(writable)}")
    if not tensor.is_floating_point():
        raise QuantError(f"{f.name}: can only quantize float tensors, got {tensor.dtype}")
    shape = tuple(tensor.shape)
    last = shape[-1] if shape else 1
    if last % f.block_size:
        raise QuantError(
            f"{f.name}: tensor of shape {list(shape)} has last dimension {last}, not a multiple "
            f"of the block size {f.block_size}; Inferflow does not pad silently (pad the last "
            f"dimension to a multiple of {f.block_size} yourself)"
        )
    blocks = tensor.detach().contiguous().reshape(-1, f.block_size)
    per_row = last // f.block_size
    search = f.quantize_search if method == "search" else None
    imp = None
    if importance is not None:
        if tuple(importance.shape) != (last,) or not bool((importance > 0).all()):
            raise QuantError(
                f"{f.name}: importance must hold {last} positive values (one per element of the "
                f"last dimension), got shape {list(importance.shape)}"
            )
        imp = importance.float().reshape(per_row, f.block_size)
    # blocks are independent: a chunk at a time keeps the codec's temporaries small
    data = torch.empty(blocks.shape[0], f.bytes_per_block, dtype=torch.uint8)
    for i in range(0, blocks.shape[0], QUANTIZE_CHUNK):
        chunk = blocks[i : i + QUANTIZE_CHUNK]
        if search is None:
            data[i : i + len(chunk)] = f.quantize_blocks(chunk)
        else:
            w = None if imp is None else imp[torch.arange(i, i + len(chunk)) % per_row]
            data[i : i + len(chunk)] = search(chunk, w)
    rows = math.prod(shape[:-1]) if shape else 1
    return QuantTensor(data.reshape(rows, -1), f.name, shape)


__all__ = [
    "FORMATS",
    "LOGSCALE_FORMATS",
    "METHODS",
    "MINMAX_FORMATS",
    "FormatRow",
    "QuantFormat",
    "QuantTensor",
    "format_table",
    "get_format",
    "quantize",
]
