"""The pickle interpreter: malicious pickles are refused by name, nothing runs, plain data and real
torch pickles round-trip, and hostile or corrupt streams fail as CheckpointError, never otherwise."""

from __future__ import annotations

import io
import pickle
import random
import re
import subprocess
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from malicious import corpus

from inferflow.errors import CheckpointError, UnsafePickleError
from inferflow.loaders import detect_format
from inferflow.loaders.pickle_safe import PickleSource
from inferflow.loaders.pickle_vm import PickleLimits, load_one, loads_plain
from inferflow.loaders.torch_pickle import (
    StorageRef,
    TensorRecord,
    describe_allowed,
    resolve_global,
)


def safe_loads(data: bytes, limits: PickleLimits | None = None) -> Any:
    obj, _ = load_one(data, resolve=resolve_global, allowed=describe_allowed, limits=limits)
    return obj


# ---- the malicious corpus --------------------------------------------------------------------


@pytest.mark.parametrize(("name", "protocol"), corpus.cases())
def test_malicious_pickle_is_refused(tmp_path: Path, name: str, protocol: int) -> None:
    payload = corpus.build_one(name, protocol, tmp_path)
    bare = tmp_path / "payload.pkl"
    bare.write_bytes(payload.data)
    attempts = [
        ("interpreter", lambda: safe_loads(payload.data)),
        ("bare file", lambda: PickleSource([bare])),
        ("zip data.pkl", lambda: PickleSource([corpus.wrap_zip(payload.data, tmp_path / "z.pt")])),
        ("legacy", lambda: PickleSource([corpus.wrap_legacy(payload.data, tmp_path / "l.pt")])),
    ]
    for where, attempt in attempts:
        with pytest.raises(UnsafePickleError) as err:
            attempt()
        assert f"'{payload.refused}'" in str(err.value), where
        assert "refused" in str(err.value), where
    if name in ("subprocess_popen", "os_popen"):
        time.sleep(0.2)  # a Popen that slipped through would need a moment to touch its canary
    assert not list(tmp_path.glob("CANARY*"))


@pytest.mark.skipif(sys.platform == "win32", reason="payloads run `touch`")
def test_corpus_is_live_under_stdlib_pickle(tmp_path: Path) -> None:
    """A test of the CORPUS, not of our loader: stdlib pickle really executes these payloads.

    Without it, a typo in a payload would make the refusal tests above pass vacuously.
    """
    live = [(n, p) for i, (n, p) in enumerate(corpus.cases()) if p == i % 6]
    live = [(n, p) for n, p in live if next(s for s in corpus.SPECS if s[0] == n)[2]]
    assert len({n for n, _ in live}) >= 8
    for name, protocol in live:
        payload = corpus.build_one(name, protocol, tmp_path)
        path = tmp_path / f"{name}.pkl"
        path.write_bytes(payload.data)
        subprocess.run(
            [sys.executable, "-c", "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())", str(path)],
            cwd=tmp_path, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        deadline = time.monotonic() + 5  # subprocess.Popen returns before its child runs
        while not payload.canary.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert payload.canary.exists(), f"{name} (protocol {protocol}) did not run under pickle"


# ---- targeted refusals -----------------------------------------------------------------------


def test_refused_opcodes_and_calls() -> None:
    od = b"\x80\x02ccollections\nOrderedDict\n)R"
    cases = {
        od + b")R.": "refused REDUCE",  # calling the result of an allowed call
        b"\x80\x02(ccollections\nOrderedDict\no.": "refused opcode OBJ",
        b"(icollections\nOrderedDict\n.": "refused opcode INST",
        b"\x80\x02\x82\x01.": "refused opcode EXT1",
        b"\x80\x05\x97.": "refused opcode NEXT_BUFFER",
        b"\x80\x02]}b.": "refused BUILD",  # BUILD on a list
        od + b"}X\x0c\x00\x00\x00__setstate__Ns.": "",  # a dunder key in plain data is fine
        od + b"}X\x0c\x00\x00\x00__setstate__Nsb.": "state key '__setstate__'",
        b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x05\x00\x00\x00rot13\x86R.": "only (str, 'latin1')",
        b"\x80\x02ctorch\nFloatStorage\n)R.": "refused REDUCE",  # storage types are tags only
        b"\x80\x02ctorch.storage\n_load_from_bytes\n.": "'torch.storage._load_from_bytes'",
        b"\x80\x02ctorch\nload\n.": "'torch.load'",
        b"\x80\x02ctorch._utils\n_rebuild_qtensor\n.": "'torch._utils._rebuild_qtensor'",
        b"\x80\x02ctorch\n_C\n.": "'torch._C'",
        b"\x80\x02X\x01\x00\x00\x00xQ.": "persistent id",
    }
    for data, message in cases.items():
        if not message:
            safe_loads(data)
            continue
        with pytest.raises(UnsafePickleError, match=re.escape(message)):
            safe_loads(data)


def test_refusal_names_global_offset_and_allow_list() -> None:
    with pytest.raises(UnsafePickleError) as err:
        safe_loads(b"\x80\x02}cos\nsystem\n.")
    msg = str(err.value)
    assert msg.startswith("refused global 'os.system' (GLOBAL) at byte offset 3; allowed: ")
    assert "torch._utils._rebuild_tensor_v2" in msg and "collections.OrderedDict" in msg
    with pytest.raises(UnsafePickleError, match=r"'collections.OrderedDict' \(STACK_GLOBAL\)"):
        loads_plain(pickle.dumps(OrderedDict(a=1), protocol=4))


def test_detect_format_reports_an_unsafe_pickle(tmp_path: Path) -> None:
    payload = corpus.build_one("os_system", 2, tmp_path)
    (tmp_path / "evil.pt").write_bytes(payload.data)
    with pytest.raises(UnsafePickleError, match=r"evil\.pt: refused global 'os.system'"):
        detect_format(tmp_path / "evil.pt")
    assert not payload.canary.exists()


# ---- what must load --------------------------------------------------------------------------

PLAIN: list[Any] = [
    0, 1, -1, 255, 65535, -(2**31), 2**31, 2**64, -(2**300), 3.5, -0.0, float("inf"),
    "", "héllo\n\\'\"\x00\u20ac\U0001f600", "x" * 300, b"", b"\x00\xff" * 200, bytearray(b"ab\xfe"),
    None, True, False, (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [], [1, [2, [3]]],
    {"a": {"b": (1, 2)}, 1: 2.5}, {1, 2}, frozenset({3}), set(), frozenset(),
    OrderedDict(a=1, b=[2]), list(range(3000)), {i: str(i) for i in range(1500)},
]  # fmt: skip


@pytest.mark.parametrize("protocol", range(6))
def test_plain_values_match_stdlib(protocol: int) -> None:
    # pickle.dumps is only used to *write* the reference streams
    for value in PLAIN:
        got = safe_loads(pickle.dumps(value, protocol=protocol))
        assert got == value and type(got) is type(value), (protocol, repr(value)[:40])
    shared = [1]
    got = safe_loads(pickle.dumps([shared, shared, (shared,)], protocol=protocol))
    assert got[0] is got[1] is got[2][0]


def test_protocol0_text_opcodes() -> None:
    # STRING (Python 2 repr), INT booleans, LONG with its L, FLOAT, PUT/GET, DICT, LIST, TUPLE
    data = b"(dp0\nS'a\\n\\'b'\np1\nI01\nsS'n'\nL12345678901234567890L\nsS'f'\nF1.5\nsS'l'\n(lp2\ng1\naI-3\nasS't'\n(I00\ntp3\ns."
    assert safe_loads(data) == {"a\n'b": True, "n": 12345678901234567890, "f": 1.5, "l": ["a\n'b", -3], "t": (False,)}  # fmt: skip


# ---- hostile and corrupt streams -------------------------------------------------------------


def torch_pickle_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save(
        {"w": torch.ones(2, 3), "b": torch.zeros(3).half(), "p": torch.nn.Parameter(torch.ones(1))},
        buf,
    )
    with zipfile.ZipFile(buf) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


def test_every_truncation_is_a_checkpoint_error() -> None:
    data = torch_pickle_bytes()
    for cut in range(len(data)):
        with pytest.raises(CheckpointError):
            load_one(data[:cut], resolve=resolve_global, allowed=describe_allowed, persistent_load=lambda pid: pid)  # fmt: skip


def test_fuzzed_streams_raise_only_checkpoint_errors() -> None:
    rng = random.Random(1234)
    seeds = [torch_pickle_bytes()] + [
        pickle.dumps(v, protocol=p) for v in PLAIN[:20] for p in (0, 2, 4)
    ]
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            if not data:
                break
            i = rng.randrange(len(data))
            choice = rng.random()
            if choice < 0.6:
                data[i] = rng.randrange(256)
            elif choice < 0.8:
                del data[i]
            else:
                data.insert(i, rng.randrange(256))
        try:
            load_one(bytes(data), resolve=resolve_global, allowed=describe_allowed, persistent_load=lambda pid: pid)  # fmt: skip
        except CheckpointError:
            pass


def test_limits_bound_hostile_streams() -> None:
    # a million-deep tuple would segfault CPython's hash(); refused long before
    deep = b"\x80\x02)" + b"\x85" * 100_000 + b"\x85}\x94(N\x88u."
    with pytest.raises(CheckpointError, match="tuples nested deeper than 1000"):
        safe_loads(deep)
    with pytest.raises(CheckpointError, match=r"truncated: needs 4294967295 bytes"):
        safe_loads(b"\x80\x04X\xff\xff\xff\xff.")
    with pytest.raises(CheckpointError, match=r"FRAME of 18446744073709551615 bytes"):
        safe_loads(b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xffN.")
    with pytest.raises(CheckpointError, match="integer of 1048576 bytes exceeds"):
        safe_loads(b"\x80\x02\x8b\x00\x00\x10\x00" + b"\x01" * (1 << 20) + b".")
    with pytest.raises(CheckpointError, match="MARKs nested deeper than 10"):
        safe_loads(b"(" * 11 + b".", PickleLimits(max_marks=10))
    with pytest.raises(CheckpointError, match="stack grew past 100"):
        safe_loads(b"\x80\x02" + b"N" * 101 + b".", PickleLimits(max_stack=100))
    with pytest.raises(CheckpointError, match="memo grew past 2"):
        safe_loads(b"\x80\x04N\x94\x94\x94.", PickleLimits(max_memo=2))
    with pytest.raises(CheckpointError, match="line longer than 64"):
        safe_loads(b"I" + b"1" * 100 + b"\n.", PickleLimits(max_line=64))
    with pytest.raises(CheckpointError, match="memo index 7 was never stored"):
        safe_loads(b"\x80\x02h\x07.")
    with pytest.raises(CheckpointError, match="stack underflow"):
        safe_loads(b"\x80\x02R.")
    with pytest.raises(CheckpointError, match="unknown opcode byte 0xff"):
        safe_loads(b"\x80\x02\xff.")
    with pytest.raises(CheckpointError, match="unsupported pickle protocol 9"):
        safe_loads(b"\x80\x09N.")
    with pytest.raises(CheckpointError, match="without STOP"):
        safe_loads(b"\x80\x02N")
    with pytest.raises(CheckpointError, match="unhashable"):
        safe_loads(b"\x80\x02}(]Nu.")  # a list as a dict key


def test_tensor_records_must_fit_their_storage() -> None:
    storage = StorageRef("0", torch.float32, "cuda:0", 48)  # 12 floats
    TensorRecord(storage, 0, (3, 4), (4, 1), torch.float32).check("fits")
    TensorRecord(storage, 11, (5, 7), (0, 0), torch.float32).check("broadcast")
    cases = [
        (TensorRecord(storage, 1, (3, 4), (4, 1), torch.float32), "needs 52 bytes"),
        (TensorRecord(storage, 0, (4, 3), (1, 5), torch.float32), "needs 56 bytes"),
        (TensorRecord(storage, 0, (2,), (1,), torch.float64), ""),  # 16 of 48 bytes: fine
        (TensorRecord(storage, 0, (1 << 40, 1 << 40), (0, 0), torch.float32), "too large"),
        (TensorRecord(storage, 0, (2,), (-1,), torch.float32), "negative"),
    ]
    for rec, message in cases:
        if not message:
            rec.check("ok")
            continue
        with pytest.raises(CheckpointError, match=message):
            rec.check("t")
