"""Our own GGUF v3 writer: typed metadata, tensor infos, aligned tensor data, streamed.

Layout (ggml docs/gguf.md, the mirror of ``loaders/gguf_parse.py``): magic ``GGUF``, uint32 version,
uint64 tensor count, uint64 key/value count, the key/values (key string, uint32 value type,
value), the tensor infos (name, uint32 n_dims, uint64 ne[n_dims] in GGML order = torch shape
reversed, uint32 GGML type, uint64 offset relative to the data section), zero padding to
``general.alignment`` (32 by default), then each tensor's bytes, each padded to the alignment as
gguf-py's GGUFWriter does. Tensor data is produced one tensor at a time by a callback, so a model
never has to fit in memory twice. gguf-py is only the test oracle; this module does not import it.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

from inferflow.errors import CheckpointError
from inferflow.loaders.gguf import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType
from inferflow.quant.formats import (
    FORMATS,
    GGUF_TYPE_NAMES,
    GGUF_TYPES_KEY,
    INFERFLOW_GGUF_TYPE_MIN,
    get_format,
)

logger = logging.getLogger(__name__)

GGUF_VERSION = 3
MAX_NAME_BYTES = 63  # GGML_MAX_NAME (64) includes the terminating NUL: llama.cpp refuses longer

V = GGUFValueType
_SCALAR_STRUCT: dict[int, str] = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
}  # fmt: skip
_SCALAR_NUMPY: dict[int, str] = {
    V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4",
    V.INT32: "<i4", V.FLOAT32: "<f4", V.BOOL: "<u1", V.UINT64: "<u8", V.INT64: "<i8",
    V.FLOAT64: "<f8",
}  # fmt: skip
_INT_TYPES = {V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64}

# GGML types with no codec row in the format table (plain integers, f64): name -> (id, bytes)
_PLAIN_EXTRA: dict[str, tuple[int, int]] = {
    "I8": (24, 1), "I16": (25, 2), "I32": (26, 4), "I64": (27, 8), "F64": (28, 8),
}  # fmt: skip

TypePath = tuple[int, ...]  # e.g. (UINT32,) or (ARRAY, STRING), as GGUFSource.metadata_types


def gguf_type_names() -> list[str]:
    """Every tensor type name this writer can store (as raw bytes): GGML's and Inferflow's."""
    return sorted({*GGUF_TYPE_NAMES.values(), *_PLAIN_EXTRA})


def _type_layout(type_name: str) -> tuple[int, int, int]:
    """(GGUF type id, weights per block, bytes per block) of a tensor type name."""
    if type_name in _PLAIN_EXTRA:
        type_id, size = _PLAIN_EXTRA[type_name]
        return type_id, 1, size
    fmt = get_format(type_name) if type_name in FORMATS else None
    if fmt is None or fmt.gguf_type is None:
        raise CheckpointError(
            f"GGUF cannot store tensor type {type_name!r}; known: {', '.join(gguf_type_names())}"
        )
    return fmt.gguf_type, fmt.block_size, fmt.bytes_per_block


@dataclass(frozen=True)
class GGUFTensorPlan:
    """One tensor to write: its name, torch-order shape and GGML type name (F32, Q8_0, ...)."""

    name: str
    shape: tuple[int, ...]
    type_name: str

    @property
    def ggml_type(self) -> int:
        return _type_layout(self.type_name)[0]

    @property
    def nbytes(self) -> int:
        _, block, per_block = _type_layout(self.type_name)
        if self.shape and self.shape[-1] % block:
            raise CheckpointError(
                f"tensor {self.name!r}: a row of {self.shape[-1]} weights is not a multiple of "
                f"the {self.type_name} block size {block}"
            )
        return math.prod(self.shape) // block * per_block


def infer_value_type(value: Any, key: str = "?") -> TypePath:
    """The GGUF type path for a Python value, as gguf-py infers it (int -> INT32, float -> F32).

    Integers outside int32 become INT64 (UINT64 above int64). Give explicit types for keys whose
    readers expect a particular width (llama.cpp reads most counts as UINT32).
    """
    if isinstance(value, (bool, np.bool_)):
        return (V.BOOL,)
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if -(2**31) <= v < 2**31:
            return (V.INT32,)
        return (V.INT64,) if -(2**63) <= v < 2**63 else (V.UINT64,)
    if isinstance(value, (float, np.floating)):
        return (V.FLOAT32,)
    if isinstance(value, str):
        return (V.STRING,)
    if isinstance(value, (list, tuple)):
        if not value:
            raise CheckpointError(f"metadata {key!r}: an empty array needs an explicit item type")
        items = [infer_value_type(v, key) for v in value]
        if all(t == (V.INT32,) or t == (V.INT64,) for t in items):
            widest = (V.INT64,) if (V.INT64,) in items else (V.INT32,)
            return (V.ARRAY, *widest)
        if any(t != items[0] for t in items):
            raise CheckpointError(f"metadata {key!r}: array items of mixed types {set(items)}")
        return (V.ARRAY, *items[0])
    raise CheckpointError(
        f"metadata {key!r}: cannot store a {type(value).__name__} in GGUF "
        "(bool, int, float, str or lists of them)"
    )


def _string(s: str) -> bytes:
    # surrogateescape undoes the reader's decoding of non-UTF-8 vocabulary bytes exactly
    raw = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(raw)) + raw


def _check_scalar(value: Any, vtype: int, key: str) -> None:
    is_bool = isinstance(value, (bool, np.bool_))
    if vtype == V.BOOL:
        ok = is_bool
    elif vtype in _INT_TYPES:
        ok = isinstance(value, (int, np.integer)) and not is_bool
    else:  # floats take ints too (gguf-py does the same)
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not is_bool
    if not ok:
        raise CheckpointError(
            f"metadata {key!r}: {type(value).__name__} value {value!r} does not fit GGUF type "
            f"{V(vtype).name}"
        )


def _encode_value(value: Any, path: TypePath, key: str, out: list[bytes]) -> None:
    """Append the bytes of ``value`` (without its leading type tag) to ``out``."""
    vtype = path[0]
    if vtype in _SCALAR_STRUCT:
        _check_scalar(value, vtype, key)
        try:
            out.append(struct.pack(_SCALAR_STRUCT[vtype], value))
        except (struct.error, OverflowError) as e:
            raise CheckpointError(f"metadata {key!r}: {value!r} as {V(vtype).name}: {e}") from e
    elif vtype == V.STRING:
        if not isinstance(value, str):
            raise CheckpointError(f"metadata {key!r}: expected a string, got {value!r}")
        out.append(_string(value))
    elif vtype == V.ARRAY:
        if not isinstance(value, (list, tuple)):
            raise CheckpointError(f"metadata {key!r}: expected a list, got {type(value).__name__}")
        inner = path[1:] or (V.ARRAY,)  # the reader's path for an empty array of arrays
        out.append(struct.pack("<IQ", inner[0], len(value)))
        if inner[0] in _SCALAR_NUMPY:
            for v in value:  # numpy would silently coerce floats and bools into int arrays
                _check_scalar(v, inner[0], key)
            try:  # one conversion for a whole 49k-entry token_type array
                out.append(np.asarray(value, dtype=_SCALAR_NUMPY[inner[0]]).tobytes())
            except (OverflowError, ValueError) as e:
                raise CheckpointError(f"metadata {key!r}: {V(inner[0]).name} array: {e}") from e
        elif inner[0] == V.STRING:
            for v in value:
                if not isinstance(v, str):
                    raise CheckpointError(f"metadata {key!r}: string array holds {v!r}")
            out.extend(_string(v) for v in value)
        else:
            for v in value:
                _encode_value(v, inner, key, out)
    else:
        raise CheckpointError(f"metadata {key!r}: unknown GGUF value type {vtype}")


def encode_metadata(
    metadata: Mapping[str, Any], types: Mapping[str, TypePath] | None = None
) -> bytes:
    """All key/values: explicit ``types`` (GGUFSource.metadata_types) win, else inferred."""
    types = types or {}
    out: list[bytes] = []
    for key, value in metadata.items():
        path = tuple(types[key]) if key in types else infer_value_type(value, key)
        if not path or path[0] not in V._value2member_map_:
            raise CheckpointError(f"metadata {key!r}: bad GGUF type path {path!r}")
        out.append(_string(key))
        out.append(struct.pack("<I", path[0]))
        _encode_value(value, path, key, out)
    return b"".join(out)


def _alignment(metadata: Mapping[str, Any]) -> int:
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"general.alignment must be a power of two, got {align!r}")
    return align


def _pad(n: int, align: int) -> int:
    return -n % align


def as_bytes(data: Any) -> memoryview:
    """A tensor's (or array's, or bytes') raw little-endian bytes without a copy where possible."""
    if isinstance(data, torch.Tensor):
        flat = data.detach().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy() if flat.numel() else b""
    elif isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return memoryview(data).cast("B")


def write_gguf(
    f: BinaryIO,
    metadata: Mapping[str, Any],
    tensors: Sequence[GGUFTensorPlan],
    produce: Callable[[GGUFTensorPlan], Any],
    types: Mapping[str, TypePath] | None = None,
) -> int:
    """Write a GGUF v3 file to ``f``; ``produce(plan)`` returns each tensor's raw bytes.

    ``produce`` may return a torch tensor, numpy array or bytes of exactly ``plan.nbytes``; it is
    called in ``tensors`` order, after the header is written. Returns the bytes written. Tensors
    of Inferflow's own formats are named in the ``inferflow.tensor_types`` key (set here).
    """
    align = _alignment(metadata)
    own = sorted(
        {(t.ggml_type, t.type_name) for t in tensors if t.ggml_type >= INFERFLOW_GGUF_TYPE_MIN}
    )
    metadata = {k: v for k, v in metadata.items() if k != GGUF_TYPES_KEY}
    types = {k: v for k, v in (types or {}).items() if k != GGUF_TYPES_KEY}
    if own:
        metadata[GGUF_TYPES_KEY] = [f"{name}={tid}" for tid, name in own]
        types[GGUF_TYPES_KEY] = (V.ARRAY, V.STRING)
    names: set[str] = set()
    infos: list[bytes] = []
    offset = 0
    for t in tensors:
        if t.name in names:
            raise CheckpointError(f"duplicate tensor name {t.name!r}")
        names.add(t.name)
        if len(t.name.encode("utf-8")) > MAX_NAME_BYTES:
            logger.warning(
                "tensor name %r is longer than %d bytes: llama.cpp will refuse the file",
                t.name,
                MAX_NAME_BYTES,
            )
        shape = t.shape or (1,)  # GGML has no 0-d tensors; a scalar is one element
        infos.append(_string(t.name) + struct.pack("<I", len(shape)))
        infos.append(struct.pack(f"<{len(shape)}Q", *reversed(shape)))
        infos.append(struct.pack("<IQ", t.ggml_type, offset))
        offset += t.nbytes + _pad(t.nbytes, align)
    head = b"".join(
        [
            GGUF_MAGIC,
            struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata)),
            encode_metadata(metadata, types),
            *infos,
        ]
    )
    f.write(head)
    f.write(bytes(_pad(len(head), align)))
    written = len(head) + _pad(len(head), align)
    for t in tensors:
        buf = as_bytes(produce(t))
        if buf.nbytes != t.nbytes:
            raise CheckpointError(
                f"tensor {t.name!r} ({t.type_name}, shape {list(t.shape)}): produced "
                f"{buf.nbytes} bytes, the header promised {t.nbytes}"
            )
        f.write(buf)
        f.write(bytes(_pad(buf.nbytes, align)))
        written += buf.nbytes + _pad(buf.nbytes, align)
    logger.debug("wrote GGUF v%d: %d keys, %d tensors", GGUF_VERSION, len(metadata), len(tensors))
    return written
