"""Inferflow's quantized checkpoint: a safetensors file whose metadata says which tensors are packed.

A quantized tensor is stored under its own name as a uint8 tensor of shape ``(rows,
bytes_per_row)`` holding the format's raw blocks row after row (blocks run along the last
dimension, as in ``QuantTensor``). The safetensors ``__metadata__`` holds one JSON entry,
``inferflow.quant`` = ``{"version": 1, "tensors": {name: {"format": "Q8_0", "shape": [4096,
4096]}}}``: quant settings live in metadata, never in names. Tensors not listed there are plain
float (or integer) tensors. Any safetensors reader can open the file; ours hands back
``QuantTensor`` for the listed entries.

This module also holds the streaming safetensors writer used for every safetensors output.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from inferflow.errors import CheckpointError
from inferflow.loaders.base import LOADERS, Weight, WeightSource
from inferflow.loaders.gguf_writer import as_bytes
from inferflow.loaders.safetensors import DTYPE_BITS, SafetensorsSource
from inferflow.loaders.safetensors import dtype_name as torch_dtype_name
from inferflow.quant.formats import FORMATS, QuantFormat
from inferflow.quant.tensor import QuantTensor

logger = logging.getLogger(__name__)

QUANT_KEY = "inferflow.quant"
CONTAINER_VERSION = 1
SUPPORTED_VERSIONS = (1,)


@dataclass(frozen=True)
class QuantEntry:
    format: str
    shape: tuple[int, ...]  # logical (torch-order) shape of the dequantized tensor


def packed_shape(fmt: QuantFormat, shape: Sequence[int]) -> tuple[int, int]:
    """Stored uint8 shape ``(rows, bytes_per_row)`` of a tensor of logical ``shape``."""
    if not shape or shape[-1] % fmt.block_size:
        raise CheckpointError(
            f"{fmt.name}: shape {list(shape)} has no last dimension that is a multiple of the "
            f"block size {fmt.block_size}"
        )
    return math.prod(shape[:-1]), shape[-1] // fmt.block_size * fmt.bytes_per_block


def quant_metadata(entries: Mapping[str, QuantEntry]) -> dict[str, str]:
    """The safetensors ``__metadata__`` entry describing the packed tensors."""
    table = {n: {"format": e.format, "shape": list(e.shape)} for n, e in entries.items()}
    return {QUANT_KEY: json.dumps({"version": CONTAINER_VERSION, "tensors": table})}


# --- reading -----------------------------------------------------------------------------------


def _known_formats() -> str:
    return ", ".join(n for n, f in FORMATS.items() if f.block_size > 1)


def parse_quant_metadata(raw: str, where: str) -> dict[str, QuantEntry]:
    """Parse and check the ``inferflow.quant`` JSON (not yet against the stored tensors)."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{where}: {QUANT_KEY} metadata is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), dict):
        raise CheckpointError(f"{where}: {QUANT_KEY} must be an object with a 'tensors' object")
    if doc.get("version") not in SUPPORTED_VERSIONS:
        raise CheckpointError(
            f"{where}: {QUANT_KEY} version {doc.get('version')!r} is not supported; "
            f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    out: dict[str, QuantEntry] = {}
    for name, info in doc["tensors"].items():
        fmt, shape = (info.get("format"), info.get("shape")) if isinstance(info, dict) else (0, 0)
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(
                f"{where}: tensor {name!r}: shape {shape!r} is not a list of ints"
            )
        if not isinstance(fmt, str) or fmt not in FORMATS or FORMATS.get(fmt).block_size == 1:
            raise CheckpointError(
                f"{where}: tensor {name!r} has unknown quant format {fmt!r}; known: "
                f"{_known_formats()}"
            )
        out[name] = QuantEntry(fmt, tuple(shape))
    return out


class QuantizedSource:
    """A WeightSource over another one (safetensors) that returns QuantTensor for packed entries."""

    def __init__(self, inner: WeightSource, where: str = "checkpoint") -> None:
        self._inner = inner
        self.metadata: Mapping[str, Any] = inner.metadata
        raw = inner.metadata.get(QUANT_KEY)
        if not isinstance(raw, str):
            raise CheckpointError(
                f"{where}: not an Inferflow quantized checkpoint (no {QUANT_KEY})"
            )
        self.entries = parse_quant_metadata(raw, where)
        have = set(inner.names())
        for name, e in self.entries.items():
            if name not in have:
                raise CheckpointError(
                    f"{where}: {QUANT_KEY} lists tensor {name!r}, which is absent"
                )
            fmt = FORMATS.get(e.format)
            if e.shape and e.shape[-1] % fmt.block_size:
                raise CheckpointError(
                    f"{where}: tensor {name!r}: last dimension of shape {list(e.shape)} is not a "
                    f"multiple of the {e.format} block size {fmt.block_size}"
                )
            want = math.prod(e.shape) // fmt.block_size * fmt.bytes_per_block
            stored, dtype = inner.shape(name), inner.dtype_name(name)
            if dtype != "U8" or math.prod(stored) != want:
                raise CheckpointError(
                    f"{where}: tensor {name!r} ({e.format}, shape {list(e.shape)}) needs {want} "
                    f"bytes of U8 blocks, the file stores {dtype} of shape {list(stored)}"
                )
        logger.debug("%s: %d of %d tensors quantized", where, len(self.entries), len(have))

    def names(self) -> list[str]:
        return self._inner.names()

    def get(self, name: str) -> Weight:
        data = self._inner.get(name)
        e = self.entries.get(name)
        if e is None:
            return data
        if not isinstance(data, torch.Tensor):  # only a plain inner source makes sense here
            raise CheckpointError(f"tensor {name!r}: packed data is already a {data.format}")
        return QuantTensor(data, e.format, e.shape)

    def shape(self, name: str) -> tuple[int, ...]:
        e = self.entries.get(name)
        return e.shape if e is not None else self._inner.shape(name)

    def dtype_name(self, name: str) -> str:
        e = self.entries.get(name)
        return e.format if e is not None else self._inner.dtype_name(name)

    def __iter__(self) -> Iterator[tuple[str, Weight]]:
        for name in self.names():
            yield name, self.get(name)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> QuantizedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wrap_if_quantized(source: WeightSource) -> WeightSource:
    """``source`` itself, or a QuantizedSource over it when its metadata marks packed tensors."""
    if isinstance(source, QuantizedSource) or QUANT_KEY not in source.metadata:
        return source
    try:
        return QuantizedSource(source)
    except BaseException:
        source.close()
        raise


@LOADERS.register("inferflow_quant")
def open_inferflow_quant(paths: Sequence[Path]) -> WeightSource:
    """Open an Inferflow quantized checkpoint (one file or shards); plain safetensors is an error."""
    inner = SafetensorsSource(paths)
    try:
        return QuantizedSource(inner, ", ".join(map(str, paths)))
    except BaseException:
        inner.close()
        raise


# --- writing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file as stored: safetensors dtype name and stored shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


def write_safetensors(
    f: BinaryIO,
    tensors: Sequence[StoredTensor],
    produce: Callable[[StoredTensor], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Stream a safetensors file: header from the plans, then ``produce(t)`` one tensor at a time.

    safetensors' own ``save_file`` needs every tensor in memory at once; here only one is. The
    header is padded with spaces to a multiple of 8 bytes, as the reference writer does.
    Returns the bytes written.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        if t.name in header or t.name == "__metadata__":
            raise CheckpointError(f"duplicate or reserved tensor name {t.name!r}")
        if t.dtype not in DTYPE_BITS:
            raise CheckpointError(f"tensor {t.name!r}: unknown safetensors dtype {t.dtype!r}")
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for t in tensors:
        data = produce(t)
        if torch_dtype_name(data.dtype) != t.dtype:
            raise CheckpointError(
                f"tensor {t.name!r}: produced {torch_dtype_name(data.dtype)}, the header says {t.dtype}"
            )
        buf = as_bytes(data)
        if buf.nbytes != t.nbytes:
            raise CheckpointError(
                f"tensor {t.name!r} ({t.dtype}, shape {list(t.shape)}): produced {buf.nbytes} "
                f"bytes, the header promised {t.nbytes}"
            )
        f.write(buf)
    return 8 + len(raw) + offset
