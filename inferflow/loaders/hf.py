"""A Hugging Face model directory (``save_pretrained``) as a WeightSource.

The weights are found the way transformers looks for them: ``model.safetensors``, then the
sharded ``model.safetensors.index.json``, then ``pytorch_model.bin`` and its index. The parsed
``config.json`` rides along in ``metadata["config"]`` for hyperparameter resolution.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from inferflow.errors import CheckpointError
from inferflow.loaders.base import LOADERS, Weight, WeightSource
from inferflow.paths import read_json

log = logging.getLogger(__name__)

# (file name, format, sharded index?) in transformers' order of preference
CHECKPOINT_FILES: tuple[tuple[str, str, bool], ...] = (
    ("model.safetensors", "safetensors", False),
    ("model.safetensors.index.json", "safetensors", True),
    ("pytorch_model.bin", "pickle", False),
    ("pytorch_model.bin.index.json", "pickle", True),
)


def _read_json(path: Path) -> Any:
    try:
        return read_json(path)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a sharded checkpoint's index."""
    data = _read_json(index)
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
    for shard in set(wm.values()):
        # shards live next to the index; refuse names that would reach elsewhere
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index}: shard file name {shard!r} is not a plain file name")
    return wm


def find_checkpoint_files(directory: str | Path) -> tuple[str, list[Path]]:
    """(format, files) of the weights in a model directory, e.g. ("safetensors", [shards])."""
    fmt, files, _ = _locate(Path(directory))
    return fmt, files


def _locate(directory: Path) -> tuple[str, list[Path], Path | None]:
    """Format, weight files and, for a sharded checkpoint, its index."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"model directory not found: {directory}")
    for name, fmt, sharded in CHECKPOINT_FILES:
        path = directory / name
        if not os.path.isfile(path):
            continue
        if not sharded:
            return fmt, [path], None
        shards = list(dict.fromkeys(read_index(path).values()))  # unique, in first-use order
        files = [directory / s for s in shards]
        missing = [str(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointError(f"{path}: missing shard files: {', '.join(missing)}")
        return fmt, files, path
    raise CheckpointError(
        f"{directory}: no weights found; looked for {', '.join(n for n, _, _ in CHECKPOINT_FILES)}"
    )


class HFSource:
    """The weights of a model directory plus its ``config.json`` in ``metadata["config"]``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.format, self.files, index = _locate(self.directory)
        self._inner: WeightSource = LOADERS.get(self.format)(self.files)
        if index is not None:
            try:
                self._check_index(index)
            except BaseException:
                self._inner.close()
                raise
        self.metadata: dict[str, Any] = {**self._inner.metadata, "checkpoint_format": self.format}
        config = self.directory / "config.json"
        if config.is_file():
            self.metadata["config"] = _read_json(config)
        else:
            log.warning(
                "%s has no config.json: hyperparameters must come from the spec", self.directory
            )

    def _check_index(self, index: Path) -> None:
        # an index that disagrees with its shards means a partial download or a mixed directory
        listed, have = set(read_index(index)), set(self._inner.names())
        missing, extra = sorted(listed - have), sorted(have - listed)
        if missing or extra:
            raise CheckpointError(
                f"{index} and its shards disagree: listed but absent {missing[:5]}, "
                f"present but unlisted {extra[:5]}"
            )

    def names(self) -> list[str]:
        return self._inner.names()

    def get(self, name: str) -> Weight:
        return self._inner.get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._inner.shape(name)

    def release(self, name: str) -> None:
        """The inner source's ``release``, where it has one (safetensors, GGUF)."""
        release = getattr(self._inner, "release", None)
        if release is not None:
            release(name)

    def dtype_name(self, name: str) -> str:
        return self._inner.dtype_name(name)

    def __iter__(self) -> Iterator[tuple[str, Weight]]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner.names())

    def __contains__(self, name: object) -> bool:
        return name in set(self._inner.names())

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> HFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@LOADERS.register("hf")
def open_hf(paths: Sequence[Path]) -> WeightSource:
    if len(paths) != 1:
        raise CheckpointError(f"the hf format takes one model directory, got {len(paths)} paths")
    return HFSource(paths[0])
