"""Our own GGUF v2/v3 parser: header, metadata and tensor infos read from an mmap (the sources
built on it are ``loaders/gguf.py``).

Layout (ggml docs/gguf.md): magic ``GGUF``, uint32 version, uint64 tensor count, uint64 kv count,
the key/value pairs, the tensor infos (name, n_dims, ne[0..n), type, offset), padding to
``general.alignment`` (default 32), then the tensor data. All little-endian.

Every count, length and offset read from the file is checked against the bytes that remain before
anything is allocated or read, so a hostile or truncated file raises ``CheckpointError`` naming
the field and the numbers, never a raw ``struct.error``/``IndexError``/``MemoryError``.
gguf-py is only the test oracle; this module does not import it.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferflow.errors import CheckpointError
from inferflow.quant.formats import (
    GGUF_TYPE_NAMES,
    GGUF_TYPES_KEY,
    INFERFLOW_GGUF_TYPE_MIN,
    get_format,
)

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long gone
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # arrays of arrays: cap the recursion a hostile file could ask for
# A metadata array longer than this (a vocabulary, its scores, its merges) is not held by an open
# GGUFSource: it is read through the parse cache when asked for (GgufMetadata)
LONG_ARRAY = 1024
KEY_VALUE_WINDOW = 64 << 20  # bytes mapped to read the key/values (a 262k vocabulary needs ~10 MB)


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_DTYPES: dict[int, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
_KNOWN_VALUE_TYPES = ", ".join(f"{t.name}({int(t)})" for t in GGUFValueType)
# smallest encoding of one value of each type, to bound declared array counts
_MIN_VALUE_SIZE = {**{t: d.itemsize for t, d in _SCALAR_DTYPES.items()}, 8: 8, 9: 12}

# Unquantized GGML types returned as plain torch tensors: id -> (name, numpy dtype, torch dtype)
_PLAIN_TYPES: dict[int, tuple[str, np.dtype[Any], torch.dtype]] = {
    0: ("F32", np.dtype("<f4"), torch.float32),
    1: ("F16", np.dtype("<f2"), torch.float16),
    30: ("BF16", np.dtype("<u2"), torch.bfloat16),  # numpy has no bfloat16: view the bits
    24: ("I8", np.dtype("<i1"), torch.int8),
    25: ("I16", np.dtype("<i2"), torch.int16),
    26: ("I32", np.dtype("<i4"), torch.int32),
    27: ("I64", np.dtype("<i8"), torch.int64),
    28: ("F64", np.dtype("<f8"), torch.float64),
}


def _type_layout(type_id: int, declared: dict[int, str]) -> tuple[str, int, int] | None:
    """(name, weights per block, bytes per block) of a tensor type we can load: GGML's, or an
    Inferflow format the file declares in its ``inferflow.tensor_types`` key."""
    if type_id in _PLAIN_TYPES:
        name, npd, _ = _PLAIN_TYPES[type_id]
        return name, 1, npd.itemsize
    if type_id in GGUF_TYPE_NAMES and (type_id < INFERFLOW_GGUF_TYPE_MIN or type_id in declared):
        fmt = get_format(GGUF_TYPE_NAMES[type_id])
        return fmt.name, fmt.block_size, fmt.bytes_per_block
    return None


def _supported_types() -> str:
    ids = sorted({**{i: n for i, (n, _, _) in _PLAIN_TYPES.items()}, **GGUF_TYPE_NAMES}.items())
    return ", ".join(f"{n}({i})" for i, n in ids)


def _declared_types(path: Path, metadata: dict[str, Any]) -> dict[int, str]:
    """The Inferflow tensor types a file names in ``inferflow.tensor_types`` ("Q3H=4103", ...);
    each must be one of ours under its own id (a file from another version fails here)."""
    value = metadata.get(GGUF_TYPES_KEY, [])
    out: dict[int, str] = {}
    for item in value if isinstance(value, list) else [value]:
        name, _, tid = str(item).partition("=")
        if (
            not tid.isdigit()
            or int(tid) < INFERFLOW_GGUF_TYPE_MIN
            or (GGUF_TYPE_NAMES.get(int(tid)) != name)
        ):
            known = [f"{n}={i}" for i, n in GGUF_TYPE_NAMES.items() if i >= INFERFLOW_GGUF_TYPE_MIN]
            raise CheckpointError(
                f"{path}: {GGUF_TYPES_KEY} entry {str(item)[:64]!r} is not an Inferflow tensor "
                f"type; known: {', '.join(known)}"
            )
        out[int(tid)] = name
    return out


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: GGUF's ne[] reversed
    ggml_type: int
    type_name: str
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; errors name the field being read."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise CheckpointError(
                f"{self.path}: truncated or corrupt GGUF: {what} needs {n} bytes at offset "
                f"{self.pos}, but only {self.size - self.pos} of the file's {self.size} remain"
            )

    def bound(self, count: int, each: int, what: str) -> None:
        """A declared count of items, each at least ``each`` bytes, must fit in the rest."""
        if count * each > self.size - self.pos:
            raise CheckpointError(
                f"{self.path}: truncated or corrupt GGUF: {what} declares {count} items (at "
                f"least {count * each} bytes), but only {self.size - self.pos} bytes remain"
            )

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.unpack("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.unpack("<Q", 8, what))

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        self.need(n, f"{what} (declared length {n})")
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def name(self, what: str) -> str:
        """A key or tensor name: must be valid UTF-8."""
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} is not valid UTF-8: {raw[:64]!r}") from e


def _decode_value(raw: bytes, key: str, path: Path) -> str:
    # llama.cpp accepts any bytes in string values (some vocabularies hold raw byte tokens);
    # surrogateescape keeps them round-trippable instead of refusing the whole file.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        logger.warning("%s: metadata %r holds a string that is not valid UTF-8", path, key)
        return raw.decode("utf-8", errors="surrogateescape")


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> tuple[Any, tuple[int, ...]]:
    """One metadata value and its type path, e.g. (ARRAY, STRING) for a token list."""
    if vtype in _SCALAR_DTYPES:
        dt = _SCALAR_DTYPES[vtype]
        cur.need(dt.itemsize, f"value of {key!r}")
        value = np.frombuffer(cur.buf, dt, 1, cur.pos)[0].item()
        cur.pos += dt.itemsize
        return (bool(value) if vtype == GGUFValueType.BOOL else value), (GGUFValueType(vtype),)
    if vtype == GGUFValueType.STRING:
        return _decode_value(cur.raw_string(f"value of {key!r}"), key, cur.path), (vtype,)
    if vtype == GGUFValueType.ARRAY:
        if depth >= MAX_ARRAY_NESTING:
            raise CheckpointError(
                f"{cur.path}: metadata {key!r} nests arrays deeper than {MAX_ARRAY_NESTING}"
            )
        itype = cur.u32(f"array item type of {key!r}")
        if itype not in _MIN_VALUE_SIZE:
            raise CheckpointError(
                f"{cur.path}: metadata {key!r} is an array of unknown value type {itype}; "
                f"known: {_KNOWN_VALUE_TYPES}"
            )
        count = cur.u64(f"array length of {key!r}")
        cur.bound(count, _MIN_VALUE_SIZE[itype], f"{GGUFValueType(itype).name} array {key!r}")
        return _read_array(cur, itype, count, key, depth)
    raise CheckpointError(
        f"{cur.path}: metadata {key!r} has unknown value type {vtype}; known: {_KNOWN_VALUE_TYPES}"
    )


def _read_array(
    cur: _Cursor, itype: int, count: int, key: str, depth: int
) -> tuple[list[Any], tuple[int, ...]]:
    arr_t = GGUFValueType.ARRAY
    if itype in _SCALAR_DTYPES:
        # one numpy read for the whole array (the bounds were checked by the caller)
        dt = _SCALAR_DTYPES[itype]
        values = np.frombuffer(cur.buf, dt, count, cur.pos)
        cur.pos += count * dt.itemsize
        if itype == GGUFValueType.BOOL:
            return (values != 0).tolist(), (arr_t, GGUFValueType.BOOL)
        return values.tolist(), (arr_t, GGUFValueType(itype))
    if itype == GGUFValueType.STRING:
        return _read_string_array(cur, count, key), (arr_t, GGUFValueType.STRING)
    items: list[Any] = []
    inner: tuple[int, ...] = (arr_t,)  # an empty array of arrays has no known leaf type
    for _ in range(count):
        value, inner = _read_value(cur, itype, key, depth + 1)
        items.append(value)
    return items, (arr_t, *inner)


def _read_string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    # Hot loop (a 262k-token vocabulary): locals only, one bounds check per string.
    buf, size, pos, unpack = cur.buf, cur.size, cur.pos, struct.Struct("<Q").unpack_from
    out: list[str] = []
    append = out.append
    for i in range(count):
        if size - pos < 8:
            cur.pos = pos
            cur.need(8, f"length of item {i} of {key!r}")
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos:
            cur.pos = pos
            cur.need(n, f"item {i} of {key!r} (declared length {n})")
        chunk = buf[pos : pos + n]
        pos += n
        try:
            append(str(chunk, "utf-8"))
        except UnicodeDecodeError:
            append(_decode_value(bytes(chunk), key, cur.path))
    cur.pos = pos
    return out


@dataclass
class _Header:
    version: int
    metadata: dict[str, Any]
    metadata_types: dict[str, tuple[int, ...]]
    tensors: dict[str, GGUFTensorInfo]
    alignment: int
    data_offset: int
    kv_end: int  # where the key/values end (the tensor infos begin)


def _map(path: Path, window: int | None = None) -> np.memmap[Any, np.dtype[np.uint8]]:
    """Check magic and version with a plain read, then memory-map the whole file (or its first
    ``window`` bytes)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
    if head[:4] != GGUF_MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file: it starts with {head[:4]!r}, expected {GGUF_MAGIC!r}"
        )
    if len(head) < 8:
        raise CheckpointError(f"{path}: truncated GGUF: {size} bytes, the header needs 24")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in SUPPORTED_VERSIONS:
        hint = ""
        if version & 0xFFFF == 0 and struct.unpack(">I", head[4:8])[0] in SUPPORTED_VERSIONS:
            hint = " (this is a big-endian GGUF file; only little-endian ones are supported)"
        raise CheckpointError(
            f"{path}: unsupported GGUF version {version}{hint}; supported: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    shape = None if window is None or window >= size else (window,)
    return np.memmap(path, dtype=np.uint8, mode="r", shape=shape)


def _parse(
    mm: np.ndarray, path: Path, with_tensors: bool = True, known: _Header | None = None
) -> _Header:
    """The header; with ``known`` (this file's key/values as ``_file_layout`` keeps them), the
    key/values are not parsed again: the tensor infos are read from where they end."""
    cur = _Cursor(mm.data, path)  # a memoryview of the mapping: no copy
    cur.pos = 4
    version = cur.u32("version")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata key/value count")
    cur.bound(n_kv, 13, "the metadata count")  # key length + type + a 1-byte value at least
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[int, ...]] = {}
    if known is not None:
        metadata, types, cur.pos = dict(known.metadata), dict(known.metadata_types), known.kv_end
    for i in range(0 if known is not None else n_kv):
        key = cur.name(f"metadata key #{i}")
        if key in metadata:
            raise CheckpointError(f"{path}: duplicate metadata key {key!r}")
        vtype = cur.u32(f"value type of {key!r}")
        metadata[key], types[key] = _read_value(cur, vtype, key)
    kv_end = cur.pos

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        if (
            types["general.alignment"] != (GGUFValueType.UINT32,)
            or alignment <= 0
            or (alignment & (alignment - 1))
        ):
            raise CheckpointError(
                f"{path}: general.alignment must be a uint32 power of two, got {alignment!r} "
                f"of type {[GGUFValueType(t).name for t in types['general.alignment']]}"
            )
    if not with_tensors:
        return _Header(version, metadata, types, {}, alignment, 0, kv_end)

    cur.bound(n_tensors, 24, "the tensor count")  # name length + n_dims + type + offset
    raw_infos = []
    for i in range(n_tensors):
        name = cur.name(f"name of tensor #{i}")
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dims, at most {MAX_DIMS}")
        ne = [cur.u64(f"dim {d} of tensor {name!r}") for d in range(n_dims)]
        type_id = cur.u32(f"type of tensor {name!r}")
        offset = cur.u64(f"data offset of tensor {name!r}")
        raw_infos.append((name, ne, type_id, offset))
    data_offset = -(-cur.pos // alignment) * alignment

    declared = _declared_types(path, metadata)
    tensors = _tensor_infos(path, cur.size, raw_infos, data_offset, alignment, declared)
    return _Header(version, metadata, types, tensors, alignment, data_offset, kv_end)


def _tensor_infos(
    path: Path,
    size: int,
    raw: list[tuple[str, list[int], int, int]],
    base: int,
    align: int,
    declared: dict[int, str],
) -> dict[str, GGUFTensorInfo]:
    """Validate the tensor infos against the types we know and the file's size."""
    out: dict[str, GGUFTensorInfo] = {}
    for name, ne, type_id, offset in raw:
        if name in out:
            raise CheckpointError(f"{path}: duplicate tensor name {name!r}")
        layout = _type_layout(type_id, declared)
        if layout is None and type_id in GGUF_TYPE_NAMES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has type {type_id} ({GGUF_TYPE_NAMES[type_id]}), an "
                f"Inferflow type the file does not declare in {GGUF_TYPES_KEY}"
            )
        if layout is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unknown or unsupported GGML type {type_id}; "
                f"supported: {_supported_types()}"
            )
        type_name, block, per_block = layout
        row = ne[0] if ne else 1  # GGML: dims not given are 1, so a 0-d tensor is one weight
        if row % block:
            raise CheckpointError(
                f"{path}: tensor {name!r} of type {type_name} has a row of {row} weights, "
                f"not a multiple of the block size {block}"
            )
        nonzero = math.prod(d for d in ne if d)  # a zero dim empties the tensor, not its rows
        if max(nonzero, row // block * per_block) >= 1 << 63:
            # ggml counts in int64 (gguf.c refuses these too); torch and numpy shapes as well
            raise CheckpointError(
                f"{path}: tensor {name!r} ({type_name}, ne={ne}) has more weights or row bytes "
                "than an int64 can count"
            )
        if offset % align:
            raise CheckpointError(
                f"{path}: tensor {name!r} has data offset {offset}, not a multiple of the "
                f"alignment {align}"
            )
        start, nbytes = base + offset, math.prod(ne) // block * per_block
        if start + nbytes > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({type_name}, ne={ne}) needs bytes "
                f"[{start}, {start + nbytes}) but the file has only {size} bytes (truncated?)"
            )
        out[name] = GGUFTensorInfo(name, tuple(reversed(ne)), type_id, type_name, start, nbytes)
    _refuse_overlaps(path, out)
    return out


def _refuse_overlaps(path: Path, infos: dict[str, GGUFTensorInfo]) -> None:
    """ggml refuses tensors whose data overlap (gguf.c wants them packed in order); sharing bytes
    would also let a small file declare any number of gigabytes of weights."""
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos.values() if i.nbytes)
    last = (0, 0, "")  # the span reaching furthest so far
    for span in spans:
        if span[0] < last[1]:
            raise CheckpointError(
                f"{path}: tensors {last[2]!r} (bytes [{last[0]}, {last[1]})) and {span[2]!r} "
                f"(bytes [{span[0]}, {span[1]})) overlap; each tensor needs bytes of its own"
            )
        if span[1] > last[1]:
            last = span


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the header's key/values (no tensor infos): for resolving hyperparameters and the
    tokenizer. Parsed once per file version (the vocabulary arrays take a while) and shared with
    the file's GGUFSource until ``forget_metadata``."""
    return dict(_key_values(Path(path)).metadata)


def _file_key(path: Path) -> tuple[Path, int, int]:
    try:
        st = path.stat()
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
    return path.resolve(), st.st_mtime_ns, st.st_size


def _key_values(path: Path) -> _Header:
    key = _file_key(path)
    header = _parsed_key_values(*key)
    _file_layout(*key)  # (made now, from this parse, for a GGUFSource opened after forgetting)
    return header


@functools.lru_cache(maxsize=4)
def _parsed_key_values(path: Path, mtime_ns: int, size: int) -> _Header:
    """Parsed from a mapping of the file's first ``KEY_VALUE_WINDOW`` bytes: reading a spec's
    hyperparameters maps a few MiB, not a 1 GB model (address space is a limit where a process
    runs under ``RLIMIT_AS``). Key/values reaching past the window, or a corrupt header, are
    parsed again from the whole file, which also gives the error its true sizes."""
    if size > KEY_VALUE_WINDOW:
        try:
            return _parse(_map(path, KEY_VALUE_WINDOW), path, with_tensors=False)
        except CheckpointError:
            pass
    return _parse(_map(path), path, with_tensors=False)


@functools.lru_cache(maxsize=16)
def _file_layout(path: Path, mtime_ns: int, size: int) -> _Header:
    """The key/values without the long arrays, and where they end (a few KiB; kept past
    forget_metadata): what a GGUFSource needs to read its tensor infos."""
    h = _parsed_key_values(path, mtime_ns, size)
    short = {
        k: v for k, v in h.metadata.items() if not (isinstance(v, list) and len(v) > LONG_ARRAY)
    }
    return _Header(h.version, short, h.metadata_types, {}, h.alignment, 0, h.kv_end)


def forget_metadata() -> None:
    """Drop the parsed key/values kept for the next reader of each file (a loaded model's
    tokenizer holds what it needs: a 262k-token vocabulary's strings are ~35 MB). An open
    GGUFSource keeps every value but the long arrays, which it parses again if asked for."""
    _parsed_key_values.cache_clear()


class GgufMetadata(Mapping[str, Any]):
    """A GGUFSource's key/values: the short ones held, each array longer than ``LONG_ARRAY``
    (a vocabulary, its scores or merges) taken from ``read_gguf_metadata``'s parse when asked
    for, so a source open while a model loads does not hold a vocabulary beside the tokenizer."""

    def __init__(self, path: Path, short: dict[str, Any], keys: Sequence[str]) -> None:
        self._path, self._short, self._keys = path, short, dict.fromkeys(keys)

    def __getitem__(self, key: str) -> Any:
        if key in self._short:
            return self._short[key]
        if key in self._keys:
            return _key_values(self._path).metadata[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
