"""PyTorch checkpoints (``torch.save``) loaded without ``pickle.load`` or ``torch.load``.

Two containers: the zip archive ``torch.save`` writes by default (``<prefix>/data.pkl``,
``<prefix>/byteorder``, one uncompressed ``<prefix>/data/<key>`` entry per storage) and the legacy
stream of ``_use_new_zipfile_serialization=False`` (magic-number pickle, protocol pickle, sys-info
pickle, the state-dict pickle, the storage-key list pickle, then each storage as an 8-byte element
count and its raw little-endian bytes, in key order). Pickles go through our own interpreter
(``pickle_vm``) with the allow-list of ``torch_pickle``; tensor data is memory-mapped and read
only when ``get`` asks for it.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from inferflow.errors import CheckpointError
from inferflow.loaders.base import LOADERS, WeightSource
from inferflow.loaders.pickle_vm import load_one
from inferflow.loaders.safetensors import dtype_name
from inferflow.loaders.torch_pickle import (
    LEGACY_PROTOCOL_VERSION,
    MAGIC_NUMBER,
    StorageRef,
    TensorRecord,
    describe_allowed,
    make_persistent_load,
    materialize,
    resolve_global,
    short_repr,
)
from inferflow.loaders.zip_safe import ZIP_ERRORS, ZIP_MAGIC, data_offset, torch_archive

log = logging.getLogger(__name__)

MAX_PICKLE_BYTES = 1 << 29  # data.pkl of a state dict is kilobytes; refuse to inflate a bomb


def _load(buf: Any, pos: int, storages: dict[str, StorageRef] | None = None) -> tuple[Any, int]:
    pl = make_persistent_load(storages) if storages is not None else None
    return load_one(buf, pos, resolve=resolve_global, allowed=describe_allowed, persistent_load=pl)


def _map(path: Path) -> tuple[BinaryIO, mmap.mmap | None, int]:
    try:
        f = open(path, "rb")  # noqa: SIM115 -- owned by the checkpoint until close()
    except OSError as e:
        raise CheckpointError(f"cannot open checkpoint {path}: {e.strerror}") from e
    try:
        size = os.fstat(f.fileno()).st_size
        # copy-on-write: tensors are writable views (no torch warning) that never touch the file
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    except (OSError, ValueError) as e:
        f.close()
        raise CheckpointError(f"cannot map checkpoint {path}: {e}") from e
    return f, mm, size


class _Checkpoint:
    """One checkpoint file: its tensor records and a way to read a storage's bytes."""

    container = ""
    byteswap = False

    def __init__(self, path: Path, keys: Sequence[str] = ()) -> None:
        self.path, self.keys = path, tuple(keys)
        self.file, self.mm, self.size = _map(path)
        self.tensors: dict[str, TensorRecord] = {}
        self.state_dict_key: str | None = None
        self._refcount: dict[str, int] = {}  # storage key -> tensors over it
        self._shared: dict[str, torch.Tensor] = {}

    def _root(self, key: str) -> torch.Tensor:
        """The bytes (uint8) of the whole stored storage ``key``."""
        raise NotImplementedError

    def storage_bytes(self, ref: StorageRef) -> torch.Tensor:
        root = self._shared.get(ref.key)
        if root is None:
            root = self._root(ref.key)
            if root.numel() and root.data_ptr() % 16:
                # unaligned data (legacy files, re-zipped archives) needs an aligned copy
                root = root.clone()
                if self._refcount.get(ref.key, 0) > 1:
                    # keep it so that views and tied weights still share one copy
                    self._shared[ref.key] = root
        return root[ref.byte_offset : ref.byte_offset + ref.nbytes]

    def _view(self, offset: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0 or self.mm is None:
            return torch.empty(0, dtype=torch.uint8)
        if offset < 0 or offset + nbytes > self.size:
            raise CheckpointError(
                f"{self.path}: {nbytes} bytes at offset {offset} lie past the end"
            )
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def close(self) -> None:
        # never mmap.close(): tensors from torch.frombuffer hold no buffer export, so closing
        # would leave them dangling; they hold a reference instead, which keeps the map alive
        self.mm = None
        self._shared.clear()
        self.file.close()

    def _set_state_dict(self, obj: Any) -> None:
        self.root = obj  # the whole top-level object (tensors as records): its other entries
        tensors, self.state_dict_key = find_state_dict(obj, self.path, self.keys)
        for name, rec in tensors.items():
            rec.check(name)
            self._refcount[rec.storage.key] = self._refcount.get(rec.storage.key, 0) + 1
        self.tensors = tensors


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(v, TensorRecord) for v in obj.values())


def find_state_dict(
    obj: Any, path: Path, keys: Sequence[str] = ()
) -> tuple[dict[str, TensorRecord], str | None]:
    """The dict of tensors in a checkpoint: the top level, or the one dict of tensors in it;
    ``keys`` (the spec's ``source.keys``) name the top-level dict(s) of tensors to read, each
    tensor named ``key.name`` when there are several (an ``encoder`` and a ``decoder`` dict)."""
    if keys:
        return _chosen(obj, path, keys), ",".join(keys)
    key: str | None = None
    if isinstance(obj, dict) and not _is_tensor_dict(obj):
        nested = [k for k, v in obj.items() if v and _is_tensor_dict(v) and isinstance(k, str)]
        if len(nested) != 1:
            keys = ", ".join(short_repr(k) for k in list(obj)[:20])
            raise CheckpointError(
                f"{path}: expected a state dict (a dict of tensors) or a dict holding exactly one, "
                f"found {len(nested)} dicts of tensors; top-level keys: {keys} (choose with the "
                "spec's source.keys)"
            )
        key = nested[0]
        obj = obj[key]
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{path}: expected a state dict, the pickle holds a {type(obj).__name__}"
        )
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise CheckpointError(
            f"{path}: state dict keys must be strings, found {short_repr(bad[0])}"
        )
    return dict(obj), key


def _chosen(obj: Any, path: Path, keys: Sequence[str]) -> dict[str, TensorRecord]:
    tops = (
        [k for k, v in obj.items() if isinstance(k, str) and _is_tensor_dict(v)]
        if isinstance(obj, dict)
        else []
    )
    bad = [k for k in keys if k not in tops]
    if bad:
        raise CheckpointError(
            f"{path}: source.keys: {', '.join(map(repr, bad))} is not a top-level dict of "
            f"tensors; the checkpoint has: {', '.join(map(repr, tops)) or 'none'}"
        )
    if len(keys) == 1:
        return dict(obj[keys[0]])
    return {f"{k}.{name}": rec for k in keys for name, rec in obj[k].items()}


class _ZipCheckpoint(_Checkpoint):
    container = "zip"

    def __init__(self, path: Path, keys: Sequence[str] = ()) -> None:
        super().__init__(path, keys)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        self.zf, self.entries, pickles = torch_archive(self.file, self.path, self.size)
        if len(pickles) != 1:
            listed = ", ".join(list(self.entries)[:8])
            raise CheckpointError(
                f"{self.path}: a torch.save archive has exactly one '<prefix>/data.pkl' entry, "
                f"found {len(pickles)} (entries: {listed})"
            )
        self.prefix = pickles[0][: -len("data.pkl")]
        order = (
            self._read_small(self.prefix + "byteorder", 16)
            if self.prefix + "byteorder" in self.entries
            else b"little"
        )
        if order not in (b"little", b"big"):
            raise CheckpointError(
                f"{self.path}: byteorder entry is {order[:16]!r}, expected little or big"
            )
        self.byteswap = order.decode() != "little"
        storages: dict[str, StorageRef] = {}
        self.offsets: dict[str, int] = {}  # storage key -> data offset of a stored entry
        data = self._read_small(pickles[0], MAX_PICKLE_BYTES)
        obj, end = _load(data, 0, storages)
        if end != len(data):
            log.debug("%s: %d bytes after the pickle's STOP ignored", self.path, len(data) - end)
        for ref in storages.values():
            entry = self.entries.get(f"{self.prefix}data/{ref.key}")
            if entry is None:
                raise CheckpointError(
                    f"{self.path}: storage {ref.key!r} has no data/{ref.key} entry"
                )
            if entry.file_size < ref.nbytes:
                raise CheckpointError(
                    f"{self.path}: storage {ref.key!r} needs {ref.nbytes} bytes, its entry holds "
                    f"{entry.file_size}"
                )
            if entry.compress_type == zipfile.ZIP_STORED:
                # the local header is read now, so that a lying one fails the open, not a get
                self.offsets[ref.key] = data_offset(self.mm, entry, self.path, self.size)
            elif entry.file_size != ref.nbytes:
                # a compressed entry is inflated into memory: never more than the storage needs
                raise CheckpointError(
                    f"{self.path}: compressed storage {ref.key!r} inflates to {entry.file_size} "
                    f"bytes, the pickle declares {ref.nbytes}"
                )
        self._set_state_dict(obj)

    def _read_small(self, name: str, limit: int) -> bytes:
        info = self.entries[name]
        if info.file_size > limit:
            raise CheckpointError(
                f"{self.path}: entry {name!r} of {info.file_size} bytes exceeds {limit}"
            )
        return self._read(info)

    def _read(self, info: zipfile.ZipInfo) -> bytes:
        try:
            return self.zf.read(info)  # checks the CRC, so a corrupt pickle is caught here
        except ZIP_ERRORS as e:
            raise CheckpointError(
                f"{self.path}: cannot read zip entry {info.filename!r}: {e}"
            ) from e

    def _root(self, key: str) -> torch.Tensor:
        info = self.entries[f"{self.prefix}data/{key}"]
        if info.compress_type == zipfile.ZIP_STORED:
            return self._view(self.offsets[key], info.file_size)
        # torch never compresses storages, but a re-zipped archive may: inflate this one entry
        # no size bound needed: _open refused an entry that inflates to more than its storage
        raw = bytearray(self._read(info))
        return (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )


class _LegacyCheckpoint(_Checkpoint):
    container = "legacy"

    def __init__(self, path: Path, keys: Sequence[str] = ()) -> None:
        super().__init__(path, keys)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        if self.mm is None:
            raise CheckpointError(f"{self.path}: empty file")
        magic, pos = _load(self.mm, 0)
        if magic != MAGIC_NUMBER:
            raise CheckpointError(f"{self.path}: not a torch checkpoint (wrong magic number)")
        version, pos = _load(self.mm, pos)
        if version != LEGACY_PROTOCOL_VERSION:
            raise CheckpointError(
                f"{self.path}: legacy protocol version {short_repr(version)}, expected {LEGACY_PROTOCOL_VERSION}"
            )
        sys_info, pos = _load(self.mm, pos)
        log.debug("%s: legacy checkpoint written on %s", self.path, sys_info)
        storages: dict[str, StorageRef] = {}
        obj, pos = _load(self.mm, pos, storages)
        keys, pos = _load(self.mm, pos)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise CheckpointError(f"{self.path}: storage key list is malformed")
        # storages follow in key order, each an int64 element count then the bytes; the data is
        # always little-endian (torch's writeFileRaw converts on big-endian hosts)
        self.offsets: dict[str, int] = {}
        for key in keys:
            ref = storages.get(key)
            if ref is None or key in self.offsets:
                raise CheckpointError(f"{self.path}: storage key {key!r} unreferenced or repeated")
            if pos + 8 > self.size:
                raise CheckpointError(f"{self.path}: truncated before storage {key!r}")
            (numel,) = struct.unpack_from("<q", self.mm, pos)
            if numel * ref.dtype.itemsize != ref.nbytes:
                raise CheckpointError(
                    f"{self.path}: storage {key!r} header says {numel} elements, the pickle "
                    f"{ref.nbytes // ref.dtype.itemsize}"
                )
            self.offsets[key] = pos + 8
            pos += 8 + ref.nbytes
            if pos > self.size:
                raise CheckpointError(
                    f"{self.path}: truncated: storage {key!r} ends at byte {pos}, the file has {self.size}"
                )
        self.storages = storages
        missing = [k for k in storages if k not in self.offsets]
        if missing:
            raise CheckpointError(f"{self.path}: no data for storages {missing[:5]}")
        self._set_state_dict(obj)

    def _root(self, key: str) -> torch.Tensor:
        return self._view(self.offsets[key], self.storages[key].nbytes)


def open_checkpoint(path: str | Path, keys: Sequence[str] = ()) -> _Checkpoint:
    path = Path(path)
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory; a model directory is format 'hf'")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    try:
        return (_ZipCheckpoint if head == ZIP_MAGIC else _LegacyCheckpoint)(path, keys)
    except CheckpointError as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from e  # the interpreter's errors do not know the file


def read_config_dict(path: str | Path, key: str) -> dict[str, Any]:
    """The plain values (numbers, strings, booleans, lists) of the dict at dotted top-level
    ``key`` of a pickle checkpoint: hyperparameters a training script saved beside the
    weights (nanoGPT's ``model_args``)."""
    ck = open_checkpoint(path)
    try:
        obj: Any = getattr(ck, "root", None)
        for part in key.split("."):
            if not isinstance(obj, dict) or part not in obj:
                have = (
                    ", ".join(short_repr(k) for k in list(obj)[:20])
                    if isinstance(obj, dict)
                    else type(obj).__name__
                )
                raise CheckpointError(f"{path}: source.config key {key!r}: no {part!r} in {have}")
            obj = obj[part]
        if not isinstance(obj, dict):
            raise CheckpointError(
                f"{path}: source.config key {key!r} holds a {type(obj).__name__}, not a dict"
            )
        plain = (bool, int, float, str, list, tuple, type(None))
        return {str(k): v for k, v in obj.items() if isinstance(v, plain)}
    finally:
        ck.close()


class PickleSource:
    """``torch.save`` checkpoints (one, or several shards) as a WeightSource."""

    def __init__(self, paths: Sequence[str | Path], keys: Sequence[str] = ()) -> None:
        if not paths:
            raise CheckpointError("no PyTorch checkpoint file given")
        self._files: list[_Checkpoint] = []
        self._owner: dict[str, _Checkpoint] = {}
        try:
            for p in paths:
                ck = open_checkpoint(p, keys)
                self._files.append(ck)
                for name in ck.tensors:
                    if name in self._owner:
                        raise CheckpointError(
                            f"tensor {name!r} appears in both {self._owner[name].path} and {ck.path}"
                        )
                    self._owner[name] = ck
        except BaseException:
            self.close()
            raise
        self.metadata: dict[str, Any] = {
            "container": self._files[0].container,
            "files": [str(f.path) for f in self._files],
        }
        key = self._files[0].state_dict_key
        if key is not None:  # e.g. 'state_dict' or 'model' of a training checkpoint
            self.metadata["state_dict_key"] = key
        log.debug(
            "opened %d tensors from %d pickle checkpoint(s)", len(self._owner), len(self._files)
        )

    def _record(self, name: str) -> tuple[_Checkpoint, TensorRecord]:
        try:
            ck = self._owner[name]
        except KeyError:
            raise CheckpointError(
                f"no tensor named {name!r} in the checkpoint ({len(self._owner)} tensors)"
            ) from None
        return ck, ck.tensors[name]

    def names(self) -> list[str]:
        return list(self._owner)

    def get(self, name: str) -> torch.Tensor:
        ck, rec = self._record(name)
        if ck.mm is None and ck.size:
            raise CheckpointError(f"{ck.path}: checkpoint is closed")
        return materialize(rec, ck.storage_bytes(rec.storage), ck.byteswap)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._record(name)[1].shape

    def dtype_name(self, name: str) -> str:
        return dtype_name(self._record(name)[1].dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.get(name)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> PickleSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@LOADERS.register("pickle")
def open_pickle(paths: Sequence[Path]) -> WeightSource:
    return PickleSource(paths)
