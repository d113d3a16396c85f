"""Generation-based fuzzing with hypothesis, the complement of the mutation fuzzer: GGUF files,
safetensors headers and pickle opcode streams built from scratch out of the fields' own types,
each run through the full load path. Either it loads or it raises one of our errors with a
message. Derandomized, no example database: the same inputs on every run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferflow.errors import InferflowError
from inferflow.fuzz.mut_binary import GGML_TYPE_IDS, ST_DTYPES
from inferflow.fuzz.mut_pickle import SNIPPETS
from inferflow.fuzz.mutate import INTERESTING
from inferflow.fuzz.targets import run_gguf, run_pickle, run_safetensors

SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip

small = st.integers(0, 64)
u64 = st.one_of(small, st.sampled_from([v % 2**64 for v in INTERESTING]))
u32 = st.one_of(small, st.sampled_from([v % 2**32 for v in INTERESTING]))
text = st.one_of(st.text(max_size=16).map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=16))  # fmt: skip


# mostly the true count or length, sometimes a lie
def lie(strategy: st.SearchStrategy[int]) -> st.SearchStrategy[int | None]:
    return st.one_of(st.none(), st.none(), st.none(), strategy)


def _string(raw: bytes, declared: int | None) -> bytes:
    return struct.pack("<Q", len(raw) if declared is None else declared) + raw


@st.composite
def gguf_value(draw: st.DrawFn, depth: int = 0) -> tuple[int, bytes]:
    vtype = draw(st.one_of(st.integers(0, 12), u32))
    if vtype == 8:
        return vtype, _string(draw(text), draw(lie(u64)))
    if vtype == 9 and depth < 2:
        items = draw(st.lists(gguf_value(depth + 1), max_size=4))
        itype = items[0][0] if items else draw(st.integers(0, 12))
        count = draw(lie(u64))
        body = b"".join(v for _, v in items)
        return 9, struct.pack("<IQ", itype, len(items) if count is None else count) + body
    return vtype, draw(st.binary(max_size=8))


@st.composite
def gguf_file(draw: st.DrawFn) -> bytes:
    kvs = draw(st.lists(st.tuples(text, gguf_value()), max_size=5))
    tensors = draw(st.lists(st.tuples(text, st.lists(u64, max_size=5), st.sampled_from(GGML_TYPE_IDS), u64), max_size=4))  # fmt: skip
    out = b"GGUF" + struct.pack("<I", draw(st.sampled_from([3, 3, 3, 3, 2, 1, 4])))
    n_tensors, n_kvs = draw(lie(u64)), draw(lie(u64))
    out += struct.pack(
        "<QQ",
        len(tensors) if n_tensors is None else n_tensors,
        len(kvs) if n_kvs is None else n_kvs,
    )
    for key, (vtype, value) in kvs:
        out += _string(key, None) + struct.pack("<I", vtype) + value
    for name, dims, ggml_type, offset in tensors:
        out += _string(name, None) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ggml_type, offset * 32 % 2**64)
    out += b"\0" * (-len(out) % 32)
    return out + draw(st.binary(max_size=512))


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**65), st.text(max_size=8))
entry = st.fixed_dictionaries(
    {
        "dtype": st.one_of(st.sampled_from(ST_DTYPES), json_scalar),
        "shape": st.one_of(st.lists(st.integers(0, 2**64), max_size=4), json_scalar),
        "data_offsets": st.one_of(
            st.lists(st.integers(0, 300), min_size=2, max_size=2), json_scalar
        ),  # fmt: skip
    }
)


@st.composite
def safetensors_file(draw: st.DrawFn) -> bytes:
    header = draw(st.dictionaries(st.text(max_size=6), entry, max_size=4))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), json_scalar, max_size=2))
    raw = json.dumps(header).encode()
    n = draw(lie(u64))
    n = len(raw) if n is None else n
    return struct.pack("<Q", n) + raw + draw(st.binary(max_size=300))


pickle_stream = st.lists(st.sampled_from(SNIPPETS), max_size=30).map(
    lambda ops: b"\x80\x02" + b"".join(ops) + b"."
)


def _check(tmp_path: Path, data: bytes, suffix: str, run: object) -> None:
    path = tmp_path / f"input{suffix}"
    path.write_bytes(data)
    try:
        run(path)  # type: ignore[operator]
    except InferflowError as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"


@SETTINGS
@given(data=gguf_file())
def test_generated_gguf(tmp_path: Path, data: bytes) -> None:
    _check(tmp_path, data, ".gguf", run_gguf)


@SETTINGS
@given(data=safetensors_file())
def test_generated_safetensors(tmp_path: Path, data: bytes) -> None:
    _check(tmp_path, data, ".safetensors", run_safetensors)


@SETTINGS
@given(data=pickle_stream)
def test_generated_pickles(tmp_path: Path, data: bytes) -> None:
    _check(tmp_path, data, ".pt", run_pickle)
