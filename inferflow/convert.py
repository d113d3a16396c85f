"""Checkpoint conversion and quantization: the library behind ``inferflow convert`` / ``quantize``.

Every output is written to a temporary file next to the destination and renamed over it only
when complete (``os.replace`` is atomic within a directory), so an interrupted or failed run never
leaves a half-written checkpoint and never damages an existing one. Tensors are read lazily and
written one at a time (GGUF, safetensors); only pickle output holds them all, as ``torch.save``
needs one object.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from tqdm import tqdm

from inferflow.errors import CheckpointError, QuantError
from inferflow.loaders import detect_format, open_files
from inferflow.loaders.base import Weight, WeightSource
from inferflow.loaders.gguf_writer import GGUFTensorPlan, TypePath, write_gguf
from inferflow.loaders.quantized import (
    StoredTensor,
    packed_shape,
    write_safetensors,
)
from inferflow.loaders.safetensors import DTYPE_BITS
from inferflow.quant import quantize
from inferflow.quant.formats import FORMATS, QuantFormat
from inferflow.quant.targets import is_float, is_quant
from inferflow.quant.tensor import QuantTensor

logger = logging.getLogger(__name__)

OUTPUT_FORMATS = ("gguf", "safetensors", "pickle")
GGUF_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1")
GGUF_TYPES += ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")
FLOAT_TYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
KEEP_FLOAT = ("none", "float")  # quantize FMT values that leave a tensor unquantized
QUANTIZE_ROW_BYTES = 64 << 20  # float32 rows of a quantized source requantized at a time
# llama.cpp ``enum llama_ftype`` (llama.h) for the types we write
LLAMA_FTYPE = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K": 11,  # MOSTLY_Q3_K_S
    "Q4_K": 14,  # MOSTLY_Q4_K_S: what a file of Q4_K matrices is to llama.cpp
    "Q5_K": 16,  # MOSTLY_Q5_K_S
    "Q6_K": 18,
    "BF16": 32,
}
_SUFFIX_FORMAT = {".gguf": "gguf", ".safetensors": "safetensors", ".bin": "pickle", ".pt": "pickle"}
_SUFFIX_FORMAT |= {".pth": "pickle", ".ckpt": "pickle"}
# dtypes GGUF lacks, widened losslessly (F8 floats go to F32 the same way)
_GGUF_WIDEN = {"BOOL": "I8", "U8": "I16", "U16": "I32", "U32": "I64"}
_TORCH_INT = {"I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
_PLAIN_GGUF = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


# --- shared helpers ----------------------------------------------------------------------------


@contextmanager
def atomic_output(out: str | Path, force: bool = False) -> Iterator[BinaryIO]:
    """A file object for ``out`` that only replaces it once the ``with`` body completes.

    Refuses an existing ``out`` without ``force``. On any exception, KeyboardInterrupt included,
    the temporary file is removed and ``out`` is left as it was.
    """
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"output {out} is a directory; give a file path")
    if out.exists() and not force:
        raise CheckpointError(f"output {out} already exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise CheckpointError(f"output directory {out.parent} does not exist")
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:  # "x": never clobber; normal umask permissions
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_source(path: str | Path) -> tuple[str, WeightSource]:
    """(detected format, lazily opened source) of any checkpoint ``detect_format`` knows."""
    fmt = detect_format(path)
    return fmt, open_files(fmt, [path])


def gguf_view(fmt: str, path: Path, source: WeightSource) -> tuple[str, WeightSource]:
    """``source`` as a GGUF source: an HF model directory under llama.cpp's names and keys (it
    is closed if that fails); other sources as they are."""
    if fmt != "hf":
        return fmt, source
    from inferflow.hf_gguf import HFAsGGUF

    try:
        return "gguf", HFAsGGUF(path, source)
    except BaseException:
        source.close()
        raise


def weight_progress(source: WeightSource, desc: str, enabled: bool) -> tqdm[Any]:
    """A bar over the weights of ``source`` (``update(weights)`` per tensor): counted in weights,
    not tensors, its ETA holds when tensor sizes differ 1000x."""
    total = sum(math.prod(source.shape(n)) for n in source.names())
    return tqdm(
        total=total, desc=desc, unit="weight", unit_scale=True, file=sys.stderr,
        disable=not enabled,
    )  # fmt: skip


def as_float(w: Weight) -> torch.Tensor:
    """A dense float tensor: packed data dequantized to float32, plain data as stored."""
    return w.dequantize(torch.float32) if isinstance(w, QuantTensor) else w


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` with storage of its own, so torch.save does not write a whole mmap it views."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.contiguous().clone()
    return t


def quantize_rows(
    w: Weight, fmt: QuantFormat, method: str = "minmax", importance: torch.Tensor | None = None
) -> torch.Tensor:
    """Raw ``fmt`` blocks of ``w``, shaped (rows, bytes_per_row); same-format data is copied as
    is. ``method`` and ``importance``: as ``inferflow.quant.quantize``."""
    shape = tuple(w.shape)
    rows, per_row = packed_shape(fmt, shape) if shape else (1, -1)
    if isinstance(w, QuantTensor) and w.format == fmt.name:
        return w.data.reshape(rows, per_row)  # lossless: no dequantize/requantize round
    if fmt.quantize_blocks is None:
        raise QuantError(f"{fmt.name} has no quantizer (Inferflow can read it, not write it)")
    if not (isinstance(w, QuantTensor) and len(shape) == 2):
        return quantize(as_float(w), fmt, method, importance).data.reshape(rows, per_row)
    # a quantized matrix is dequantized a chunk of rows at a time (blocks are independent, so
    # the bytes are the same): a 151,936-row table never exists whole in float32
    out = torch.empty(rows, per_row, dtype=torch.uint8)
    step = max(1, QUANTIZE_ROW_BYTES // (4 * shape[1]))
    for r in range(0, rows, step):
        part = w.rows(r, min(rows, r + step))
        out[r : r + part.shape[0]] = quantize(as_float(part), fmt, method, importance).data
    return out


def _writable_quant_formats() -> list[str]:
    return [n for n, f in FORMATS.items() if f.block_size > 1 and f.quantize_blocks is not None]


def parse_quant_format(name: str) -> QuantFormat | None:
    """A ``--format``/``--per-tensor`` value: a writable packed format, or None for none/float."""
    if name.lower() in KEEP_FLOAT:
        return None
    allowed = _writable_quant_formats()
    if name.upper() not in allowed:
        raise QuantError(
            f"unknown quant format {name!r}; allowed: {', '.join([*KEEP_FLOAT, *allowed])}"
        )
    return FORMATS.get(name.upper())


def parse_per_tensor(items: Sequence[str]) -> list[tuple[str, QuantFormat | None]]:
    """``PATTERN=FMT`` strings to (fnmatch pattern, format) rules; the first match wins."""
    rules = []
    for item in items:
        pattern, sep, fmt = item.rpartition("=")
        if not sep or not pattern or not fmt:
            raise QuantError(f"--per-tensor {item!r}: expected PATTERN=FMT, e.g. '*.ffn_*=Q4_0'")
        rules.append((pattern, parse_quant_format(fmt)))
    return rules


def _kept_dtype(dtype: str) -> str:
    return "F32" if is_quant(dtype) or dtype not in DTYPE_BITS else dtype


# --- convert --------------------------------------------------------------------------------


def output_format(out: str | Path, to: str | None) -> str:
    if to is not None:
        if to not in OUTPUT_FORMATS:
            raise CheckpointError(
                f"unknown output format {to!r}; allowed: {', '.join(OUTPUT_FORMATS)}"
            )
        return to
    suffix = Path(out).suffix.lower()
    if suffix not in _SUFFIX_FORMAT:
        raise CheckpointError(
            f"cannot tell the output format from {str(out)!r}; pass --to "
            f"({', '.join(OUTPUT_FORMATS)}) or use one of {', '.join(_SUFFIX_FORMAT)}"
        )
    return _SUFFIX_FORMAT[suffix]


def _check_type(type_name: str | None, to: str) -> str | None:
    if type_name is None:
        return None
    allowed = GGUF_TYPES if to == "gguf" else tuple(FLOAT_TYPES)
    if type_name.upper() not in allowed:
        hint = "" if to == "gguf" else " (for quantized safetensors use `inferflow quantize`)"
        raise QuantError(
            f"--type {type_name!r} is not available for {to} output; allowed: "
            f"{', '.join(allowed)}{hint}"
        )
    return type_name.upper()


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    to: str | None = None,
    type_name: str | None = None,
    force: bool = False,
    progress: bool = False,
    dequantize: bool = False,
) -> Path:
    """Convert between pickle, safetensors and GGUF; ``type_name`` None keeps each tensor's type.

    GGUF output from a GGUF source keeps all its metadata (with the original value types) and
    updates ``general.file_type``; from an HF model directory of an architecture with a GGUF
    template it is a llama.cpp model (``inferflow.hf_gguf``). From one safetensors or pickle file
    the GGUF holds the tensors under their own names with only ``general.*`` bookkeeping keys: a
    tensor container, not a llama.cpp model.
    Quantized tensors become float only when asked: a GGUF keeps them as they are, and
    safetensors / pickle output of a quantized source needs ``dequantize`` (it grows 4-8x).
    """
    to = output_format(out, to)
    target = _check_type(type_name, to)
    src_format, source = open_source(src)
    if to == "gguf":
        src_format, source = gguf_view(src_format, Path(src), source)
    try:
        packed = Counter(d for n in source.names() if is_quant(d := source.dtype_name(n)))
        if to != "gguf" and packed and not dequantize:
            kinds = ", ".join(f"{c} {t}" for t, c in packed.most_common())
            raise CheckpointError(
                f"{src} holds quantized tensors ({kinds}), which {to} cannot store: they would "
                "be written as float, several times larger. Pass --dequantize to do that, or "
                "write a .gguf (keeps them as they are)"
            )
        if to == "gguf":

            def type_for(name: str, shape: tuple[int, ...], dtype: str) -> str:
                return gguf_tensor_type(name, shape, dtype, target)

            kept = source.metadata.get("general.file_type") if src_format == "gguf" else None
            file_type = LLAMA_FTYPE[target] if target else kept
            write_gguf_from(
                source, src_format, Path(src), out, type_for, force, progress, None, file_type
            )
        else:
            if src_format == "gguf":
                logger.warning(
                    "dropped: the GGUF metadata (%d keys: hyperparameters, tokenizer, chat "
                    "template) has no place in %s",
                    len(source.metadata), to,
                )  # fmt: skip
            dtype = FLOAT_TYPES[target] if target else None
            writer = _to_safetensors if to == "safetensors" else _to_pickle
            writer(source, out, dtype, force, progress)
    finally:
        source.close()
    logger.info("wrote %s (%s)", out, to)
    return Path(out)


def _plain(w: Weight, dtype: torch.dtype | None) -> torch.Tensor:
    t = as_float(w)
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _to_safetensors(
    source: WeightSource, out: str | Path, dtype: torch.dtype | None, force: bool, progress: bool
) -> None:
    target = next((n for n, d in FLOAT_TYPES.items() if d == dtype), None)
    plans = []
    for name in source.names():
        stored = _kept_dtype(source.dtype_name(name))
        if target and is_float(stored):
            stored = target
        plans.append(StoredTensor(name, stored, source.shape(name)))
    bar = weight_progress(source, "convert", progress)

    def produce(t: StoredTensor) -> torch.Tensor:
        bar.update(math.prod(t.shape))
        return _plain(source.get(t.name), dtype)

    with bar, atomic_output(out, force) as f:
        write_safetensors(f, plans, produce, {"format": "pt"})


def _to_pickle(
    source: WeightSource, out: str | Path, dtype: torch.dtype | None, force: bool, progress: bool
) -> None:
    state: dict[str, torch.Tensor] = {}
    with weight_progress(source, "convert", progress) as bar:
        for name in source.names():
            state[name] = _owned(_plain(source.get(name), dtype))
            bar.update(math.prod(source.shape(name)))
    with atomic_output(out, force) as f:
        # torch.save is fine for writing: only *reading* untrusted pickles is dangerous
        torch.save(state, f)


def gguf_tensor_type(name: str, shape: Sequence[int], dtype: str, target: str | None) -> str:
    """The GGML type a tensor is written as, following convert_hf_to_gguf.py's rules."""
    if dtype in _GGUF_WIDEN:
        return _GGUF_WIDEN[dtype]
    if not is_float(dtype):
        if dtype not in _PLAIN_GGUF:
            raise CheckpointError(f"tensor {name!r}: GGUF has no type for {dtype} data")
        return dtype
    if target is None:
        # keep what GGUF can hold (GGML types and Inferflow's own, copied raw); F8 -> F32
        keep = dtype in _PLAIN_GGUF or (
            is_quant(dtype) and FORMATS.get(dtype).gguf_type is not None
        )
        return dtype if keep else "F32"
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return "F32"  # llama.cpp keeps norms and 1-D tensors in F32
    if dtype == target:
        return dtype
    block = FORMATS.get(target).block_size
    if shape[-1] % block:
        logger.warning(
            "%s: row of %d is not a multiple of the %s block size %d; falling back to F16",
            name, shape[-1], target, block,
        )  # fmt: skip
        return "F16"
    return target


def gguf_data(
    w: Weight, type_name: str, method: str = "minmax", importance: torch.Tensor | None = None
) -> torch.Tensor:
    """The raw data of ``w`` as GGUF type ``type_name`` (``method``, ``importance``: how a
    quantized type's codes are chosen, as ``inferflow.quant.quantize``)."""
    if isinstance(w, QuantTensor) and w.format == type_name:
        return w.data  # raw copy: no dequantize/requantize round
    if type_name in _TORCH_INT:
        return as_float(w).to(_TORCH_INT[type_name])
    if type_name == "F64":
        return as_float(w).to(torch.float64)
    return quantize_rows(w, FORMATS.get(type_name), method, importance)


def _file_type(plans: Sequence[GGUFTensorPlan]) -> int:
    """llama.cpp ftype of the most common type among the matrices (their bytes dominate)."""
    counts = Counter(p.type_name for p in plans if len(p.shape) > 1)
    common = [t for t, _ in counts.most_common() if t in LLAMA_FTYPE]
    return LLAMA_FTYPE[common[0]] if common else LLAMA_FTYPE["F32"]


TypeFor = Callable[[str, tuple[int, ...], str], str]  # (name, shape, stored dtype) -> GGUF type


def write_gguf_from(
    source: WeightSource,
    src_format: str,
    src_path: Path,
    out: str | Path,
    type_for: TypeFor,
    force: bool,
    progress: bool,
    extra: dict[str, Any] | None = None,
    file_type: int | None = None,
    encode: Callable[[GGUFTensorPlan, Weight], torch.Tensor] | None = None,
) -> list[GGUFTensorPlan]:
    """Write every tensor of ``source`` to a GGUF at ``out`` in the type ``type_for`` picks.

    A GGUF source's metadata is kept whole (value types included), so the output is the same
    model; other sources give a tensor container (general.name only) and a warning. ``extra``
    keys are added; ``general.file_type`` is ``file_type`` or the most common matrix type's.
    ``encode(plan, weight)`` gives a tensor's data (default: ``gguf_data`` of its type).
    """
    plans = [
        GGUFTensorPlan(n, source.shape(n), type_for(n, source.shape(n), source.dtype_name(n)))
        for n in source.names()
    ]
    metadata: dict[str, Any] = {}
    types: dict[str, TypePath] = {}
    if src_format == "gguf":
        src_types: dict[str, TypePath] = getattr(source, "metadata_types", {})
        for key, value in source.metadata.items():
            if key.startswith("split."):
                continue  # the output is one file, whatever the source's sharding
            metadata[key], types[key] = value, src_types[key]
    else:
        metadata["general.name"] = src_path.stem
        logger.warning(
            "%s is not a GGUF: the output holds its tensors under their own names, without "
            "the architecture and tokenizer metadata llama.cpp needs",
            src_path,
        )
    metadata["general.file_type"] = file_type if file_type is not None else _file_type(plans)
    types["general.file_type"] = (4,)  # UINT32, as llama.cpp writes it
    if "general.quantization_version" not in metadata:
        metadata["general.quantization_version"] = 2  # GGML_QNT_VERSION
        types["general.quantization_version"] = (4,)
    metadata.update(extra or {})
    bar = weight_progress(source, "write", progress)

    def produce(p: GGUFTensorPlan) -> torch.Tensor:
        w = source.get(p.name)
        data = encode(p, w) if encode is not None else gguf_data(w, p.type_name)
        bar.update(math.prod(p.shape))
        return data

    with bar, atomic_output(out, force) as f:
        write_gguf(f, metadata, plans, produce, types)
    return plans
