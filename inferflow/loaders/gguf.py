"""GGUF files as weight sources: one file (``GGUFSource``: tensors built lazily from the mmap, as
torch tensors or ``QuantTensor``) or a split model's shards (``ShardedGGUFSource``). The parser
is ``loaders/gguf_parse.py``; its public names are re-exported here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from inferflow.errors import CheckpointError
from inferflow.loaders.base import LOADERS, Weight, WeightSource, release_pages
from inferflow.loaders.gguf_parse import (
    _PLAIN_TYPES,
    GgufMetadata,
    GGUFTensorInfo,
    _file_key,
    _file_layout,
    _map,
    _parse,
)
from inferflow.loaders.gguf_parse import DEFAULT_ALIGNMENT as DEFAULT_ALIGNMENT
from inferflow.loaders.gguf_parse import GGUF_MAGIC as GGUF_MAGIC
from inferflow.loaders.gguf_parse import GGUFValueType as GGUFValueType
from inferflow.loaders.gguf_parse import forget_metadata as forget_metadata
from inferflow.loaders.gguf_parse import read_gguf_metadata as read_gguf_metadata
from inferflow.quant.formats import get_format
from inferflow.quant.tensor import QuantTensor

logger = logging.getLogger(__name__)


class GGUFSource:
    """One GGUF file as a WeightSource.

    Tensors are views of the file's mmap (zero-copy, read-only memory: never write to them):
    plain types come back as torch tensors in their own dtype, quantized ones as ``QuantTensor``.
    A tensor handed out keeps the mapping alive after ``close()``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mm: np.ndarray | None = _map(self.path)
        header = _parse(self._mm, self.path, known=_file_layout(*_file_key(self.path)))
        self.version = header.version
        self.metadata = GgufMetadata(self.path, header.metadata, list(header.metadata_types))
        # key -> GGUF type path, e.g. (UINT32,) or (ARRAY, STRING): what a writer needs
        self.metadata_types: dict[str, tuple[int, ...]] = header.metadata_types
        self.tensor_infos: dict[str, GGUFTensorInfo] = header.tensors
        self.alignment = header.alignment
        self.data_offset = header.data_offset
        n_keys, n_tensors = len(self.metadata), len(self.tensor_infos)
        logger.debug("%s: GGUF v%d, %d keys, %d tensors", path, self.version, n_keys, n_tensors)

    def names(self) -> list[str]:
        return list(self.tensor_infos)

    def info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensor_infos[name]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: no tensor named {name!r} (the file has {len(self.tensor_infos)})"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype_name(self, name: str) -> str:
        return self.info(name).type_name

    def get(self, name: str, dtype: torch.dtype | None = None) -> Weight:
        """The tensor as stored; with ``dtype``, a dense copy in that dtype (dequantized)."""
        info = self.info(name)
        if self._mm is None:
            raise CheckpointError(f"{self.path}: GGUF source is closed")
        raw = self._mm[info.offset : info.offset + info.nbytes]
        plain = _PLAIN_TYPES.get(info.ggml_type)
        with warnings.catch_warnings():
            # the mapping is read-only on purpose; torch warns about any non-writable array
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            if plain is not None:
                t = torch.from_numpy(raw.view(plain[1]).reshape(info.shape))
                if plain[2] is torch.bfloat16:
                    t = t.view(torch.bfloat16)
                return t if dtype is None else t.to(dtype)
            fmt = get_format(info.type_name)
            # never 0-d: _tensor_infos refuses one (a single weight, less than a block)
            per_row = info.shape[-1] // fmt.block_size * fmt.bytes_per_block
            data = torch.from_numpy(raw.reshape(-1, per_row) if per_row else raw)
        mm = self._mm

        def release(start: int, stop: int) -> None:
            release_pages(mm, info.offset + start, stop - start)

        qt = QuantTensor(data, info.type_name, info.shape, release)
        return qt if dtype is None else qt.dequantize(dtype)

    def __iter__(self) -> Iterator[tuple[str, Weight]]:
        for name in self.names():
            yield name, self.get(name)

    def release(self, name: str) -> None:
        """Drop ``name``'s pages from this process's resident memory once it has been read
        into its final form (``release_pages``). A load then never holds the whole file
        resident beside the model."""
        info = self.info(name)
        release_pages(self._mm, info.offset, info.nbytes)

    def close(self) -> None:
        # np.memmap has no close(): dropping our reference unmaps once no tensor views remain
        self._mm = None

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFSource({str(self.path)!r}, {len(self.tensor_infos)} tensors)"


class ShardedGGUFSource:
    """A model split by llama.cpp's gguf-split: metadata from shard 0, tensors from all."""

    def __init__(self, shards: list[GGUFSource]) -> None:
        nos = sorted(_split_int(s, "split.no", -1) for s in shards)
        counts = {_split_int(s, "split.count", 1) for s in shards}
        if counts != {len(shards)} or nos != list(range(len(shards))):
            raise CheckpointError(
                f"{len(shards)} GGUF files given, but they are not the shards of one split model "
                f"(split.count values {sorted(counts)}, split.no values {nos}); pass one file"
            )
        self.shards = sorted(shards, key=lambda s: _split_int(s, "split.no", -1))
        self.metadata = self.shards[0].metadata
        self.metadata_types = self.shards[0].metadata_types
        self._owner: dict[str, GGUFSource] = {}
        for shard in self.shards:
            for name in shard.names():
                if name in self._owner:
                    raise CheckpointError(
                        f"tensor {name!r} is in {self._owner[name].path} and {shard.path}"
                    )
                self._owner[name] = shard
        want = self.metadata.get("split.tensors.count", len(self._owner))
        if want != len(self._owner):
            raise CheckpointError(
                f"{self.shards[0].path}: split.tensors.count is {want!r}, but the "
                f"{len(shards)} shards hold {len(self._owner)} tensors"
            )

    def _shard(self, name: str) -> GGUFSource:
        if name not in self._owner:
            raise CheckpointError(f"no tensor named {name!r} in the {len(self.shards)} shards")
        return self._owner[name]

    def names(self) -> list[str]:
        return list(self._owner)

    def get(self, name: str, dtype: torch.dtype | None = None) -> Weight:
        return self._shard(name).get(name, dtype)

    def release(self, name: str) -> None:
        self._shard(name).release(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shard(name).shape(name)

    def dtype_name(self, name: str) -> str:
        return self._shard(name).dtype_name(name)

    def __iter__(self) -> Iterator[tuple[str, Weight]]:
        for name in self.names():
            yield name, self.get(name)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def _split_int(src: GGUFSource, key: str, default: int) -> int:
    value = src.metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{src.path}: {key} must be an integer, got {value!r}")
    return value


def open_gguf(paths: Sequence[str | Path]) -> WeightSource:
    """Open one GGUF file, or a gguf-split model from all its shards or from the first one."""
    if not paths:
        raise CheckpointError("no GGUF file given")
    sources = [GGUFSource(p) for p in paths]
    count = _split_int(sources[0], "split.count", 1)
    if len(sources) == 1 and count > 1:
        # llama.cpp convention: the first shard names the others, <prefix>-0000i-of-0000n.gguf
        suffix = f"-00001-of-{count:05d}.gguf"
        first = sources[0].path
        if not first.name.endswith(suffix):
            raise CheckpointError(f"{first} is one of {count} shards; pass all of them")
        stem = first.name[: -len(suffix)]
        rest = [first.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]
        missing = [str(p) for p in rest if not p.exists()]
        if missing:
            raise CheckpointError(f"{first}: missing shard files: {', '.join(missing)}")
        sources += [GGUFSource(p) for p in rest]
    return sources[0] if len(sources) == 1 else ShardedGGUFSource(sources)


LOADERS.add("gguf", open_gguf)
