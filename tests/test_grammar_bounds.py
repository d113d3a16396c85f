"""Issue 48 in the library, without a server: structured-output constraints bounded before they
compile (GrammarLimits), compiled in a worker process that a crash or the time limit ends,
tried at their first steps; request JSON bounded in depth; the spec's base: chain bounded; the
batcher's resumable calls interleaved and stopped; prefix-cache salts; log records cut. And a
hypothesis fuzzer over the deep shapes of inferflow.fuzz.deep: whatever its size, a constraint
compiles or is refused with a RequestError, and this process lives on."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferflow.engine.grammar_bounds import GrammarLimits, check_bounds
from inferflow.errors import RequestError, SpecError, Stopped
from inferflow.fuzz import deep
from inferflow.server.jsonvalue import MAX_JSON_DEPTH, check_value, loads
from inferflow.tokenizer.template_worker import WorkerPool, validate_in_worker
from tests.conftest import smollm2_path

LIMITS = GrammarLimits()
OPEN = GrammarLimits(max_bytes=10**9, max_rules=10**8, max_depth=10**8, max_alternatives=10**8)


@pytest.fixture(scope="module")
def pool() -> WorkerPool:
    p = WorkerPool(1)
    yield p
    p.close()


@pytest.mark.parametrize(
    ("kind", "value", "flag"),
    [
        ("grammar", deep.lark_chain(1100), "--grammar-max-alternatives"),
        ("grammar", deep.lark_chain(1100).replace(" | ", " "), "--grammar-max-rules"),
        ("grammar", deep.lark_nested(65), "--grammar-max-depth"),
        ("json_schema", deep.ref_chain(1000), "--grammar-max-rules"),
        ("json_schema", deep.nested_schema(40), "--grammar-max-depth"),
        ("json_schema", {"enum": list(range(1025))}, "--grammar-max-alternatives"),
        ("choice", ["x"] * 1025, "--grammar-max-alternatives"),
        ("choice", deep.long_choices(10, 14000), "--grammar-max-bytes"),
        ("regex", "(" * 65 + "a" + ")" * 65, "--grammar-max-depth"),
        ("regex", "|".join("a" * 1026), "--grammar-max-alternatives"),
    ],
)
def test_each_bound_is_named(kind: str, value: object, flag: str) -> None:
    with pytest.raises(RequestError, match=flag):
        check_bounds(kind, value, LIMITS)


def test_under_the_bounds_passes() -> None:
    for kind, value in [
        ("grammar", deep.lark_chain(400)),
        ("grammar", 'start: "(" x ")" | "|"\nx: /[()|]+/ // a comment ( ( ( |\n'),
        ("json_schema", deep.ref_chain(999)),
        ("json_schema", deep.nested_schema(30)),
        ("choice", ["yes", "no"]),
        ("regex", r"\(\|\)" * 100),
    ]:
        check_bounds(kind, value, LIMITS)


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(RequestError, match="--grammar-timeout: must be > 0"):
        GrammarLimits(seconds=0)


def test_a_compiler_crash_ends_the_worker_not_this_process(pool: WorkerPool) -> None:
    patient = GrammarLimits(**{**OPEN.__dict__, "seconds": 60.0})  # (the crash comes first)
    for kind, value in [
        ("grammar", deep.lark_chain(20_000)),
        ("json_schema", deep.ref_chain(20_000)),
    ]:
        with pytest.raises(RequestError, match="ended the compiler"):
            validate_in_worker(kind, value, patient, pool)
    # the pool starts a fresh worker for the next constraint
    assert "start" in validate_in_worker("grammar", deep.lark_chain(100), LIMITS, pool)


def test_a_slow_compile_ends_at_the_time_limit(pool: WorkerPool) -> None:
    t0 = time.monotonic()
    limits = GrammarLimits(seconds=1.0)
    with pytest.raises(RequestError, match=r"longer than the limit of 1.0 s \(--grammar-timeout\)"):
        validate_in_worker("json_schema", deep.pattern_intersection(20), limits, pool)
    assert time.monotonic() - t0 < 3
    assert validate_in_worker("regex", r"\d+", LIMITS, pool)


def test_a_grammar_failing_at_its_first_steps_fails_to_compile() -> None:
    from inferflow.engine.constrain import compile_grammar, lltokenizer
    from inferflow.runtime import load

    smollm2_path()
    lm = load("smollm2-135m-instruct")
    ll = lltokenizer(lm.tokenizer, lm.spec.hparams.vocab_size)
    with pytest.raises(RequestError, match="fails at its first steps") as e:
        compile_grammar("json_schema", deep.self_reference(), ll)
    assert len(str(e.value)) < 500  # (llguidance's message, not the grammar)
    compile_grammar("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}}, ll)


# --- the fuzzer -------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip


@FUZZ
@given(
    shape=st.sampled_from(sorted(deep.CONSTRAINTS)),
    n=st.one_of(st.integers(0, 64), st.integers(64, 2000), st.integers(2000, 60_000)),
    open_bounds=st.booleans(),
)
def test_fuzz_deep_constraints_compile_or_are_refused(
    pool: WorkerPool, shape: str, n: int, open_bounds: bool
) -> None:
    kind, build = deep.CONSTRAINTS[shape]
    limits = OPEN if open_bounds else LIMITS
    limits = GrammarLimits(**{**limits.__dict__, "seconds": 2.0})
    try:
        text = validate_in_worker(kind, build(n), limits, pool)
    except RequestError as e:
        assert str(e) and len(str(e)) < 1000
    else:
        assert text


@FUZZ
@given(n=st.integers(1, 5000), objects=st.booleans())
def test_fuzz_nested_tool_arguments_are_bounded(n: int, objects: bool) -> None:
    text = deep.nested_object_json(n) if objects else deep.nested_json(n)
    if n <= MAX_JSON_DEPTH:
        check_value(loads(text, "arguments"), "arguments")
    else:
        with pytest.raises(ValueError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
            loads(text, "arguments")


# --- the rest of issue 48 in the library ------------------------------------------------------


def test_json_values_are_bounded_without_recursion() -> None:
    value: object = "x"
    for _ in range(100_000):  # (a recursive walk would end in RecursionError)
        value = {"a": [value]}
    with pytest.raises(ValueError, match="deeper than 64 levels"):
        check_value(value, "tools")
    with pytest.raises(ValueError, match="lone surrogate"):
        check_value({"a": ["\udfff"]}, "the text")


def test_a_long_base_chain_is_a_spec_error(tmp_path: Path) -> None:
    from inferflow.spec import load_spec

    (tmp_path / "s0.yaml").write_text("base: smollm2-135m-instruct\n")
    for i in range(1, 1200):
        (tmp_path / f"s{i}.yaml").write_text(f"base: s{i - 1}.yaml\n")
    with pytest.raises(SpecError, match="longer than 16 specs"):
        load_spec(str(tmp_path / "s1199.yaml"))
    out = subprocess.run(
        [sys.executable, "-m", "inferflow.cli.main", "validate", str(tmp_path / "s1199.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "longer than 16 specs" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    (tmp_path / "ok.yaml").write_text("base: s5.yaml\n")  # 7 specs: loads
    assert load_spec(str(tmp_path / "ok.yaml")).name


def test_resumable_calls_interleave_and_stop_within_a_chunk() -> None:
    from inferflow.server.batcher import Batcher

    ran: list[str] = []

    def call(tag: str, chunks: int):
        def run(batch: list[list[int]], stop: object):
            for i in range(chunks):
                ran.append(f"{tag}{i}")
                yield
            return [tag] * len(batch)

        return run

    b = Batcher(100)
    a = b.submit(("score", "a"), [[1]], call("a", 3))
    c = b.submit(("score", "c"), [[2]], call("c", 50))
    b.run_pending()  # both start (nothing computed yet)
    assert ran == []
    for _ in range(4):
        b.run_pending()
    assert ran == ["a0", "c0", "a1", "c1"]  # one chunk a turn, in turn
    b.abandon(c)  # its client left: stopped before its next chunk
    for _ in range(4):
        b.run_pending()
    assert a.result() == ["a"]
    assert isinstance(c.exception(), Stopped)
    assert ran == ["a0", "c0", "a1", "c1", "a2"] and not b.pending()
    plain: Future = b.submit("embed", [[3]], lambda batch, stop: ["e"])
    b.run_pending()
    assert plain.result() == ["e"]


def test_prefix_cache_salts_never_share_blocks() -> None:
    import torch

    from inferflow.engine.kv_cache import PagedKVCache, SeqBlocks

    cache = PagedKVCache(1, 1, 4, 4, 16, torch.float32)
    tokens = list(range(13))

    def publish(salt: str) -> None:
        seq = SeqBlocks(salt=salt)
        cache.reserve(seq, len(tokens))
        seq.num_computed = len(tokens)
        cache.register_full_blocks(seq, tokens)

    publish("a")
    for salt, shared in (("a", 12), ("b", 0), ("", 0), ("a\x00", 0)):
        assert cache.match_prefix(SeqBlocks(salt=salt), tokens) == shared, salt


def test_min_tokens_does_not_combine_with_a_grammar() -> None:
    from inferflow.engine.sampling import SamplingParams

    with pytest.raises(RequestError, match="min_tokens: 3 does not combine") as e:
        SamplingParams(min_new_tokens=3, grammar=object())  # type: ignore[arg-type]
    assert e.value.param == "min_tokens"


def test_log_records_are_cut() -> None:
    from inferflow.cli.main import MAX_LOG_LINE, MAX_LOG_RECORD, BoundedFormatter

    fmt = BoundedFormatter("%(message)s")
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "g " + "x" * 10**6, None, None)
    out = fmt.format(record)
    assert len(out) < MAX_LOG_LINE + 40 and out.endswith("[1000002 chars]")
    record.msg = "\n".join(["y" * 100] * 1000)
    assert len(fmt.format(record)) <= MAX_LOG_RECORD + 10
