"""Malformed zip checkpoints (tests/malicious/zip_corpus.py): each is refused with a
CheckpointError naming the defect, nothing is extracted or written anywhere, and no declared size
is ever allocated."""

from __future__ import annotations

import functools
import os
import re
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from malicious import zip_corpus

from inferflow.errors import CheckpointError
from inferflow.fuzz.mut_pickle import write_zip
from inferflow.loaders import detect_format, open_files

ALLOCATION_BOUND = 16 << 20  # bytes of Python allocations a refusal may take (the bomb: 64 MiB)


@functools.cache
def cases() -> dict[str, tuple[bytes, str, bool]]:
    return {name: (data, message, seen) for name, data, message, seen in zip_corpus.cases()}


def load_all(path: Path) -> None:
    """The full load path: open, then every tensor's data."""
    src = open_files("pickle", [path])
    try:
        for _name, t in src:
            t.sum()
    finally:
        src.close()


def listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def test_the_corpus_writer_makes_loadable_archives(tmp_path: Path) -> None:
    # without a defect the same writer's archive loads: each refusal below is the defect's
    path = tmp_path / "ok.pt"
    path.write_bytes(write_zip(zip_corpus.valid_entries())[0])
    assert detect_format(path) == "pickle"
    src = open_files("pickle", [path])
    assert torch.equal(src.get("w"), torch.arange(12.0).reshape(3, 4))
    assert torch.equal(src.get("b"), torch.ones(3))
    src.close()


def test_corpus_covers_the_issue_list() -> None:
    names = " ".join(cases())
    for kind in ("traversal", "duplicate", "4 GiB", "bomb", "overlapping", "local name", "compression"):  # fmt: skip
        assert kind in names
    assert len(cases()) >= 20


@pytest.mark.parametrize("name", list(cases()))
def test_malformed_zip_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:  # fmt: skip
    data, message, seen_by_detect = cases()[name]
    work, tmp = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(work)  # an extraction would land here or in the temp dir
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    path = tmp_path / "evil.pt"
    path.write_bytes(data)
    before = listing(tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=re.escape(message)) as err:
            load_all(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(err.value)
    assert peak < ALLOCATION_BOUND, f"{name}: {peak} bytes allocated"
    if seen_by_detect:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            detect_format(path)
    assert listing(tmp_path) == before
    assert not os.listdir(work) and not os.listdir(tmp)


def test_every_truncation_of_an_archive_is_refused(tmp_path: Path) -> None:
    for i, prefix in enumerate(zip_corpus.truncations()):
        path = tmp_path / f"cut{i}.pt"
        path.write_bytes(prefix)
        with pytest.raises(CheckpointError):
            load_all(path)
        with pytest.raises(CheckpointError):
            detect_format(path)
