"""Header-aware mutations for GGUF and safetensors files.

A GGUF seed is walked once (our own minimal walk, independent of the loader under test) to find
where every count, length, type id, tensor dim and data offset sits; mutations then rewrite those
fields with boundary values. A safetensors seed's JSON header is edited as data (dtype, shape,
data_offsets, __metadata__, duplicate keys) and re-serialised, and its 8-byte length is bent.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferflow.fuzz.mutate import havoc, interesting, pack_uint, set_field

# ---- GGUF ------------------------------------------------------------------------------------

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# GGML type ids: plain, quantized (known to the loader or not), and past the end of the enum
GGML_TYPE_IDS = (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 25, 26, 27, 28, 30, 39, 40, 255, 2**31, 2**32 - 1)  # fmt: skip
VALUE_TYPE_IDS = (*range(14), 255, 2**32 - 1)


@dataclass(frozen=True)
class Field:
    offset: int
    width: int
    kind: str  # count | strlen | vtype | itype | ndims | dim | ggml_type | data_offset | scalar


def walk_gguf(data: bytes) -> tuple[list[Field], int]:
    """The integer fields of a valid GGUF file and the end of its tensor infos."""
    fields: list[Field] = []
    pos = 4

    def take(width: int, kind: str) -> int:
        nonlocal pos
        value = int.from_bytes(data[pos : pos + width], "little")
        fields.append(Field(pos, width, kind))
        pos += width
        return value

    def string() -> None:
        nonlocal pos
        n = take(8, "strlen")  # not ``pos += take(...)``: that adds to pos as it was before take
        pos += n

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            itype = take(4, "itype")
            for _ in range(take(8, "count")):
                value(itype)
        else:
            take(_SCALAR_SIZES[vtype], "scalar")

    take(4, "version")
    n_tensors = take(8, "count")
    n_kv = take(8, "count")
    for _ in range(n_kv):
        string()
        value(take(4, "vtype"))
    for _ in range(n_tensors):
        string()
        for _ in range(take(4, "ndims")):
            take(8, "dim")
        take(4, "ggml_type")
        take(8, "data_offset")
    return fields, pos


def _gguf_field(rng: random.Random, data: bytes, fields: Sequence[Field]) -> bytes:
    f = rng.choice(fields)
    if f.kind == "ggml_type" and rng.random() < 0.7:
        return data[: f.offset] + pack_uint(rng.choice(GGML_TYPE_IDS), 4) + data[f.offset + 4 :]
    if f.kind in ("vtype", "itype") and rng.random() < 0.7:
        return data[: f.offset] + pack_uint(rng.choice(VALUE_TYPE_IDS), 4) + data[f.offset + 4 :]
    return set_field(rng, data, f.offset, f.width)


def mutate_gguf(rng: random.Random, seed: bytes, seeds: Sequence[bytes]) -> bytes:
    """One mutant of a GGUF seed: header fields, header bytes, truncation, or plain havoc."""
    fields, header_end = walk_gguf(seed)
    roll = rng.random()
    if roll < 0.45:
        out = seed
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            out = _gguf_field(rng, out, fields)
        return out
    if roll < 0.75:  # format-blind changes inside the header, data section kept
        return havoc(rng, seed[:header_end], seeds) + seed[header_end:]
    if roll < 0.85:  # cut at (or next to) a field boundary
        f = rng.choice(fields)
        cut = f.offset + rng.choice((0, 1, f.width - 1, f.width, f.width + 1))
        return seed[: max(0, cut)]
    if roll < 0.9:  # a field rewritten and the bytes around it shifted
        return havoc(rng, _gguf_field(rng, seed, fields), seeds)
    return havoc(rng, seed, seeds)


# ---- safetensors -----------------------------------------------------------------------------

ST_DTYPES = ("F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "C64", "F4", "F6_E2M3", "F6_E3M2")  # fmt: skip
_ODD_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1.5, float("nan"), "", "F32", "x" * 300, [], {}, [1, [2]], {"a": 1},
    2**64, -(2**63), 10**30,
)  # fmt: skip


def _odd(rng: random.Random) -> Any:
    return rng.choice((*_ODD_VALUES, interesting(rng)))


def _mutate_entry(rng: random.Random, entry: dict[str, Any]) -> None:
    key = rng.choice(("dtype", "shape", "data_offsets", "extra"))
    roll = rng.random()
    if key == "extra":
        entry[rng.choice(("x", "dtype2", "__proto__"))] = _odd(rng)
    elif roll < 0.15:
        entry.pop(key, None)
    elif roll < 0.3:
        entry[key] = _odd(rng)
    elif key == "dtype":
        entry["dtype"] = rng.choice((*ST_DTYPES, "f32", "Q4_0", "F32 ", "complex"))
    elif key == "shape":
        # an earlier round may have left any JSON value here
        shape = list(entry["shape"]) if isinstance(entry.get("shape"), list) else []
        op = rng.random()
        if op < 0.4 and shape:
            i = rng.randrange(len(shape))
            shape[i] = interesting(rng, shape[i] if isinstance(shape[i], int) else 1)
        elif op < 0.6:
            shape.insert(rng.randrange(len(shape) + 1), rng.choice((0, 1, 2, 2**32, 2**63)))
        elif op < 0.8 and shape:
            del shape[rng.randrange(len(shape))]
        else:
            shape = [rng.choice((1, 2, 2**31, 2**40))] * rng.choice((1, 8, 64, 1000))
        entry["shape"] = shape
    else:
        offs = entry.get("data_offsets")
        offs = list(offs) if isinstance(offs, list) else [0, 0]
        if offs and rng.random() < 0.8:
            i = rng.randrange(len(offs))
            offs[i] = interesting(rng, offs[i] if isinstance(offs[i], int) else 0)
        else:
            offs = rng.choice(([], [0], [1, 0], [0, 0, 0], offs[::-1], [0.0, 4.0]))
        entry["data_offsets"] = offs


def _dumps(header: dict[str, Any], rng: random.Random) -> bytes:
    text = json.dumps(
        header, separators=(",", ":"), allow_nan=True, ensure_ascii=rng.random() < 0.5
    )
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate in a name: bad UTF-8


def mutate_safetensors_header(rng: random.Random, header: dict[str, Any]) -> bytes:
    """The JSON text of a mutated copy of ``header`` (a valid header's parsed object)."""
    h = json.loads(json.dumps(header))
    names = [k for k in h if k != "__metadata__"]
    roll = rng.random()
    if roll < 0.5 and names:
        for _ in range(rng.choice((1, 1, 2, 3))):
            entry = h[rng.choice(names)]
            if isinstance(entry, dict):
                _mutate_entry(rng, entry)
    elif roll < 0.6:
        h["__metadata__"] = rng.choice(({"k": _odd(rng)}, _odd(rng), {"format": "pt"}))
    elif roll < 0.7 and names:
        name = rng.choice(names)
        new = rng.choice(("", "a" * 1000, "\u0000", "\ud800x", "../x", "__metadata__", name + "x"))
        h[new] = h.pop(name)
    elif roll < 0.78 and names:
        del h[rng.choice(names)]
    elif roll < 0.86 and names:  # a duplicate key: json.dumps cannot emit one, so splice it in
        name = rng.choice(names)
        text = _dumps(h, rng)
        dup = json.dumps({name: h[name]})[1:-1].encode()
        return text[:-1] + b"," + dup + b"}"
    elif roll < 0.93:
        depth = rng.choice((10, 100, 5000, 100_000))
        return b'{"x":' + b"[" * depth + b"]" * depth + b"}"
    else:
        return _dumps(h, rng)[: rng.randrange(1, 64)]  # a cut-off JSON text
    return _dumps(h, rng)


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def mutate_safetensors(rng: random.Random, seed: bytes, seeds: Sequence[bytes]) -> bytes:
    """One mutant of a valid safetensors seed: its header as JSON, its length, or its bytes."""
    header, body = split_safetensors(seed)
    roll = rng.random()
    if roll < 0.55:
        text = mutate_safetensors_header(rng, header)
    elif roll < 0.65:  # header bytes themselves (bad UTF-8, broken tokens), length kept honest
        text = havoc(rng, _dumps(header, rng), seeds)
    else:
        text = _dumps(header, rng)
    n = len(text)
    if rng.random() < 0.15:
        n = interesting(rng, n)
    if rng.random() < 0.1:
        text += b" " * rng.choice((1, 7, 8))  # padded headers are legal
        n = len(text)
    if rng.random() < 0.15:
        body = body[: rng.randrange(len(body) + 1)] if rng.random() < 0.7 else body + b"\0" * 8
    out = pack_uint(n, 8) + text + body
    if roll >= 0.9:
        out = havoc(rng, out, seeds)
    return out
