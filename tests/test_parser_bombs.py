"""Parsers bound total work, not just depth (issue 24): every resource bomb ends in a clean
InferflowError that names the limit, within 5 s and 2x its size + 300 MB of memory.

A bomb is parsed in a subprocess that reports its peak RSS (VmHWM) before and after the parse, so
the baseline of importing torch is left out; the time is the parse's own wall time there.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from inferflow.errors import CheckpointError, InferflowError, SpecError, UnsafePickleError
from inferflow.loaders import detect_format, open_files
from inferflow.loaders.gguf import GGUFSource
from inferflow.loaders.pickle_limits import HASH_MODULUS
from inferflow.loaders.pickle_vm import PickleLimits, load_one, loads_plain
from inferflow.loaders.torch_pickle import describe_allowed, resolve_global
from inferflow.paths import resolve_ref
from inferflow.spec import MAX_SPEC_BYTES, read_doc

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20
MAX_SECONDS = 5.0

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")

_CHILD = """
import json, sys, time
from pathlib import Path

def peak():  # the process's peak resident set so far, in bytes
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

from inferflow.errors import InferflowError
{imports}
path = Path(sys.argv[1])
before, start = peak(), time.perf_counter()
try:
    {call}
    out = {{"error": None, "message": ""}}
except InferflowError as e:
    out = {{"error": type(e).__name__, "message": str(e)}}
out.update(seconds=time.perf_counter() - start, rss=peak() - before)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Outcome:
    error: str | None
    message: str
    seconds: float
    rss: int  # peak RSS growth during the parse, bytes


def parse_in_child(path: Path, imports: str, call: str) -> Outcome:
    code = _CHILD.format(imports=imports, call=call)
    try:  # the limit leaves room for importing torch on a busy machine
        proc = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"parsing {path.name} did not end within 120 s")
    assert proc.returncode == 0, proc.stderr[-4000:]  # a traceback: not a clean error
    return Outcome(**json.loads(proc.stdout.strip().splitlines()[-1]))


def assert_bounded(out: Outcome, path: Path, error: type[InferflowError], pattern: str) -> None:
    size = path.stat().st_size
    assert out.error == error.__name__, out
    assert re.search(pattern, out.message), out.message
    assert out.seconds <= MAX_SECONDS, f"{out.seconds:.1f} s for {size} bytes: {out.message}"
    assert out.rss <= 2 * size + 300 * MB, f"{out.rss / MB:.0f} MB for {size} bytes"
    print(
        f"{path.name}: {size / MB:.1f} MiB, {out.seconds:.2f} s, +{out.rss / MB:.0f} MiB peak RSS"
    )


# ---- GGUF: overlapping tensor data, data past the end ---------------------------------------


def gguf_file(path: Path, tensors: list[tuple[str, int, int]], data_bytes: int) -> int:
    """A GGUF v3 file of 1-d F32 tensors (name, element count, offset in the data section);
    returns the absolute offset of the data section."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), 0)]
    for name, n, offset in tensors:
        raw = name.encode()
        out.append(struct.pack("<Q", len(raw)) + raw + struct.pack("<IQIQ", 1, n, 0, offset))
    header = b"".join(out)
    data_offset = -(-len(header) // 32) * 32
    path.write_bytes(header.ljust(data_offset, b"\0") + bytes(data_bytes))
    return data_offset


def test_gguf_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    ok = tmp_path / "ok.gguf"
    gguf_file(ok, [("a", 16, 0), ("empty", 0, 64), ("b", 16, 64)], 128)
    assert sorted(GGUFSource(ok).names()) == ["a", "b", "empty"]  # adjacent and empty: fine
    bad = tmp_path / "overlap.gguf"
    base = gguf_file(bad, [("a", 16, 0), ("b", 16, 32)], 128)
    with pytest.raises(CheckpointError) as err:
        GGUFSource(bad)
    want = f"tensors 'a' (bytes [{base}, {base + 64})) and 'b' (bytes [{base + 32}, {base + 96}))"
    assert f"{want} overlap" in str(err.value)


def test_gguf_data_past_the_end_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "past.gguf"
    base = gguf_file(path, [("a", 16, 0), ("far", 1 << 30, 64)], 128)
    with pytest.raises(CheckpointError) as err:
        GGUFSource(path)
    size = path.stat().st_size
    want = f"tensor 'far' (F32, ne=[{1 << 30}]) needs bytes [{base + 64}, {base + 64 + (4 << 30)})"
    assert want in str(err.value) and f"the file has only {size} bytes" in str(err.value)


@pytest.mark.slow
def test_gguf_tensors_sharing_one_range_bomb(tmp_path: Path) -> None:
    # 20000 names over the same 1 MiB would be 20 GB of weights from a 2 MB file
    path = tmp_path / "shared.gguf"
    gguf_file(path, [(f"t{i}", 1 << 18, 0) for i in range(20_000)], 1 << 20)
    out = parse_in_child(
        path, "from inferflow.loaders import open_files", 'open_files("gguf", [path])'
    )
    span = r"\(bytes \[\d+, \d+\)\)"
    assert_bounded(out, path, CheckpointError, rf"tensors 't\d+' {span} and 't\d+' {span} overlap")


# ---- safetensors: headers that expand when parsed -------------------------------------------


def safetensors_file(path: Path, header: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "mb", "item", "refused"),
    [
        ("objects", 99, b"{},", "'{' (objects)"),  # peaked at 2.76 GB before the fix
        ("arrays", 30, b"[],", "'[' (arrays)"),
        ("strings", 30, b'"ab",', "'\"' (string quotes)"),
    ],
    ids=["objects", "arrays", "strings"],
)
def test_safetensors_dense_header_bomb(
    tmp_path: Path, kind: str, mb: int, item: bytes, refused: str
) -> None:
    count = (mb * 1_000_000 - 10) // len(item)  # the header limit is 100 * 10**6 bytes
    header = b'{"x":[' + item * count + item[:-1] + b"]}"
    path = safetensors_file(tmp_path / f"{kind}.safetensors", header)
    out = parse_in_child(
        path, "from inferflow.loaders import open_files", 'open_files("safetensors", [path])'
    )
    pattern = rf"holds \d+ {re.escape(refused)}; at most \d+ allowed"
    assert_bounded(out, path, CheckpointError, pattern)


def test_safetensors_header_limits(tmp_path: Path) -> None:
    entry = b'"x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    dup = b"{" + entry + b"," + entry + b"}"
    with pytest.raises(CheckpointError, match="duplicate key 'x'"):
        open_files("safetensors", [safetensors_file(tmp_path / "dup.safetensors", dup)])
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:  # sparse: the length is refused before anything is read
        f.write(struct.pack("<Q", 100_000_001) + b"{")
        f.truncate(100_000_009 + 8)
    with pytest.raises(CheckpointError, match="length 100000001 exceeds the limit of 100000000"):
        open_files("safetensors", [big])


# ---- specs: YAML size, node count and alias expansion ---------------------------------------


@pytest.mark.slow
def test_spec_of_50_mb_is_refused(tmp_path: Path) -> None:
    # a 50 MB flow list peaked at 5.5 GB and ended in a MemoryError traceback
    path = tmp_path / "flow.yaml"
    path.write_bytes(b"name: x\nfoo: [" + b"a, " * (50 * MB // 3) + b"a]\n")
    out = parse_in_child(path, "from inferflow.spec import load_spec", "load_spec(path)")
    assert_bounded(out, path, SpecError, rf"larger than {MAX_SPEC_BYTES} bytes, the limit")


@pytest.mark.slow
def test_spec_just_under_the_size_limit_is_quick(tmp_path: Path) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_bytes(b"name: x\nfoo: [" + b"a," * ((MAX_SPEC_BYTES - 64) // 2) + b"a]\n")
    assert path.stat().st_size <= MAX_SPEC_BYTES
    out = parse_in_child(path, "from inferflow.spec import load_spec", "load_spec(path)")
    assert_bounded(out, path, SpecError, "more than 100000 values once YAML aliases are expanded")


def billion_laughs(levels: int) -> bytes:
    lines = [b"name: x", b"l0: &l0 [" + b", ".join([b"lol"] * 9) + b"]"]
    for i in range(1, levels):
        lines.append(b"l%d: &l%d [" % (i, i) + b", ".join([b"*l%d" % (i - 1)] * 9) + b"]")
    return b"\n".join(lines) + b"\n"


@pytest.mark.slow
def test_spec_billion_laughs(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_bytes(billion_laughs(12))  # 9**12 values once expanded
    out = parse_in_child(path, "from inferflow.spec import load_spec", "load_spec(path)")
    assert_bounded(out, path, SpecError, "more than 100000 values once YAML aliases are expanded")


def test_spec_alias_limits(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(billion_laughs(5))  # ~75k values once expanded: under the limit, loads
    assert len(read_doc(path)["l4"]) == 9
    path.write_bytes(b"a: &a [1, [*a]]\n")
    with pytest.raises(SpecError, match=r"recursive YAML alias \*a"):
        read_doc(path)
    # 20 levels, then an alias of them 20 levels down: 40 once expanded
    deep = b"a: &d " + b"[" * 20 + b"]" * 20 + b"\nb: " + b"[" * 20 + b"*d" + b"]" * 20 + b"\n"
    path.write_bytes(deep)
    with pytest.raises(SpecError, match=r"YAML nested deeper than 32 levels \(aliases expanded\)"):
        read_doc(path)


# ---- pickles: colliding hashes, object and work counts ---------------------------------------


def long1(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


@pytest.mark.slow
def test_pickle_dict_of_colliding_int_keys(tmp_path: Path) -> None:
    # k * (2**61 - 1) all hash to 0: 200k of them took 16 s to put in a dict
    keys = b"".join(long1(k * HASH_MODULUS) + b"N" for k in range(1, 200_001))
    path = tmp_path / "collide.pkl"
    path.write_bytes(b"\x80\x04}(" + keys + b"u.")
    out = parse_in_child(
        path,
        "from inferflow.loaders.pickle_vm import loads_plain",
        "loads_plain(path.read_bytes())",
    )
    refused = "refused dict key or set item of type int (its hash can be chosen to collide); "
    allowed = f"allowed: str, bytes, int with |n| < {HASH_MODULUS}, bool, None"
    assert_bounded(out, path, CheckpointError, re.escape(refused + allowed))


def test_pickle_hash_unsafe_keys_are_refused() -> None:
    colliding = [long1(k * HASH_MODULUS) for k in range(1, 4)]
    streams = {
        "dict": b"\x80\x02}(" + b"".join(k + b"N" for k in colliding) + b"u.",
        "float key": b"\x80\x02}G@\x00\x00\x00\x00\x00\x00\x00Ns.",
        "tuple key": b"\x80\x02}K\x01K\x02\x86Ns.",
        "set": b"\x80\x04\x8f(" + b"".join(colliding) + b"\x90.",
        "frozenset": b"\x80\x04(" + b"".join(colliding) + b"\x91.",
        "OrderedDict(pairs)": b"\x80\x02ccollections\nOrderedDict\n]("
        + b"".join(k + b"N\x86" for k in colliding)
        + b"e\x85R.",
        "set(list)": b"\x80\x02c__builtin__\nset\n](" + b"".join(colliding) + b"e\x85R.",
    }
    for what, data in streams.items():
        with pytest.raises(CheckpointError, match="refused dict key or set item of type") as err:
            load_one(data, resolve=resolve_global, allowed=describe_allowed)
        assert "allowed: str, bytes, int with" in str(err.value), what
    # what real pickles use still loads: str keys, small ints, negative ints, bool, None, bytes
    keys = ["w", 0, 255, 70000, -(2**40), HASH_MODULUS - 1, True, None, b"k"]
    assert loads_plain(pickle.dumps(dict.fromkeys(keys, 1), protocol=4)) == dict.fromkeys(keys, 1)
    assert loads_plain(pickle.dumps(set(keys[:6]), protocol=4)) == set(keys[:6])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "body", "limit"),
    [
        (
            "lists",
            b"]" + b"]a" * 600_000,
            "built more than 500000 objects (PickleLimits.max_objects)",
        ),
        (
            "ops",
            b"N0" * 1_300_000 + b"N",
            "ran more than 2500000 opcodes (PickleLimits.max_opcodes)",
        ),
    ],
    ids=["lists", "ops"],
)
def test_pickle_work_bombs(tmp_path: Path, kind: str, body: bytes, limit: str) -> None:
    path = tmp_path / f"{kind}.pkl"
    path.write_bytes(b"\x80\x04" + body + b".")
    out = parse_in_child(
        path,
        "from inferflow.loaders.pickle_vm import loads_plain",
        "loads_plain(path.read_bytes())",
    )
    assert_bounded(out, path, CheckpointError, re.escape(limit))


def test_pickle_limits_are_named() -> None:
    cases = [
        (
            b"\x80\x04" + b"X\x03\x00\x00\x00abc" * 10 + b".",
            PickleLimits(max_alloc_bytes=500),
            "built more than 500 bytes of objects (PickleLimits.max_alloc_bytes)",
        ),
        (
            b"\x80\x04](" + b"N" * 50 + b"e.",
            PickleLimits(max_items=40),
            "put more than 40 entries in containers and the memo (PickleLimits.max_items)",
        ),
        (
            b"\x80\x04" + b"]" * 11 + b".",
            PickleLimits(max_objects=10),
            "built more than 10 objects (PickleLimits.max_objects)",
        ),
        (
            b"(N0" * 10 + b"N.",
            PickleLimits(max_opcodes=20),
            "ran more than 20 opcodes (PickleLimits.max_opcodes)",
        ),
        (
            b"Np%d\n." % HASH_MODULUS,
            None,
            f"memo index {HASH_MODULUS} outside 0..{HASH_MODULUS - 1}",
        ),
    ]
    for data, limits, message in cases:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            loads_plain(data, limits)


# ---- package:// references stay inside their package ----------------------------------------


def test_package_reference_cannot_leave_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "bombpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.gguf").write_bytes(b"")
    (pkg / "out").symlink_to(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_ref("package://bombpkg/model.gguf", tmp_path) == (pkg / "model.gguf").resolve()
    assert resolve_ref("package://bombpkg/sub/../model.gguf", tmp_path).name == "model.gguf"
    for rel in ("../../../etc/passwd", "..", "out/x"):  # the last through a link
        ref = f"package://bombpkg/{rel}"
        outside = (
            rf"{re.escape(repr(ref))} resolves to .*, outside the folder .* of package 'bombpkg'"
        )
        with pytest.raises(SpecError, match=rf"source\.files: {outside}"):
            resolve_ref(ref, tmp_path, what="source.files")


# ---- a raw pickle is told as one, and inspect names the global it refuses --------------------

_WRITE_MAIN_PICKLE = """
import pickle, sys
class Model:
    def __init__(self):
        self.weights, self.name = list(range(300)), "a model saved with pickle.dump"
open(sys.argv[1], "wb").write(pickle.dumps(Model(), protocol=int(sys.argv[2])))
"""


def main_pickle(path: Path, protocol: int) -> Path:
    cmd = [sys.executable, "-c", _WRITE_MAIN_PICKLE, str(path), str(protocol)]
    subprocess.run(cmd, check=True, timeout=60)
    assert path.stat().st_size > 256  # past the bytes detect_format reads
    return path


@pytest.mark.slow
def test_inspect_names_the_refused_global_of_a_raw_pickle(tmp_path: Path) -> None:
    path = main_pickle(tmp_path / "model.pkl", 4)
    assert path.read_bytes()[:3] == b"\x80\x04\x95"  # framed: the FRAME spans the whole stream
    proc = subprocess.run(
        [sys.executable, "-m", "inferflow.cli.main", "inspect", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "refused global '__main__.Model'" in proc.stderr, proc.stderr
    assert "cannot tell the checkpoint format" not in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("protocol", "refused"),
    [(0, "copy_reg._reconstructor"), (2, "__main__.Model"), (5, "__main__.Model")],
)
def test_raw_pickles_are_detected(tmp_path: Path, protocol: int, refused: str) -> None:
    path = main_pickle(tmp_path / "model.pkl", protocol)
    # what inspect does; protocol 2 is refused by detection itself, the others by the loader
    with pytest.raises(UnsafePickleError, match=re.escape(f"refused global '{refused}'")):
        open_files(detect_format(path), [path])


def test_text_is_not_taken_for_a_pickle(tmp_path: Path) -> None:
    text = tmp_path / "notes.bin"
    text.write_bytes(b"cat\nnot a pickle\n" * 20)  # 'c' then one line: no GLOBAL opcode
    with pytest.raises(CheckpointError, match="cannot tell the checkpoint format"):
        detect_format(text)


def test_json_files_beside_a_checkpoint_are_size_capped(tmp_path: Path) -> None:
    """config.json, a sharded index and tokenizer_config.json are read only up to 16 MiB (json
    holds several times a file's size while it parses): past it, a clean error naming the
    limit, before anything is parsed."""
    from inferflow.loaders.hf import read_index
    from inferflow.paths import MAX_JSON_BYTES
    from inferflow.spec.hparams import read_hf_config
    from inferflow.tokenizer.files import _read_config

    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"1," * (MAX_JSON_BYTES // 2) + b"1]")
    with pytest.raises(SpecError, match=f"larger than {MAX_JSON_BYTES} bytes"):
        read_hf_config(big)
    with pytest.raises(CheckpointError, match=f"larger than {MAX_JSON_BYTES} bytes"):
        read_index(big)
    with pytest.raises(InferflowError, match=f"larger than {MAX_JSON_BYTES} bytes"):
        _read_config(big)
    small = tmp_path / "config.json"
    small.write_text(json.dumps({"hidden_size": 8}))
    assert read_hf_config(small) == {"hidden_size": 8}
