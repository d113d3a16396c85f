"""Checkpoint loaders: every format registers an opener in ``LOADERS`` under its spec name.

``open_files(format, paths)`` opens a checkpoint as a lazy ``WeightSource``;
``detect_format(path)`` tells the format from a file's leading bytes (or a directory: ``hf``).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from inferflow.errors import CheckpointError, UnsafePickleError

# imported for their LOADERS registrations
from inferflow.loaders import gguf, hf, pickle_safe, safetensors  # noqa: F401
from inferflow.loaders.base import LOADERS, Weight, WeightSource
from inferflow.loaders.pickle_vm import load_one
from inferflow.loaders.quantized import wrap_if_quantized  # also registers "inferflow_quant"
from inferflow.loaders.torch_pickle import MAGIC_NUMBER, describe_allowed, resolve_global
from inferflow.loaders.zip_safe import ZIP_MAGIC, torch_archive

__all__ = ["LOADERS", "Weight", "WeightSource", "detect_format", "open_files"]

# A raw pickle stream: PROTO 2-5 (what pickle.dump writes), or protocol 0/1 opening with a global
# (GLOBAL, or MARK + INST: a class instance). Its opcodes need not fit in the bytes read here (a
# FRAME announces the whole stream): the pickle loader reads it all and names what it refuses.
_PICKLE_START = re.compile(rb"\x80[\x02-\x05]|\(?[ci][A-Za-z_][\w.]*\n[A-Za-z_][\w.]*\n")


def open_files(format: str, paths: Sequence[str | Path], keys: Sequence[str] = ()) -> WeightSource:
    """Open ``paths`` (one file, the shards of one checkpoint, or one hf directory) lazily;
    ``keys``: the top-level dict(s) of tensors of a pickle checkpoint to read."""
    opener = LOADERS.get(format)  # an unknown format names the known ones
    files = [Path(p) for p in paths]
    if not files:
        raise CheckpointError(f"no checkpoint files given for format {format!r}")
    for f in files:
        if not os.path.exists(f):  # False, not OSError, for a name too long etc.
            raise CheckpointError(f"checkpoint file not found: {f}")
    if keys:
        if format != "pickle":
            raise CheckpointError(
                f"source.keys picks dicts inside a pickle checkpoint; format {format!r} has none"
            )
        from inferflow.loaders.pickle_safe import PickleSource

        return PickleSource(files, keys)
    return wrap_if_quantized(opener(files))  # our quantized safetensors hand over transparently


def _is_legacy_torch(head: bytes, path: Path) -> bool:
    try:
        magic, _ = load_one(head, resolve=resolve_global, allowed=describe_allowed)
    except UnsafePickleError as e:
        # an unsafe pickle is worth reporting as such, not as an unknown format
        raise UnsafePickleError(f"{path}: {e}") from e
    except CheckpointError:
        return False
    return magic == MAGIC_NUMBER


def detect_format(path: str | Path) -> str:
    """The ``LOADERS`` name for a checkpoint file or model directory, from its content."""
    path = Path(path)
    if os.path.isdir(path):
        return "hf"
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(256)
    if head[:4] == gguf.GGUF_MAGIC:
        return "gguf"
    if head[:4] == ZIP_MAGIC:
        zf, _, pickles = torch_archive(path, path, size)  # refuses lying archives
        zf.close()
        if pickles:
            return "pickle"
        raise CheckpointError(f"{path}: zip archive without a '<prefix>/data.pkl' (not torch.save)")
    if head[:1] == b"\x80" and _is_legacy_torch(head, path):
        return "pickle"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            return "safetensors"  # before a raw pickle: a 640-byte header starts with 80 02
    if _PICKLE_START.match(head):
        return "pickle"
    raise CheckpointError(
        f"cannot tell the checkpoint format of {path} (starts with {head[:8]!r}); "
        f"supported: {', '.join(LOADERS.names())} (GGUF, torch.save zip or legacy, "
        "safetensors, or a model directory)"
    )
