"""Fuzz targets: seeds, a mutator, and the full load path each input goes through.

``run(path)`` is what a user's file would meet: format detection, opening, every ``(name,
tensor)`` with its data read (small tensors in full, dequantized if quantized; large broadcast
views at their first and last element), and the spec-level reading of hyperparameters. It must
return or raise an ``InferflowError`` with a message; the harness judges everything else.
"""

from __future__ import annotations

import ctypes
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from inferflow.errors import CheckpointError
from inferflow.fuzz import mut_binary, mut_pickle, mut_spec, seeds
from inferflow.quant.tensor import QuantTensor

TOUCH_LIMIT = 1 << 16  # elements read in full; beyond this only the ends of the view are read


@dataclass(frozen=True)
class Target:
    name: str
    suffix: str  # file name suffix of the input (the loaders take paths)
    seeds: Callable[[], seeds.Seeds]
    mutate: Callable[[random.Random, bytes, Sequence[bytes]], bytes]
    run: Callable[[Path], None]


def touch(w: torch.Tensor | QuantTensor) -> None:
    """Read a tensor's bytes, as binding it to a model would."""
    if isinstance(w, QuantTensor):
        if w.numel() <= TOUCH_LIMIT:
            w.dequantize(torch.float32)
        return
    if w.numel() <= TOUCH_LIMIT:
        # a fresh tensor: size-1 dims may carry any stride, conj / neg views stay lazy
        torch.empty(w.shape, dtype=w.dtype).copy_(w).reshape(-1).view(torch.uint8).sum()
    elif w.numel():
        w[(0,) * w.dim()].item()
        w[tuple(d - 1 for d in w.shape)].item()


def _iterate(fmt: str, path: Path) -> None:
    from inferflow.loaders import open_files

    src = open_files(fmt, [path])
    try:
        for name in src.names():
            src.shape(name), src.dtype_name(name)
        for _name, w in src:
            touch(w)
    finally:
        src.close()


def _detect(path: Path) -> None:
    from inferflow.errors import InferflowError
    from inferflow.loaders import detect_format

    try:
        detect_format(path)
    except InferflowError:
        pass  # a verdict the loader itself may also give; the load below still runs


GGUF_SPEC = {
    "name": "fuzz",
    "source": {"format": "gguf", "files": []},
    "network": {
        "type": "decoder_only", "norm": "rms", "activation": "silu", "ffn": "gated",
        "residual": "pre_norm", "position": {"type": "rope"}, "tensors": {"preset": "gguf"},
    },
}  # fmt: skip


def run_gguf(path: Path) -> None:
    from inferflow.spec import parse_spec

    _detect(path)
    _iterate("gguf", path)
    # what a spec pointing at the file reads: metadata -> hyperparameters -> HParams
    doc = {**GGUF_SPEC, "source": {"format": "gguf", "files": [str(path)]}}
    parse_spec(doc, path.parent)


def run_safetensors(path: Path) -> None:
    _detect(path)
    _iterate("safetensors", path)


def run_pickle(path: Path) -> None:
    from inferflow.errors import InferflowError
    from inferflow.loaders.pickle_vm import load_one, loads_plain
    from inferflow.loaders.torch_pickle import (
        describe_allowed,
        make_persistent_load,
        resolve_global,
    )
    from inferflow.loaders.zip_safe import ZIP_MAGIC
    from inferflow.tokenizer.pickle_vocab import read_pickle_vocab

    _detect(path)
    data = path.read_bytes()
    if data[:4] != ZIP_MAGIC:
        # a bare pickle: the interpreter with torch's allow-list, plain-data mode, vocab reader
        for step in (
            lambda: load_one(
                data,
                resolve=resolve_global,
                allowed=describe_allowed,
                persistent_load=make_persistent_load({}),
            ),
            lambda: loads_plain(data),
            lambda: read_pickle_vocab(path),
        ):
            try:
                step()
            except InferflowError:
                pass
    _iterate("pickle", path)


def run_spec(path: Path) -> None:
    from inferflow.spec import load_spec

    load_spec(path)


# ---- a target that misbehaves on purpose: proof that the harness notices -------------------

SELFTEST_KINDS = b"oetxhmwsp"


def run_selftest(path: Path) -> None:
    kind = path.read_bytes()[:1]
    if kind == b"e":
        raise CheckpointError("a proper error")
    if kind == b"t":
        raise TypeError("an improper error")
    if kind == b"x":
        raise CheckpointError("")
    if kind == b"h":
        time.sleep(3600)
    if kind == b"m":
        bytearray(1 << 36)  # 64 GiB
    if kind == b"w":
        (path.parent / "written-by-target").write_bytes(b"x")
    if kind == b"s":
        ctypes.string_at(0)  # segfault
    if kind == b"p":
        os.system("touch pwned")  # a command run from a loader (the guard stops it first)


def _selftest_mutate(rng: random.Random, seed: bytes, seeds_: Sequence[bytes]) -> bytes:
    return bytes([rng.choice(SELFTEST_KINDS)])


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("pickle", ".pt", seeds.pickle_seeds, mut_pickle.mutate_torch, run_pickle),
        Target("gguf", ".gguf", seeds.gguf_seeds, mut_binary.mutate_gguf, run_gguf),
        Target(
            "safetensors",
            ".safetensors",
            seeds.safetensors_seeds,
            mut_binary.mutate_safetensors,
            run_safetensors,
        ),
        Target("spec", ".yaml", seeds.spec_seeds, mut_spec.mutate_spec, run_spec),
        Target(
            "selftest",
            ".bin",
            lambda: [(chr(k), bytes([k])) for k in SELFTEST_KINDS],
            _selftest_mutate,
            run_selftest,
        ),
    )
}
PUBLIC_TARGETS = ("pickle", "gguf", "safetensors", "spec")
