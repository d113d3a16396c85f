"""The fuzz harness (``inferflow.fuzz``, ``tools/fuzz.py``): every target runs clean on a few
hundred inputs, the harness reports each kind of bug it exists to catch, and every input that
once broke a loader (tests/fuzz_regressions/) now ends in a clean error."""

from __future__ import annotations

import importlib.util
import io
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from inferflow.errors import InferflowError
from inferflow.fuzz import PUBLIC_TARGETS, TARGETS, Campaign, TargetReport
from inferflow.fuzz.harness import input_rng, make_input
from inferflow.fuzz.mut_spec import mutate_tree
from inferflow.fuzz.seeds import _state_dicts, legacy_save
from inferflow.fuzz.targets import SELFTEST_KINDS

ROOT = Path(__file__).resolve().parent.parent
REGRESSIONS = Path(__file__).parent / "fuzz_regressions"

# input -> what its error must say (None: it loads). Each was a crash before its fix.
EXPECTED: dict[str, str | None] = {
    # TypeError: unhashable dtype (a JSON list) looked up in the dtype table
    "safetensors/dtype-is-a-list.safetensors": r"unknown dtype \[\]; known: BOOL",
    # OverflowError: the byte count of a huge shape formatted as a float
    "safetensors/size-too-large-for-a-float.safetensors": "more bytes than 64 bits can count",
    # ValueError: a byte count with more than 4300 digits turned into text
    "safetensors/size-too-long-to-print.safetensors": "more bytes than 64 bits can count",
    # LZMAError: an LZMA-compressed entry got as far as zipfile's decompressor
    "pickle/lzma-compressed-entry.pt": r"unsupported compression of entry .*method 14",
    # RuntimeError in Q8_0 dequantize: a 0-d quantized tensor (one weight, zero blocks)
    "gguf/quantized-0-dims.gguf": "has a row of 1 weights, not a multiple of the block size 32",
    # RuntimeError in Q4_K dequantize: a tensor with a zero dimension (no blocks)
    "gguf/quantized-with-zero-rows.gguf": None,
    # ValueError from numpy: an empty tensor whose row is wider than an int64 (ne[0] ~ 2**63)
    "gguf/dims-past-int64.gguf": "more weights or row bytes than an int64 can count",
    # RecursionError: PyYAML recursing over 3000 nested flow sequences
    # PyYAML 6.0.4 (installed here) stops at a nesting limit of its own before our event count
    "spec/deep-flow-nesting.yaml": "YAML nested deeper than 32 levels|not valid YAML at line 2, column 1003: exceeded maximum nesting depth",
    # TypeError: unknown keys 1 and 'dec.{i}.x' sorted together for the error message
    "spec/integer-key.yaml": r"unknown key 1, 'dec.\{i\}.x'",
    # ValueError: base: / has no file name to give a .yaml suffix
    "spec/base-is-root.yaml": "no spec file '/'",
    # MemoryError after 40 s: 9**9 values once the aliases expand, walked by the validator
    "spec/billion-laughs.yaml": "more than 100000 values once YAML aliases are expanded",
    # a mapping that contains itself through an alias
    "spec/recursive-alias.yaml": "recursive YAML alias",
    # RuntimeError from Path.expanduser: ~user of no such user, in base: and in source.files
    "spec/unknown-user.yaml": "base: cannot expand '~nosuchuser/spec'",
    "spec/unknown-user-file.yaml": "source.files: cannot expand '~nosuchuser/model.gguf'",
    # OSError (ENAMETOOLONG) from Path.is_file / Path.exists on a 5000-character file name
    "spec/base-name-too-long.yaml": "no spec file 'aaaa",
    "spec/source-file-name-too-long.yaml": "source.files: 'aaaa.* does not exist",
    "spec/tokenizer-file-name-too-long.yaml": r"tokenizer.files\[0\]: .*(does not exist|not installed)",
    # NotADirectoryError: config.json of an hf source that is a device, not a directory
    "spec/config-under-a-device.yaml": "cannot read config file /dev/null/config.json",
}


def test_every_regression_input_has_an_expectation() -> None:
    files = {p.relative_to(REGRESSIONS).as_posix() for p in REGRESSIONS.glob("*/*")}
    assert files == set(EXPECTED)


@pytest.mark.parametrize("rel", sorted(EXPECTED))
def test_regression_input_ends_cleanly(tmp_path: Path, rel: str) -> None:
    target = TARGETS[rel.split("/")[0]]
    path = tmp_path / f"input{target.suffix}"
    shutil.copy(REGRESSIONS / rel, path)
    message = EXPECTED[rel]
    if message is None:
        target.run(path)
        return
    with pytest.raises(InferflowError, match=message):
        target.run(path)


@pytest.mark.parametrize("name", ["gguf", "safetensors", "pickle"])
def test_seeds_load(tmp_path: Path, name: str) -> None:
    # a seed that fails to load would waste the fuzzer's effort on the first check
    target = TARGETS[name]
    seeds = [(n, d) for n, d in target.seeds() if n.endswith((".gguf", ".safetensors", ".pt"))]
    assert len(seeds) >= 3
    for seed_name, data in seeds:
        path = tmp_path / f"{seed_name}{target.suffix}"
        path.write_bytes(data)
        target.run(path)


# prints {target: [[seed name the input was made from, sha1 of the input], ...]} for inputs 1..N
_HASH_INPUTS = """
import hashlib, json
from inferflow.fuzz import PUBLIC_TARGETS, TARGETS
from inferflow.fuzz.harness import input_rng, make_input
out = {}
for name in PUBLIC_TARGETS:
    names, seeds = zip(*TARGETS[name].seeds())
    rows = out[name] = []
    for i in range(1, len(seeds) + 30):
        # the index rng.choice(seeds) takes in make_input: the same draw over the same length
        base = i if i < len(seeds) else input_rng(5, name, i).choice(range(len(seeds)))
        rows.append([names[base], hashlib.sha1(make_input(name, seeds, 5, i)).hexdigest()])
print(json.dumps(out))
"""


def _input_hashes() -> dict[str, list[list[str]]]:
    proc = subprocess.run(
        [sys.executable, "-c", _HASH_INPUTS], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_inputs_are_reproducible() -> None:
    # input i depends on (seed, target, i) alone: the same bytes in another process (seeds made
    # from memory addresses, set or dict order, or hash randomization would break this)
    first, second = _input_hashes(), _input_hashes()
    assert first == second
    # the legacy seeds themselves and mutants made from them
    assert sum(seed.endswith(".legacy.pt") for seed, _ in first["pickle"]) >= 6
    for name in PUBLIC_TARGETS:
        seeds = [d for _, d in TARGETS[name].seeds()]
        assert make_input(name, seeds, 5, 1000) != make_input(name, seeds, 6, 1000)


def _same(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and type(a) is type(b)
            and list(a) == list(b)
            and all(_same(a[k], b[k]) for k in a)
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and type(a) is type(b)
            and (a.dtype, a.shape, a.stride(), a.storage_offset())
            == (b.dtype, b.shape, b.stride(), b.storage_offset())
            and torch.equal(a, b)
        )
    return a == b


def test_legacy_seeds_load_in_torch() -> None:
    # the legacy seeds come from our own writer (torch's names storages by memory address, so its
    # bytes change between runs): torch must read back what was saved, shared storages shared
    for name, obj in _state_dicts().items():
        back = torch.load(io.BytesIO(legacy_save(obj)), weights_only=True)
        assert _same(back, obj), name
        if name == "mixed":
            assert len({back[k].untyped_storage().data_ptr() for k in ("w", "view", "tied")}) == 1


def test_mutators_run_without_error() -> None:
    # make_input falls back to blind havoc when a mutator raises (and counts it); here a mutator
    # error fails the test with its traceback. The GGUF mutator once failed on every seed.
    for name in PUBLIC_TARGETS:
        seeds = [d for _, d in TARGETS[name].seeds()]
        for i in range(200):
            rng = input_rng(1, name, i)
            TARGETS[name].mutate(rng, rng.choice(seeds), seeds)
    for i in range(200):  # a root that an earlier round made a list or a scalar
        mutate_tree(random.Random(i), [{"name": "x"}, 1] if i % 2 else "x")


def test_mutator_errors_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(rng: random.Random, seed: bytes, seeds: Sequence[bytes]) -> bytes:
        raise KeyError("a bug in the mutator")

    monkeypatch.setitem(TARGETS, "selftest", replace(TARGETS["selftest"], mutate=broken))
    report = TargetReport("selftest")
    assert make_input("selftest", [b"o"], 0, 5, report)  # made by havoc instead
    assert report.mutator_errors == 1


@pytest.mark.slow
def test_targets_run_clean() -> None:
    with Campaign(PUBLIC_TARGETS, seed=20260601) as campaign:
        for name in PUBLIC_TARGETS:
            report = campaign.run(name, 250)
            assert report.inputs == 250
            assert not report.bugs, f"{name}: {list(report.bugs.values())}"
            assert report.outcomes["ok"] > 0, report.outcomes
            assert any(k.startswith("error:") for k in report.outcomes), report.outcomes
            assert report.worker_restarts == 0  # nothing killed or hung the worker
            assert report.mutator_errors == 0


def _cli() -> object:
    spec = importlib.util.spec_from_file_location("fuzz_cli", ROOT / "tools" / "fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_harness_reports_every_kind_of_bug(tmp_path: Path) -> None:
    """A target that misbehaves on purpose, once per way: the fuzzer must see each one."""
    cli = _cli()
    argv = ["selftest", "--count", str(len(SELFTEST_KINDS)), "--time-limit", "1", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 1  # type: ignore[attr-defined]
    (report,) = json.loads((tmp_path / "report.json").read_text())["targets"]
    assert report["inputs"] == len(SELFTEST_KINDS)
    assert report["outcomes"] == {
        "ok": 1,
        "error:CheckpointError": 1,
        "bug:TypeError": 1,  # not one of our error types
        "bug:empty-message": 1,  # ours, but says nothing
        "bug:hang": 1,  # past the time limit, twice
        "bug:memory": 1,  # past the address-space bound
        "bug:write": 2,  # a file written, a command run
        "bug:crash": 1,  # the worker died (SIGSEGV)
    }
    sites = {b["site"] for b in report["bugs"]}
    assert "audit os.system" in sites  # stopped by the guard before the command ran
    assert "killed by SIGSEGV" in sites
    for bug in report["bugs"]:
        assert Path(bug["input_file"]).is_file() and bug["count"] == 1
