"""Checkpoint loaders against torch itself: what torch.save / safetensors / save_pretrained wrote
must come back bit-identical (dtype, shape, values), and broken files must fail with a
CheckpointError that says what is wrong."""

from __future__ import annotations

import gc
import json
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from inferflow.errors import CheckpointError
from inferflow.loaders import LOADERS, detect_format, open_files
from inferflow.loaders.hf import find_checkpoint_files
from inferflow.loaders.pickle_safe import PickleSource, _Checkpoint, open_checkpoint
from inferflow.loaders.safetensors import SafetensorsSource
from inferflow.registry import RegistryError
from tests.conftest import needs_proc, rss


def reference_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    shared = torch.arange(40, dtype=torch.float32)
    emb = torch.randn(10, 4, generator=g)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(4, 3, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.arange(-5, 5),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "conj": torch.randn(2, dtype=torch.complex64, generator=g).conj(),
        "transposed": base.t(),
        "strided": base[:, ::3],
        "offset_view": shared[5:17].view(3, 4),  # views into one storage at two offsets
        "offset_view2": shared[30:],
        "expanded": torch.randn(3, 1, generator=g).expand(3, 4),  # stride 0
        "scalar": torch.tensor(3.25),
        "scalar_i64": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied
        "param": torch.nn.Parameter(torch.randn(2, 3, generator=g)),
        # no legacy storage class: torch.save emits _rebuild_tensor_v3 + UntypedStorage
        "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "u16": torch.arange(4).to(torch.uint16),
    }


def assert_same(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    assert got.dtype == want.dtype, name
    assert got.shape == want.shape, name
    assert got.device.type == "cpu", name

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)

    assert torch.equal(bits(got), bits(want)), name
    if (
        not (want.dtype.is_floating_point and want.dtype.itemsize == 1)
        and want.dtype != torch.uint16
    ):
        assert torch.equal(got, want.detach()), name


def save(obj: object, path: Path, container: str) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=(container == "zip"))
    return path


def rewrite_zip(
    src: Path, dst: Path, change: Callable[[str, bytes], bytes | None], compression: int = 0
) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            new = change(info.filename, data)
            zout.writestr(info.filename, data if new is None else new)
    return dst


def pickle_of(data: bytes, name: str) -> bytes | None:
    return data if name.endswith("/data.pkl") else None


# ---- torch.save checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_pickle_matches_torch(tmp_path: Path, container: str) -> None:
    ref = reference_state()
    path = save(ref, tmp_path / "sd.pt", container)
    assert detect_format(path) == "pickle"
    with open_files("pickle", [path]) as src:
        assert src.names() == list(ref)
        assert src.metadata["container"] == container
        for name, tensor in src:
            assert_same(tensor, ref[name], name)
            assert src.shape(name) == tuple(ref[name].shape)
        assert src.dtype_name("bf16") == "BF16" and src.dtype_name("f8") == "F8_E4M3"
        # tied weights come back sharing memory, like torch.load gives them
        assert src.get("embed.weight").data_ptr() == src.get("lm_head.weight").data_ptr()


def test_pickle_state_dict_of_module(tmp_path: Path) -> None:
    # state_dict() is an OrderedDict carrying _metadata: pickled with a BUILD
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    sd = model.state_dict()
    src = PickleSource([save(sd, tmp_path / "m.pt", "zip")])
    for name, tensor in src:
        assert_same(tensor, sd[name], name)


def test_pickle_names_read_no_tensor_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = _Checkpoint.storage_bytes

    def counting(self: _Checkpoint, ref: object) -> torch.Tensor:
        calls.append(ref.key)  # type: ignore[attr-defined]
        return real(self, ref)  # type: ignore[arg-type]

    path = save(reference_state(), tmp_path / "sd.pt", "zip")
    for cls in _Checkpoint.__subclasses__():
        monkeypatch.setattr(cls, "storage_bytes", counting)
    src = PickleSource([path])
    assert len(src.names()) == len(reference_state())
    assert src.shape("f32") == (3, 5) and src.dtype_name("i64") == "I64"
    assert calls == []
    src.get("f32")
    assert len(calls) == 1


@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_pickle_tensors_outlive_close(tmp_path: Path, container: str) -> None:
    ref = reference_state()
    src = PickleSource([save(ref, tmp_path / "sd.pt", container)])
    kept = {name: src.get(name) for name in ("f32", "offset_view", "lm_head.weight")}
    src.close()
    with pytest.raises(CheckpointError, match="closed"):
        src.get("f32")
    del src
    gc.collect()
    for name, tensor in kept.items():  # still mapped: closing must not unmap live tensors
        assert_same(tensor, ref[name], name)


@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_pickle_nested_state_dict(tmp_path: Path, container: str) -> None:
    ref = {"w": torch.ones(2), "b": torch.zeros(3)}
    src = PickleSource([save({"model": ref, "epoch": 3, "lr": 0.1}, tmp_path / "c.pt", container)])
    assert src.metadata["state_dict_key"] == "model"
    assert_same(src.get("w"), ref["w"])
    with pytest.raises(CheckpointError, match=r"top-level keys: 'a', 'b'"):
        PickleSource([save({"a": ref, "b": ref}, tmp_path / "two.pt", container)])
    with pytest.raises(CheckpointError, match="holds a list"):
        PickleSource([save([torch.ones(1)], tmp_path / "list.pt", container)])


def test_pickle_shards_merge_and_refuse_duplicates(tmp_path: Path) -> None:
    a = save({"x": torch.ones(2)}, tmp_path / "a.pt", "zip")
    b = save({"y": torch.zeros(2)}, tmp_path / "b.pt", "legacy")
    src = open_files("pickle", [a, b])
    assert src.names() == ["x", "y"]
    assert_same(src.get("y"), torch.zeros(2))
    c = save({"x": torch.ones(3)}, tmp_path / "c.pt", "zip")
    with pytest.raises(CheckpointError, match=r"'x' appears in both .*a\.pt and .*c\.pt"):
        open_files("pickle", [a, c])


@pytest.mark.parametrize("location", ["cuda:0", "mps", "meta"])
def test_pickle_loads_any_device_on_cpu(tmp_path: Path, location: str) -> None:
    ref = reference_state()
    path = save(ref, tmp_path / "sd.pt", "zip")
    cpu = b"X\x03\x00\x00\x00cpu"
    moved = b"X" + struct.pack("<I", len(location)) + location.encode()

    def patch(name: str, data: bytes) -> bytes | None:
        if not name.endswith("data.pkl"):
            return None
        assert cpu in data
        return data.replace(cpu, moved)

    # the rewritten archive also loses torch's 64-byte data alignment: loads must not care
    src = PickleSource([rewrite_zip(path, tmp_path / "moved.pt", patch)])
    for name, tensor in src:
        assert_same(tensor, ref[name], name)

    legacy = save(ref, tmp_path / "legacy.pt", "legacy").read_bytes()
    (tmp_path / "legacy_moved.pt").write_bytes(legacy.replace(cpu, moved))
    for name, tensor in PickleSource([tmp_path / "legacy_moved.pt"]):
        assert_same(tensor, ref[name], name)


def test_pickle_big_endian_zip(tmp_path: Path) -> None:
    ref = {
        k: v for k, v in reference_state().items() if k not in ("lm_head.weight", "offset_view2")
    }
    path = save(ref, tmp_path / "le.pt", "zip")
    ck = open_checkpoint(path)
    # swapped per tensor dtype, also over the untyped (byte) storages of float8/uint16 tensors,
    # where torch.load itself would swap nothing (it swaps by the storage's uint8 dtype)
    dtypes = {rec.storage.key: rec.dtype for rec in ck.tensors.values()}
    ck.close()

    def to_big(name: str, data: bytes) -> bytes | None:
        if name.endswith("/byteorder"):
            return b"big"
        if "/data/" not in name:
            return None
        dt = dtypes[name.rsplit("/", 1)[1]]
        unit = dt.itemsize // 2 if dt.is_complex else dt.itemsize
        return np.frombuffer(data, np.uint8).reshape(-1, unit)[:, ::-1].tobytes()

    src = PickleSource([rewrite_zip(path, tmp_path / "be.pt", to_big)])
    for name, tensor in src:
        assert_same(tensor, ref[name], name)


def test_pickle_deflated_zip(tmp_path: Path) -> None:
    ref = reference_state()
    path = save(ref, tmp_path / "sd.pt", "zip")
    src = PickleSource(
        [rewrite_zip(path, tmp_path / "z.pt", lambda n, d: None, zipfile.ZIP_DEFLATED)]
    )
    for name, tensor in src:
        assert_same(tensor, ref[name], name)


@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_pickle_truncated(tmp_path: Path, container: str, fraction: float) -> None:
    data = save(reference_state(), tmp_path / "sd.pt", container).read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointError, match="truncated|malformed|empty file|lie past the end"):
        PickleSource([cut])


def test_pickle_truncated_last_byte(tmp_path: Path) -> None:
    data = save(reference_state(), tmp_path / "sd.pt", "legacy").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:-1])
    # the cut lands in the last storage's data, or in its count when that storage is empty
    # (legacy keys are memory addresses, so which storage comes last varies from run to run)
    with pytest.raises(CheckpointError, match=r"truncated(: storage '\d+' ends at byte| before storage)"):  # fmt: skip
        PickleSource([tmp_path / "cut.pt"])


def test_pickle_wrong_magic_and_garbage(tmp_path: Path) -> None:
    data = bytearray(save({"x": torch.ones(2)}, tmp_path / "sd.pt", "legacy").read_bytes())
    data[5] ^= 0xFF  # inside the LONG1 magic number
    (tmp_path / "magic.pt").write_bytes(data)
    with pytest.raises(CheckpointError, match="wrong magic number"):
        PickleSource([tmp_path / "magic.pt"])
    (tmp_path / "garbage.pt").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match="malformed pickle|unknown opcode"):
        PickleSource([tmp_path / "garbage.pt"])
    with pytest.raises(CheckpointError, match="cannot tell the checkpoint format of .*garbage"):
        detect_format(tmp_path / "garbage.pt")


def test_zip_structure_is_validated(tmp_path: Path) -> None:
    path = save({"x": torch.arange(12.0).reshape(3, 4)}, tmp_path / "sd.pt", "zip")

    def variant(name: str, entries: list[tuple[str, bytes]]) -> Path:
        out = tmp_path / name
        with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w") as zout:
            for info in zin.infolist():
                zout.writestr(info.filename, zin.read(info))
            for entry, data in entries:
                zout.writestr(entry, data)
        return out

    no_pickle = tmp_path / "np.pt"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(no_pickle, "w") as zout:
        for info in zin.infolist():
            if not info.filename.endswith("data.pkl"):
                zout.writestr(info.filename, zin.read(info))
    with pytest.raises(CheckpointError, match=r"exactly one '<prefix>/data.pkl' entry, found 0"):
        PickleSource([no_pickle])
    with pytest.raises(CheckpointError, match="unsafe entry name '../evil'"):
        PickleSource([variant("trav.pt", [("../evil", b"x")])])
    with pytest.warns(UserWarning, match="Duplicate name"):
        dup = variant("dup.pt", [("sd/byteorder", b"little")])
    with pytest.raises(CheckpointError, match="duplicate entry 'sd/byteorder'"):
        PickleSource([dup])
    short = rewrite_zip(path, tmp_path / "short.pt", lambda n, d: d[:8] if "/data/" in n else None)
    with pytest.raises(CheckpointError, match=r"storage '0' needs 48 bytes, its entry holds 8"):
        PickleSource([short])
    # the storage claims 2 elements; the (3, 4) tensor over it would read past its end
    small = rewrite_zip(path, tmp_path / "small.pt", lambda n, d: d.replace(b"K\x0ct", b"K\x02t") if n.endswith(".pkl") else None)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"tensor 'x' of shape \[3, 4\] needs 48 bytes"):
        PickleSource([small])
    # bytes cut from the middle: the central directory survives but points past the data
    whole = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[:700] + whole[750:])
    with pytest.raises(CheckpointError, match="out-of-file entry"):
        PickleSource([tmp_path / "cut.pt"])
    gone = tmp_path / "gone.pt"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(gone, "w") as zout:
        for info in zin.infolist():
            if "/data/" not in info.filename:
                zout.writestr(info.filename, zin.read(info))
    with pytest.raises(CheckpointError, match="storage '0' has no data/0 entry"):
        PickleSource([gone])


# ---- safetensors -------------------------------------------------------------------------------

ST_NAMES = ("f32", "f16", "bf16", "f64", "i64", "i32", "i8", "u8", "bool", "scalar", "empty", "f8")


def st_state() -> dict[str, torch.Tensor]:
    ref = reference_state()
    return {k: ref[k].contiguous() for k in ST_NAMES} | {"strided": ref["strided"].contiguous()}


def test_safetensors_matches(tmp_path: Path) -> None:
    ref = st_state()
    save_file(ref, tmp_path / "m.safetensors", metadata={"format": "pt", "note": "x"})
    assert detect_format(tmp_path / "m.safetensors") == "safetensors"
    with open_files("safetensors", [tmp_path / "m.safetensors"]) as src:
        assert src.metadata == {"format": "pt", "note": "x"}
        assert sorted(src.names()) == sorted(ref)
        for name, tensor in src:
            assert_same(tensor, ref[name], name)
            assert src.shape(name) == tuple(ref[name].shape)
        assert src.dtype_name("bf16") == "BF16"


def st_file(tmp_path: Path, header: object, data: bytes = b"", raw: bytes | None = None) -> Path:
    head = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path / f"bad{len(list(tmp_path.glob('bad*')))}.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


def test_safetensors_bad_files(tmp_path: Path) -> None:
    save_file(st_state(), tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    for cut in (0, 4, 8, 20, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|shorter than|not valid JSON"):
            SafetensorsSource([tmp_path / "cut.safetensors"])
    cases: list[tuple[Path, str]] = [
        (st_file(tmp_path, None, raw=b"{not json"), "not valid JSON"),
        (st_file(tmp_path, [1, 2]), "JSON list, not an object"),
        (st_file(tmp_path, None, raw=b'{"a": {}, "a": {}}'), "duplicate key 'a'"),
        (st_file(tmp_path, {"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "unknown dtype 'Q9'"),
        (st_file(tmp_path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "needs 8 bytes"),
        (st_file(tmp_path, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "expected 0"),
        (st_file(tmp_path, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 9), "cover 4 bytes of data, the file holds 9"),
        (st_file(tmp_path, {"__metadata__": {"k": 1}}), "__metadata__ must map strings"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(CheckpointError, match=message):
            SafetensorsSource([path])
        path.unlink()
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match=r"header length 1099511627776 exceeds the 2 bytes"):
        SafetensorsSource([tmp_path / "huge.safetensors"])


# ---- Hugging Face directories --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def check_hf_dir(directory: Path, model: torch.nn.Module, fmt: str, n_files: int) -> None:
    assert detect_format(directory) == "hf"
    found_fmt, files = find_checkpoint_files(directory)
    assert (found_fmt, len(files)) == (fmt, n_files)
    sd = model.state_dict()
    with open_files("hf", [directory]) as src:
        assert src.metadata["config"]["hidden_size"] == 16
        assert src.metadata["checkpoint_format"] == fmt
        names = src.names()
        assert names and set(names) <= set(sd)
        for name, tensor in src:
            assert_same(tensor, sd[name].detach(), name)


def test_hf_directories(tmp_path: Path, tiny_llama: torch.nn.Module) -> None:
    tiny_llama.save_pretrained(tmp_path / "st")
    check_hf_dir(tmp_path / "st", tiny_llama, "safetensors", 1)
    tiny_llama.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    n_shards = len(list((tmp_path / "sharded").glob("*.safetensors")))
    assert n_shards > 1
    check_hf_dir(tmp_path / "sharded", tiny_llama, "safetensors", n_shards)

    sd = tiny_llama.state_dict()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    check_hf_dir(tmp_path / "bin", tiny_llama, "pickle", 1)

    # a sharded .bin checkpoint with its index, the legacy way transformers wrote them
    shards = tmp_path / "binsharded"
    shards.mkdir()
    (shards / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    names = list(sd)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: sd[n] for n in part}, shards / fname)
        weight_map |= dict.fromkeys(part, fname)
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    check_hf_dir(shards, tiny_llama, "pickle", 2)

    weight_map["ghost.weight"] = "pytorch_model-00001-of-00002.bin"
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"listed but absent \['ghost.weight'\]"):
        open_files("hf", [shards])
    weight_map["ghost.weight"] = "../elsewhere.bin"
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="'../elsewhere.bin' is not a plain file name"):
        find_checkpoint_files(shards)
    with pytest.raises(CheckpointError, match="no weights found; looked for model.safetensors"):
        find_checkpoint_files(tmp_path)


# ---- format detection and opening ------------------------------------------------------------


def test_detect_format(tmp_path: Path) -> None:
    assert detect_format(save({"x": torch.ones(1)}, tmp_path / "z.pt", "zip")) == "pickle"
    assert detect_format(save({"x": torch.ones(1)}, tmp_path / "l.pt", "legacy")) == "pickle"
    save_file({"x": torch.ones(1)}, tmp_path / "s.safetensors")
    assert detect_format(tmp_path / "s.safetensors") == "safetensors"
    # the smallest GGUF: magic, version 3, no tensors, no metadata
    (tmp_path / "g.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    assert detect_format(tmp_path / "g.gguf") == "gguf"
    assert detect_format(tmp_path) == "hf"
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("readme.txt", "hi")
    with pytest.raises(CheckpointError, match=r"other\.zip: zip archive without"):
        detect_format(tmp_path / "other.zip")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match=r"empty\.bin.*supported: gguf, hf, inferflow_quant, pickle, safetensors",
    ):
        detect_format(tmp_path / "empty.bin")
    with pytest.raises(CheckpointError, match="checkpoint not found: .*nope"):
        detect_format(tmp_path / "nope")


def test_open_files_errors(tmp_path: Path) -> None:
    with pytest.raises(
        RegistryError,
        match="unknown checkpoint format 'onnx'; known: gguf, hf, inferflow_quant, pickle, safetensors",
    ):
        open_files("onnx", [tmp_path / "x"])
    with pytest.raises(CheckpointError, match=r"checkpoint file not found: .*missing\.pt"):
        open_files("pickle", [tmp_path / "missing.pt"])
    assert set(LOADERS.names()) >= {"gguf", "hf", "pickle", "safetensors"}


@needs_proc
def test_safetensors_tensors_are_views_their_pages_released(tmp_path: Path) -> None:
    """A tensor is a view of the file's mapping (its values are the file's, written by the
    safetensors package); once read, ``release`` takes its pages out of this process's
    resident memory, and a write into a tensor stays in the process (a private mapping)."""
    big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    small = torch.randn(3, 5, dtype=torch.bfloat16)
    save_file({"big": big, "small": small, "empty": torch.zeros(0, 4)}, tmp_path / "m.safetensors")
    src = SafetensorsSource([tmp_path / "m.safetensors"])
    assert torch.equal(src.get("small"), small) and src.get("empty").shape == (0, 4)
    before = rss()
    t = src.get("big")
    assert torch.equal(t, big)  # (reads every page)
    assert rss() - before > (48 << 20)
    del t
    src.release("big")
    assert rss() - before < (16 << 20)
    w = src.get("small")
    w += 1  # copy-on-write: the file is unchanged
    assert torch.equal(SafetensorsSource([tmp_path / "m.safetensors"]).get("small"), small)
