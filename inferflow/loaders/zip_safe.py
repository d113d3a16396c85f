"""Checks on the zip archive of a ``torch.save`` checkpoint, made before any entry is read.

Nothing is ever extracted to disk: the pickle is read into memory and stored storages are
memory-mapped. An archive from a stranger can still lie, and each lie is refused with the entry
and the defect named:

- names that would leave a folder if extracted (absolute, ``..``, backslashes, NUL, empty parts),
  and the same name twice (which entry would a reader take?);
- compression other than stored (0) or deflated (8);
- sizes that cannot be true: a stored entry whose two sizes differ, a deflated entry declaring
  more than deflate can produce from its compressed bytes (at most 1032:1), an entry reaching past
  the end of the file, entries whose bytes overlap (the "overlapping files" zip bomb);
- a local header that is missing or names another entry than the central directory does.
"""

from __future__ import annotations

import lzma
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from inferflow.errors import CheckpointError

ZIP_MAGIC = b"PK\x03\x04"
LOCAL_HEADER_SIZE = 30
DEFLATE_MAX_RATIO = 1032  # zlib's limit: each 2-bit code can stand for at most 258 bytes
SUPPORTED_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
# what zipfile raises on a corrupt archive (unsupported versions and methods, encryption, bad
# deflate data, fields that do not fit), all reported as CheckpointError
ZIP_ERRORS = (
    zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError,
    RuntimeError, UnicodeDecodeError, zlib.error, OverflowError, lzma.LZMAError,
)  # fmt: skip
# signature, version, flags, method, time, date, crc, compressed, uncompressed, name len, extra len
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_UTF8_NAME = 0x800


# a problem: (what is wrong with the entry, details), reported as "<what> 'name' ...: <details>"
Problem = tuple[str, str]


def entry_name_problem(name: str) -> Problem | None:
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or "\0" in name or ".." in parts or "" in parts:
        return "unsafe entry name", "absolute, '..', backslash, NUL or an empty part"
    return None


def _size_problem(info: zipfile.ZipInfo, file_size: int) -> Problem | None:
    method = info.compress_type
    if method not in SUPPORTED_METHODS:
        known = ", ".join(f"{m} ({n})" for m, n in SUPPORTED_METHODS.items())
        return "unsupported compression of entry", f"method {method}; supported: {known}"
    if method == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        return "inconsistent sizes of entry", (
            f"stored, yet declares {info.file_size} bytes uncompressed and {info.compress_size} "
            "compressed"
        )
    if info.file_size > info.compress_size * DEFLATE_MAX_RATIO + 64:
        return "impossible size of entry", (
            f"declares {info.file_size} bytes uncompressed from {info.compress_size} compressed, "
            f"more than deflate's {DEFLATE_MAX_RATIO}:1 (a zip bomb?)"
        )
    if not 0 <= info.header_offset <= file_size - LOCAL_HEADER_SIZE - info.compress_size:
        return "out-of-file entry", (
            f"{info.compress_size} bytes at offset {info.header_offset} reach past the end of "
            f"the {file_size}-byte file (truncated or corrupt archive)"
        )
    return None


def check_entries(
    infos: Sequence[zipfile.ZipInfo], path: Path, file_size: int
) -> dict[str, zipfile.ZipInfo]:
    """The archive's entries by name, after every check that needs no entry data."""
    entries: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        problem = entry_name_problem(info.filename) or _size_problem(info, file_size)
        if problem is None and info.filename in entries:
            problem = "duplicate entry", "a name may appear once"
        if problem:
            what, details = problem
            raise CheckpointError(f"{path}: {what} {info.filename!r} in the zip archive: {details}")
        entries[info.filename] = info
    # an entry's local header and data come before the next entry's header: anything else
    # lets one stretch of (compressed) bytes count for several entries
    spans = sorted(entries.values(), key=lambda i: i.header_offset)
    for a, b in zip(spans, spans[1:], strict=False):
        if a.header_offset + LOCAL_HEADER_SIZE + a.compress_size > b.header_offset:
            raise CheckpointError(
                f"{path}: overlapping entries {a.filename!r} and {b.filename!r} in the zip "
                f"archive: offsets {a.header_offset} and {b.header_offset}, {a.compress_size} "
                "bytes of data (an overlapping-entries zip bomb or a corrupt archive)"
            )
    return entries


def torch_archive(
    file: Path | BinaryIO, path: Path, file_size: int
) -> tuple[zipfile.ZipFile, dict[str, zipfile.ZipInfo], list[str]]:
    """The zip archive ``file`` (``path`` names it in errors) opened and checked: the open
    ``ZipFile``, its entries by name (``check_entries``) and the names of its
    ``<prefix>/data.pkl`` entries (``torch.save`` writes exactly one)."""
    try:
        zf = zipfile.ZipFile(file)
    except ZIP_ERRORS as e:
        raise CheckpointError(f"{path}: malformed zip archive: {e}") from e
    try:
        entries = check_entries(zf.infolist(), path, file_size)
    except BaseException:
        zf.close()
        raise
    pickles = [n for n in entries if n.count("/") == 1 and n.endswith("/data.pkl")]
    return zf, entries, pickles


def data_offset(buf: Any, info: zipfile.ZipInfo, path: Path, file_size: int) -> int:
    """Where the data of ``info`` starts, from its local header (checked against the central
    directory: the local header may carry another extra field, but must name the same entry)."""
    pos = info.header_offset
    head = bytes(buf[pos : pos + LOCAL_HEADER_SIZE]) if buf is not None else b""
    if len(head) < LOCAL_HEADER_SIZE:
        raise CheckpointError(f"{path}: truncated zip: local header of {info.filename!r}")
    sig, _, flags, *_, name_len, extra_len = _LOCAL.unpack(head)
    if sig != ZIP_MAGIC:
        raise CheckpointError(f"{path}: bad local header for zip entry {info.filename!r}")
    raw = bytes(buf[pos + LOCAL_HEADER_SIZE : pos + LOCAL_HEADER_SIZE + name_len])
    name = raw.decode("utf-8" if flags & _UTF8_NAME else "cp437", "replace")
    if name != info.orig_filename:
        raise CheckpointError(
            f"{path}: zip entry {info.orig_filename!r} has a local header naming {name!r}"
        )
    start = pos + LOCAL_HEADER_SIZE + name_len + extra_len
    if start + info.compress_size > file_size:
        raise CheckpointError(
            f"{path}: zip entry {info.filename!r} of {info.compress_size} bytes at offset "
            f"{start} lies past the end of the {file_size}-byte file (truncated?)"
        )
    return start
