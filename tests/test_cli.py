"""The CLI end to end (a real subprocess): JSON output, streaming, validate, inspect, and clean
errors (exit 2, one line, no traceback) for bad input; plus how input files split into lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import smollm2_path


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferflow.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_generate_json_greedy_matches_library() -> None:
    smollm2_path()
    from inferflow.engine.sampling import SamplingParams
    from inferflow.runtime import load

    r = run_cli(
        "generate",
        "smollm2-135m-instruct",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    lm = load("smollm2-135m-instruct")
    expected = lm.complete("The capital of France is", SamplingParams(max_new_tokens=8))
    assert out["prompt_token_ids"] == expected.prompt_token_ids
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    assert "Paris" in out["text"]


@pytest.mark.slow
def test_generate_streams_chat_text() -> None:
    smollm2_path()
    r = run_cli(
        "generate",
        "smollm2-135m-instruct",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_validate_prints_resolved_spec() -> None:
    smollm2_path()
    r = run_cli("validate", "smollm2-135m-instruct")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["hparams"]["n_kv_heads"] == 3 and out["hparams"]["attention_kind"] == "GQA"
    # every tensor of the GGUF bound by name and shape (30 layers x 9, embedding, final norm)
    assert out["binding"]["checkpoint_tensors"] == 272


def test_validate_binds_the_checkpoint(tmp_path: Path) -> None:
    """validate builds the network on the meta device and binds the checkpoint: a spec whose
    network does not match its checkpoint fails there, naming the tensors."""
    smollm2_path()
    spec = tmp_path / "untied.yaml"
    spec.write_text("base: smollm2-135m-instruct\nname: untied\nnetwork: {output: {tied: false}}\n")
    r = run_cli("validate", str(spec))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "lacks 1 tensor(s) the network needs: dec.output.weight" in r.stderr


def test_inspect_lists_tensors_and_metadata() -> None:
    r = run_cli("inspect", str(smollm2_path()), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    types = {t["name"]: t["type"] for t in out["tensors"]}
    assert (
        len(types) == 272
        and types["token_embd.weight"] == "Q8_0"
        and types["blk.0.attn_q.weight"] == "Q4_1"
    )
    assert out["metadata"]["general.architecture"] == "llama"


@pytest.mark.parametrize(
    "make_args, message",
    [
        (
            lambda tmp: ["generate", "no-such-model", "--prompt", "x"],
            "no spec file 'no-such-model'",
        ),
        (
            lambda tmp: [
                "validate",
                str(
                    _write(
                        tmp,
                        "name: x\nsource: {format: gguf, files: [a.gguf]}\nnetwork: {type: decoder_only}\n",
                    )
                ),
            ],
            "missing required key",
        ),
        (lambda tmp: ["inspect", str(_write(tmp, "not a checkpoint at all", "x.bin"))], "x.bin"),
        (
            lambda tmp: [
                "inspect",
                str(_write_bytes(tmp, b"GGUF\x03\x00\x00\x00" + b"\x00" * 5, "t.gguf")),
            ],
            "t.gguf",
        ),
    ],
)
def test_errors_are_one_clean_line(make_args, message: str, tmp_path: Path) -> None:
    r = run_cli(*make_args(tmp_path))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ")
    assert message in r.stderr


def test_generate_rejects_bad_sampling_value() -> None:
    smollm2_path()
    r = run_cli("generate", "smollm2-135m-instruct", "--prompt", "x", "--top-p", "1.5")
    assert (
        r.returncode == 2 and "top_p: must be in (0, 1]" in r.stderr and "Traceback" not in r.stderr
    )


def test_read_lines_splits_on_line_ends_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """str.splitlines also split on form feed, U+2028, ...: `translate` / `embed` gave more
    outputs than input lines."""
    import io

    from inferflow.cli.common import read_lines

    text = "C\u2028O\r\nform\x0cfeed\x1c\x85\n\nlast"
    want = ["C\u2028O", "form\x0cfeed\x1c\x85", "", "last"]
    p = tmp_path / "in.txt"
    p.write_bytes(text.encode())
    assert read_lines(str(p)) == want
    p.write_bytes((text + "\n").encode())  # a final line end adds no empty line
    assert read_lines(str(p)) == want
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode()), newline="\n"))
    assert read_lines("-") == want


def _write(tmp: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp / name
    p.write_text(text)
    return p


def _write_bytes(tmp: Path, data: bytes, name: str) -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p
