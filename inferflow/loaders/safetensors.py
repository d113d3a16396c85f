"""safetensors files (one, or the shards of an index) as a WeightSource.

Each file is memory-mapped (private, copy-on-write: a caller writing into a tensor changes only
its own pages) and a tensor is a view of its bytes, so ``release`` can drop a tensor's pages once
the model holds it in its final form. The header is validated with the rules of the reference
implementation (safetensors ``Metadata::validate``): an 8-byte little-endian header length that
fits in the file, a JSON object, known dtypes, and data offsets that tile the data section exactly
and agree with dtype x shape. A truncated or garbage file then fails with a CheckpointError that
says what is wrong.
"""

from __future__ import annotations

import json
import logging
import math
import os
import reprlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferflow.errors import CheckpointError
from inferflow.loaders.base import LOADERS, WeightSource, release_pages

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's own limit

# json.loads makes a Python object of every value (an empty "{}" becomes a 64-byte dict), so a
# header is checked for how many it holds before it is parsed. The smallest real tensor entry,
# '"x":{"dtype":"U8","shape":[],"data_offsets":[0,0]},' (51 bytes), holds 1 object, 2 arrays and
# 5 strings (10 quotes): a header denser than that per HEADER_BYTES_PER_ENTRY bytes is not real.
HEADER_BYTES_PER_ENTRY = 40
_PER_ENTRY: tuple[tuple[bytes, str, int], ...] = (
    (b"{", "objects", 1), (b"[", "arrays", 2), (b'"', "string quotes", 10),
)  # fmt: skip

# safetensors dtype -> bits per element (safetensors/src/tensor.rs ``Dtype::bitsize``)
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip

# torch dtype -> the safetensors name: also how the pickle loader names dtypes (GGUF-like F32)
_TORCH_NAMES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3", "float8_e8m0fnu": "F8_E8M0", "int16": "I16", "uint16": "U16",
    "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32",
    "complex64": "C64", "float64": "F64", "int64": "I64", "uint64": "U64",
}  # fmt: skip


# safetensors name -> torch dtype, where this torch build has one (F4 / F6 packed types: none)
_TORCH_DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, name) for name, st in _TORCH_NAMES.items() if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a torch dtype (safetensors spelling: F32, BF16, I64, ...)."""
    name = str(dtype).removeprefix("torch.")
    return _TORCH_NAMES.get(name, name)


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets inside the data section
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_offset: int  # absolute offset of the data section


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _check_density(path: Path, raw: bytes) -> None:
    """Refuse a header with more objects, arrays or strings than real tensor entries need."""
    entries = len(raw) // HEADER_BYTES_PER_ENTRY + 2  # + the outer object and __metadata__
    for char, what, per_entry in _PER_ENTRY:
        found, limit = raw.count(char), per_entry * entries + 16
        if found > limit:
            raise CheckpointError(
                f"{path}: safetensors header of {len(raw)} bytes holds {found} {char.decode()!r} "
                f"({what}); at most {limit} allowed ({per_entry} per {HEADER_BYTES_PER_ENTRY} "
                "header bytes, as many as real tensor entries need)"
            )


def _entry(path: Path, name: str, info: Any) -> TensorEntry:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name!r}: {why}")

    if not isinstance(info, dict):
        raise bad(f"header entry is a {type(info).__name__}, expected an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad(f"unknown dtype {reprlib.repr(dtype)}; known: {', '.join(DTYPE_BITS)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {reprlib.repr(shape)} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"data_offsets {reprlib.repr(offsets)} are not [begin, end]")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits >= 1 << 67:  # the reference implementation's checked usize arithmetic overflows
        raise bad(f"{dtype} of shape {reprlib.repr(shape)} has more bytes than 64 bits can count")
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        # integer arithmetic only: a hostile shape makes ``bits`` too large for a float
        need = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits (not whole bytes)"
        raise bad(
            f"{dtype} of shape {reprlib.repr(shape)} needs {need}, data_offsets span "
            f"{offsets[1] - offsets[0]}"
        )
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and validate a safetensors header without touching tensor data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length"
                )
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file or truncated: header length {n} exceeds "
                    f"the {size - 8} bytes after it"
                )
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: safetensors header length {n} exceeds the limit of "
                    f"{MAX_HEADER_BYTES} bytes"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from e
    _check_density(path, raw)
    try:
        text = raw.decode("utf-8")
        del raw  # json.loads(bytes) would decode a second copy
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: safetensors header is a JSON {type(header).__name__}, not an object"
        )
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    tensors = {name: _entry(path, name, info) for name, info in header.items()}
    # the data section must be tiled exactly, in offset order, with nothing after it
    pos = 0
    for name, entry in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if entry.start != pos:
            raise CheckpointError(
                f"{path}: tensor {name!r} starts at data byte {entry.start}, expected {pos} "
                "(overlapping or gapped data_offsets)"
            )
        pos = entry.end
    data_len = size - 8 - n
    if pos != data_len:
        raise CheckpointError(
            f"{path}: tensors cover {pos} bytes of data, the file holds {data_len}"
            + (" (truncated)" if pos > data_len else "")
        )
    return SafetensorsHeader(tensors, meta, 8 + n)


class SafetensorsSource:
    """One or more safetensors files (shards are merged; a name in two shards is an error)."""

    def __init__(self, paths: Sequence[str | Path]) -> None:
        if not paths:
            raise CheckpointError("no safetensors file given")
        self.metadata: dict[str, Any] = {}
        self._owner: dict[str, tuple[Path, TensorEntry]] = {}
        self._maps: dict[Path, np.ndarray] = {}
        self._data: dict[Path, int] = {}  # absolute offset of each file's data section
        for p in map(Path, paths):
            if not os.path.isfile(p):
                raise CheckpointError(f"safetensors file not found: {p}")
            header = read_header(p)
            for name, entry in header.tensors.items():
                if name in self._owner:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {self._owner[name][0]} and {p}"
                    )
                self._owner[name] = (p, entry)
            for k, v in header.metadata.items():  # shards repeat the same metadata
                self.metadata.setdefault(k, v)
            try:
                self._maps[p] = np.memmap(p, dtype=np.uint8, mode="c")
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{p}: cannot map it: {e}") from e
            self._data[p] = header.data_offset
        log.debug(
            "opened %d tensors from %d safetensors file(s)", len(self._owner), len(self._maps)
        )

    def _entry(self, name: str) -> tuple[Path, TensorEntry]:
        try:
            return self._owner[name]
        except KeyError:
            raise CheckpointError(
                f"no tensor named {name!r} in the safetensors files ({len(self._owner)} tensors)"
            ) from None

    def names(self) -> list[str]:
        return list(self._owner)

    def get(self, name: str) -> torch.Tensor:
        """A view of the tensor's bytes in the mapping (copied only where its offset is not a
        multiple of its element size)."""
        path, entry = self._entry(name)
        mm = self._maps.get(path)
        if mm is None:
            raise CheckpointError(f"{path}: safetensors source is closed")
        dtype = _TORCH_DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{path}: cannot load tensor {name!r}: dtype {entry.dtype} has no torch dtype "
                f"here; loadable: {', '.join(_TORCH_DTYPES)}"
            )
        if entry.end == entry.start:
            return torch.empty(entry.shape, dtype=dtype)  # (no bytes to view)
        start = self._data[path] + entry.start
        raw = mm[start : self._data[path] + entry.end]
        if start % dtype.itemsize:
            raw = np.array(raw)  # (aligned copy)
        return torch.from_numpy(raw).view(dtype).reshape(entry.shape)

    def release(self, name: str) -> None:
        """Drop ``name``'s pages from this process's resident memory once it has been read
        into its final form (``release_pages``)."""
        path, entry = self._entry(name)
        start = self._data[path] + entry.start
        release_pages(self._maps.get(path), start, entry.end - entry.start)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1].shape

    def dtype_name(self, name: str) -> str:
        return self._entry(name)[1].dtype

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.get(name)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def close(self) -> None:
        # np.memmap has no close(): dropping it unmaps once no tensor views remain
        self._maps.clear()

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@LOADERS.register("safetensors")
def open_safetensors(paths: Sequence[Path]) -> WeightSource:
    return SafetensorsSource(paths)
