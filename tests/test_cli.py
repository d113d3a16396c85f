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
    lm = load("smollm2-135m-instruct", "auto")  # (the CLI's default dtype: act8 here)
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
        "--dtype",
        "float32",  # (act8 puts " L" first here: 0.145 against 0.124; float32 0.152 / 0.140)
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


def _no_weights(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Loading weights (or building the server) in ``module`` fails the test: what is checked
    there must fail before."""

    def loaded(*_: object, **__: object) -> None:
        raise AssertionError("the weights were loaded before the check")

    for name in ("load", "create_app"):
        monkeypatch.setattr(f"{module}.{name}", loaded, raising=False)


def test_checks_that_need_no_weights_fail_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A chat prompt for a model without a chat template, a text shorter than one perplexity
    window, a prompt that renders to nothing, an unknown --quant: one clean line, exit 2, and
    no weights loaded first."""
    from inferflow.cli.main import main

    smollm2_path()
    _no_weights(monkeypatch, "inferflow.cli.generate")
    _no_weights(monkeypatch, "inferflow.cli.ppl")
    text = _write(tmp_path, "A short text.", "short.txt")
    empty = _write(
        tmp_path, "name: e\nbase: smollm2-135m-instruct\ntokenizer: {chat_template: ''}\n"
    )
    cases = [
        (["generate", "all-minilm-l6-v2", "--prompt", "hi", "--chat"], "no chat template"),
        (["generate", str(empty), "--prompt", "hi", "--chat"], "--prompt: the chat template"),
        (["generate", "smollm2-135m-instruct", "--prompt", "hi", "--quant", "Q9"], "'Q9'"),
        (["ppl", "smollm2-135m-instruct", "--text", str(text)], "fewer than one window"),
        (["ppl", "smollm2-135m-instruct", "--text", str(text), "--quant", "Q9"], "'Q9'"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)


def test_serve_prefill_budget_flag_reaches_the_scheduler() -> None:
    """--max-prefill-tokens (default 256) is the scheduler's max_prefill_tokens; 0 is one
    error naming the flag."""
    from inferflow.cli.main import build_parser
    from inferflow.cli.serve import engine_config
    from inferflow.errors import InferflowError

    parse = build_parser().parse_args
    assert engine_config(parse(["serve", "m"])).scheduler.max_prefill_tokens == 256
    got = engine_config(parse(["serve", "m", "--max-prefill-tokens", "64"])).scheduler
    assert (got.max_prefill_tokens, got.max_batched_tokens) == (64, 512)
    with pytest.raises(InferflowError, match="--max-prefill-tokens: must be >= 1, got 0"):
        engine_config(parse(["serve", "m", "--max-prefill-tokens", "0"]))


def test_serve_on_a_port_in_use_exits_1_before_loading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second server on a busy port: one line naming the port, exit status 1, before the
    model loads (it used to load, print the bind error and die with SIGABRT)."""
    import socket

    from inferflow.cli.main import main

    smollm2_path()
    _no_weights(monkeypatch, "inferflow.server.app")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "smollm2-135m-instruct", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port}"), err


@pytest.mark.slow
def test_generate_stop_cuts_the_text_where_the_stop_text_starts() -> None:
    smollm2_path()
    base = ["generate", "smollm2-135m-instruct", "--prompt", "1, 2, 3, 4,", "--temperature", "0"]
    free = json.loads(run_cli(*base, "--max-tokens", "24", "--json").stdout)
    assert " 8" in free["text"] and free["finish_reason"] == "length"
    r = run_cli(*base, "--max-tokens", "24", "--stop", " 8", "--stop", "never", "--json")
    cut = json.loads(r.stdout)
    assert cut["text"] == free["text"][: free["text"].index(" 8")]
    assert cut["finish_reason"] == "stop"


@pytest.mark.slow
def test_chat_keeps_the_history_and_matches_transformers() -> None:
    """``inferflow chat`` (two turns on stdin, --json): each reply is transformers' greedy reply
    to the conversation so far through the chat template; the second turn reuses the first's
    tokens from the prefix cache."""
    tf = pytest.importorskip("transformers")
    import torch

    path = smollm2_path()
    r = subprocess.run(
        [sys.executable, "-m", "inferflow.cli.main", "chat", "smollm2-135m-instruct"]
        + ["--dtype", "float32", "--temperature", "0", "--max-tokens", "20", "--json"],
        input="Name an ocean.\n/reset\nName a desert.\nAnother one?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    model = tf.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def reply(messages: list[dict]) -> str:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    first = [{"role": "user", "content": "Name an ocean."}]
    assert turns[0]["reply"] == reply(first)
    convo = [{"role": "user", "content": "Name a desert."}]  # (/reset dropped the ocean)
    assert turns[1]["reply"] == reply(convo)
    convo += [{"role": "assistant", "content": turns[1]["reply"]}]
    convo += [{"role": "user", "content": "Another one?"}]
    assert turns[2]["reply"] == reply(convo)
    assert len(turns) == 3 and turns[2]["cached_tokens"] >= 16
