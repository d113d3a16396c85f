"""Mutations for torch checkpoints: pickle opcode streams and the zip archives around them.

Pickles are mutated at opcode granularity (arguments set to boundary values, opcodes inserted
from a table of snippets that includes allow-listed and refused globals, deleted, duplicated);
zip archives are rebuilt by a small writer of our own that can also write what ``zipfile``
never would: traversal and duplicate names, sizes that lie, local headers that disagree with the
central directory, deflate bombs.
"""

from __future__ import annotations

import io
import pickletools
import random
import struct
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from inferflow.fuzz.mutate import havoc, interesting, pack_uint, set_field

_PID = (
    b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"
)
SNIPPETS: tuple[bytes, ...] = (
    b"(", b")", b"]", b"}", b"N", b"\x88", b"\x89", b"K\x05", b"M\xff\xff", b"J\xff\xff\xff\xff",
    b"\x8a\x08" + b"\xff" * 8, b"\x8b\x00\x10\x00\x00", b"X\x04\x00\x00\x00abcd", b"\x8c\x01a",
    b"\x8d" + b"\xff" * 8, b"C\x02ab", b"B\xff\xff\xff\x7f", b"\x8e" + b"\x00" * 8, b"\x96\x01" + b"\0" * 7 + b"z",
    b"\x94", b"h\x00", b"j\x00\x00\x00\x00", b"q\x01", b"r\xff\xff\xff\xff", b"0", b"1", b"2",
    b"R", b"b", b"t", b"\x85", b"\x86", b"\x87", b"l", b"a", b"e", b"d", b"s", b"u", b"\x8f",
    b"\x90", b"\x91", b"\x81", b"\x92", b"Q", b"\x95" + b"\x10" + b"\0" * 7, b"\x80\x05", b"\x80\x07",
    b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch._utils\n_rebuild_tensor_v3\n",
    b"ctorch._utils\n_rebuild_parameter\n", b"ctorch._tensor\n_rebuild_from_type_v2\n",
    b"ccollections\nOrderedDict\n", b"ctorch\nFloatStorage\n", b"ctorch\nUntypedStorage\n",
    b"ctorch\nbfloat16\n", b"ctorch\nSize\n", b"c__builtin__\nset\n", b"c_codecs\nencode\n",
    b"cbuiltins\nbytearray\n", b"ctorch\nTensor\n", b"cos\nsystem\n", b"cbuiltins\neval\n",
    b"ctorch\nload\n", _PID, b"I12\n", b"I01\n", b"F1.5\n", b"Fnan\n", b"S'ab'\n", b"S'\\x\n",
    b"Vabc\\u0000\n", b"L5L\n", b"g0\n", b"p9\n", b"P1\n", b"\x82\x01", b"i", b"o", b"\x97",
    b"\x98", b"\xff", b".",
)  # fmt: skip
_INT_OPS = {"BININT1": (1, False), "BININT2": (2, False), "BININT": (4, True), "LONG1": (-1, True)}
_LEN_OPS = {
    "BINUNICODE": 4, "SHORT_BINUNICODE": 1, "BINUNICODE8": 8, "BINBYTES": 4,
    "SHORT_BINBYTES": 1, "BINBYTES8": 8, "BYTEARRAY8": 8, "BINSTRING": 4, "SHORT_BINSTRING": 1,
    "FRAME": 8, "LONG4": 4, "BINGET": 1, "LONG_BINGET": 4, "BINPUT": 1, "LONG_BINPUT": 4,
    "PROTO": 1,
}  # fmt: skip


def opcode_spans(data: bytes, start: int = 0) -> list[tuple[str, int, int]]:
    """(opcode name, start, end) of each opcode of the valid pickle at ``data[start:]``."""
    ops = list(pickletools.genops(io.BytesIO(data[start:])))
    out = []
    for i, (op, _arg, pos) in enumerate(ops):
        assert pos is not None
        end = ops[i + 1][2] if i + 1 < len(ops) else pos + 1
        assert end is not None
        out.append((op.name, start + pos, start + end))
    return out


def mutate_pickle_ops(
    rng: random.Random, data: bytes, spans: Sequence[tuple[str, int, int]]
) -> bytes:
    """One opcode-level mutation of a pickle whose opcodes are ``spans``."""
    name, a, b = rng.choice(spans)
    roll = rng.random()
    if roll < 0.25 and name in _INT_OPS:
        width, signed = _INT_OPS[name]
        value = interesting(rng)
        if width < 0:  # LONG1: any width up to 8 bytes
            raw = value.to_bytes(9, "little", signed=True).rstrip(b"\0")[:8] or b"\0"
            return data[:a] + b"\x8a" + bytes([len(raw)]) + raw + data[b:]
        return data[: a + 1] + pack_uint(value, width) + data[a + 1 + width :]
    if roll < 0.45 and name in _LEN_OPS:
        return set_field(rng, data, a + 1, _LEN_OPS[name])
    if roll < 0.7:  # a snippet inserted at an opcode boundary
        snippet = b"".join(rng.choice(SNIPPETS) for _ in range(rng.choice((1, 1, 2, 3))))
        return data[:a] + snippet + data[a:]
    if roll < 0.8:
        return data[:a] + data[b:]
    if roll < 0.88:  # a run of opcodes repeated
        _, c, d = rng.choice(spans)
        lo, hi = min(a, c), max(b, d)
        return data[:hi] + data[lo:hi] * rng.choice((1, 2, 50)) + data[hi:]
    if roll < 0.94:  # opcode replaced
        return data[:a] + rng.choice(SNIPPETS) + data[b:]
    return data[:a] + havoc(rng, data[a:b]) + data[b:]


def mutate_pickle(rng: random.Random, data: bytes) -> bytes:
    """A mutant of a valid pickle (opcode-aware most of the time)."""
    if rng.random() < 0.8:
        spans = opcode_spans(data)
        out = data
        for _ in range(rng.choice((1, 1, 2, 3))):
            out = mutate_pickle_ops(rng, out, spans)
            if len(out) != len(data):
                break  # later spans would point into the wrong bytes
        return out
    return havoc(rng, data)


# ---- zip archives ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ZipEntry:
    name: str
    data: bytes
    method: int = zipfile.ZIP_STORED
    local_name: str | None = None  # a local header that disagrees with the central directory
    declared_size: int | None = None  # uncompressed size claimed in both headers
    crc: int | None = None


_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<4sHHHHIIH")


def write_zip(
    entries: Sequence[ZipEntry], comment: bytes = b""
) -> tuple[bytes, list[tuple[int, int]]]:
    """A zip archive of ``entries`` exactly as given, and the (offset, width) of its int fields."""
    out = bytearray()
    central = bytearray()
    fields: list[tuple[int, int]] = []
    widths_local = (2, 2, 2, 2, 2, 4, 4, 4, 2, 2)
    for e in entries:
        payload = zlib.compress(e.data)[2:-4] if e.method == zipfile.ZIP_DEFLATED else e.data
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        size = len(e.data) if e.declared_size is None else e.declared_size
        lname = (e.local_name if e.local_name is not None else e.name).encode(
            "utf-8", "surrogatepass"
        )
        cname = e.name.encode("utf-8", "surrogatepass")
        offset = len(out)
        pos = offset + 4
        for w in widths_local:
            fields.append((pos, w))
            pos += w
        # method, time, date, crc, compressed and uncompressed size: the same in both headers
        common = (e.method, 0, 0x21, crc, len(payload) % 2**32, size % 2**32)
        out += _LOCAL.pack(b"PK\x03\x04", 20, 0x800, *common, len(lname), 0)
        out += lname + payload
        pos = len(central) + 4
        for w in (2, 2, 2, 2, 2, 2, 4, 4, 4, 2, 2, 2, 2, 2, 4, 4):
            fields.append((-1 - pos, w))  # central-directory relative, fixed below
            pos += w
        central += _CENTRAL.pack(
            b"PK\x01\x02", 20, 20, 0x800, *common, len(cname), 0, 0, 0, 0, 0, offset % 2**32
        )
        central += cname
    cd_offset = len(out)
    fields = [(cd_offset - 1 - o if o < 0 else o, w) for o, w in fields]
    out += central
    eocd = len(out)
    out += _EOCD.pack(
        b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central), cd_offset, len(comment)
    )
    out += comment
    fields += [
        (eocd + 4 + i, w)
        for i, w in zip((0, 2, 4, 6, 8, 12, 16), (2, 2, 2, 2, 4, 4, 2), strict=True)
    ]
    return bytes(out), fields


def read_entries(data: bytes) -> list[ZipEntry]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [ZipEntry(i.filename, zf.read(i)) for i in zf.infolist()]


_BAD_NAMES = (
    "../../evil", "/etc/evil", "archive/../../evil", "archive//data.pkl", "archive\\data.pkl",
    "C:\\evil", "archive/data.pkl\0x", "", "archive/./data.pkl", "a" * 65535, "\ud800",
)  # fmt: skip


def _mutate_entries(rng: random.Random, entries: list[ZipEntry]) -> list[ZipEntry]:
    i = rng.randrange(len(entries))
    e = entries[i]
    roll = rng.random()
    if roll < 0.15:
        entries[i] = replace(e, name=rng.choice((*_BAD_NAMES, e.name.upper(), "x/data.pkl")))
    elif roll < 0.25:
        entries.insert(rng.randrange(len(entries) + 1), e)  # a duplicate name
    elif roll < 0.35:
        del entries[i]
    elif roll < 0.45:
        entries[i] = replace(e, local_name=rng.choice((*_BAD_NAMES, e.name + "x")))
    elif roll < 0.6:
        entries[i] = replace(e, declared_size=interesting(rng, len(e.data)))
    elif roll < 0.7:  # deflated, possibly a bomb: a few KB of zeros declaring gigabytes
        if rng.random() < 0.5:
            e = replace(e, data=b"\0" * rng.choice((1 << 16, 1 << 20)))
        entries[i] = replace(e, method=zipfile.ZIP_DEFLATED)
    elif roll < 0.8:
        n = len(e.data)
        entries[i] = replace(
            e,
            data=e.data[: rng.randrange(n + 1)] if n and rng.random() < 0.7 else e.data + b"\1" * 8,
        )
    elif roll < 0.88:
        entries[i] = replace(e, crc=rng.getrandbits(32))
    else:
        entries[i] = replace(e, method=rng.choice((1, 9, 12, 14, 99)))
    return entries


def mutate_zip(rng: random.Random, seed: bytes, seeds: Sequence[bytes]) -> bytes:
    """A mutant of a torch.save zip archive: its data.pkl, its entries, its header fields."""
    entries = read_entries(seed)
    roll = rng.random()
    if roll < 0.4:
        i = next(k for k, e in enumerate(entries) if e.name.endswith("/data.pkl"))
        entries[i] = replace(entries[i], data=mutate_pickle(rng, entries[i].data))
        return write_zip(entries)[0]
    if roll < 0.7:
        for _ in range(rng.choice((1, 1, 2, 3))):
            if entries:
                entries = _mutate_entries(rng, entries)
        return write_zip(entries, rng.choice((b"", b"", b"PK\x05\x06")))[0]
    data, fields = write_zip(entries)
    if roll < 0.85:
        off, width = rng.choice(fields)
        return set_field(rng, data, off, width)
    if roll < 0.92:
        return data[: rng.randrange(len(data))]
    return havoc(rng, data, seeds)


def legacy_parts(data: bytes) -> tuple[list[tuple[str, int, int]], list[int]]:
    """Opcode spans of a legacy checkpoint's five pickles and the offsets of its storage counts."""
    spans: list[tuple[str, int, int]] = []
    pos = 0
    for _ in range(5):
        ops = opcode_spans(data, pos)
        spans += ops
        pos = ops[-1][2]
    # each storage is an int64 element count then its bytes; the first count is the one to aim
    # at (later ones move with every size change)
    return spans, [pos] if pos + 8 <= len(data) else []


def mutate_legacy(rng: random.Random, seed: bytes, seeds: Sequence[bytes]) -> bytes:
    """A mutant of a legacy (non-zip) torch.save stream."""
    spans, counts = legacy_parts(seed)
    roll = rng.random()
    if roll < 0.6:
        return mutate_pickle_ops(rng, seed, spans)
    if roll < 0.7 and counts:
        off = rng.choice(counts)
        return set_field(rng, seed, off, 8)
    if roll < 0.8:
        return seed[: rng.randrange(len(seed))]
    return havoc(rng, seed, seeds)


def mutate_torch(rng: random.Random, seed: bytes, seeds: Sequence[bytes]) -> bytes:
    """A mutant of a pickle-target seed: zip archive, legacy stream or bare pickle."""
    if seed[:4] == b"PK\x03\x04":
        return mutate_zip(rng, seed, seeds)
    try:
        return mutate_legacy(rng, seed, seeds)
    except (ValueError, IndexError):  # a bare pickle, not five in a row
        return mutate_pickle(rng, seed) if rng.random() < 0.8 else havoc(rng, seed, seeds)
