"""Token ids in and out of ``generate``, ``embed`` and ``classify`` (``--ids``, ``--prompt -``
from stdin): the same numbers as text in, and as the library; a model without a tokenizer takes
ids, and its text input fails before any weight loads (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import smollm2_path
from tests.test_real_packages import REACTIONS, _package_dir

pytestmark = pytest.mark.slow


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferflow.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        input=stdin,
    )


def test_generate_ids_from_stdin_without_a_tokenizer(tmp_path: Path) -> None:
    smollm2_path()
    from inferflow.engine.sampling import SamplingParams
    from inferflow.runtime import load

    lm = load("smollm2-135m-instruct", "float32")
    want = lm.complete("The capital of France is", SamplingParams(max_new_tokens=8))
    prompt = " ".join(map(str, want.prompt_token_ids))
    args = ["--max-tokens", "8", "--temperature", "0", "--dtype", "float32"]
    r = run_cli("generate", "smollm2-135m-instruct", "--ids", "--prompt", "-", *args, stdin=prompt)
    assert r.returncode == 0, r.stderr
    assert [int(t) for t in r.stdout.split()] == want.token_ids
    # a spec without a tokenizer: ids work, text fails before the weights load
    spec = tmp_path / "ids-only.yaml"
    spec.write_text("name: ids-only\nbase: smollm2-135m-instruct\ntokenizer: {from: none}\n")
    r = run_cli("generate", str(spec), "--ids", "--prompt", prompt, "--json", *args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == want.token_ids and out["prompt_token_ids"] == want.prompt_token_ids
    r = run_cli("-v", "generate", str(spec), "--prompt", "The capital", *args)
    assert r.returncode == 2
    assert "declares no tokenizer: pass token ids (the CLI's --ids)" in r.stderr
    assert "weights resident" not in r.stderr and "loaded ids-only" not in r.stderr
    ok = run_cli("-v", "generate", str(spec), "--ids", "--prompt", prompt, *args)
    assert "loaded ids-only" in ok.stderr  # (what the check above would see after loading)
    r = run_cli("generate", str(spec), "--ids", "--prompt", "12 x 5", *args)
    assert r.returncode == 2 and "--prompt: not space-separated token ids: '12 x 5'" in r.stderr


def test_embed_and_classify_ids_equal_text() -> None:
    _package_dir("rxnfp")
    from inferflow.runtime import load

    tok = load("rxnfp-reaction-classifier", "float32").tokenizer
    assert tok is not None
    ids = [" ".join(map(str, tok.encode(r))) for r in REACTIONS[:3]]
    for cmd in ("embed", "classify"):
        spec = "rxnfp-reaction-classifier"
        text = run_cli(cmd, spec, *[a for r in REACTIONS[:3] for a in ("--text", r)])
        by_ids = run_cli(cmd, spec, "--ids", "--input", "-", stdin="\n".join(ids) + "\n")
        assert text.returncode == 0 and by_ids.returncode == 0, text.stderr + by_ids.stderr
        assert text.stdout == by_ids.stdout and len(text.stdout.splitlines()) == 3


def test_completions_return_ids_for_a_model_without_a_tokenizer(tmp_path: Path) -> None:
    """/v1/completions of a model without a tokenizer: the output's token ids are in each
    choice (its text is empty); an encoder-decoder's too, on request (return_token_ids)."""
    import httpx

    from inferflow.engine.sampling import SamplingParams
    from inferflow.runtime import load
    from tests.serving import run_server

    smollm2_path()
    want = load("smollm2-135m-instruct", "float32", quant="none").complete(
        [1, 504, 3575, 282], SamplingParams(max_new_tokens=6)
    )
    spec = tmp_path / "ids-only.yaml"
    spec.write_text("name: ids-only\nbase: smollm2-135m-instruct\ntokenizer: {from: none}\n")
    body = {"prompt": [1, 504, 3575, 282], "max_tokens": 6, "temperature": 0}
    with run_server(tmp_path, "--quant", "none", "--dtype", "float32", spec=str(spec)) as (url, _):
        choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["text"] == ""
    assert choice["prompt_token_ids"] == [1, 504, 3575, 282]
    _package_dir("tg2fa_translit")
    with run_server(tmp_path, spec="tg2fa-translit") as (url, _):
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": "китоб", "return_token_ids": True}
        ).json()
    assert r["choices"][0]["prompt_token_ids"] == [2, 17, 15, 25, 21, 8, 3]
    assert r["choices"][0]["token_ids"] == [41, 11, 9, 10, 3]  # (کتاب, then the end token)
