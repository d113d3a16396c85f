"""The fuzz harness (``inferflow.fuzz``, ``tools/fuzz.py``): every target runs clean on a few
hundred inputs, the harness reports each kind of bug it exists to catch, and every input that
once broke a loader (tests/fuzz_regressions/) now ends in a clean error."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from inferflow.errors import InferflowError
from inferflow.fuzz import PUBLIC_TARGETS, TARGETS, Campaign
from inferflow.fuzz.harness import make_input
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
    "spec/deep-flow-nesting.yaml": "YAML nested deeper than 32 levels",
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
    "spec/tokenizer-file-name-too-long.yaml": "tokenizer.files: .*(does not exist|not installed)",
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


def test_inputs_are_reproducible() -> None:
    for name in PUBLIC_TARGETS:
        seeds = [d for _, d in TARGETS[name].seeds()]
        for i in (0, len(seeds), len(seeds) + 7):
            assert make_input(name, seeds, 5, i) == make_input(name, seeds, 5, i)
        assert make_input(name, seeds, 5, 1000) != make_input(name, seeds, 6, 1000)


def test_targets_run_clean() -> None:
    with Campaign(PUBLIC_TARGETS, seed=20260601) as campaign:
        for name in PUBLIC_TARGETS:
            report = campaign.run(name, 250)
            assert report.inputs == 250
            assert not report.bugs, f"{name}: {list(report.bugs.values())}"
            assert report.outcomes["ok"] > 0, report.outcomes
            assert any(k.startswith("error:") for k in report.outcomes), report.outcomes
            assert report.worker_restarts == 0  # nothing killed or hung the worker


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
