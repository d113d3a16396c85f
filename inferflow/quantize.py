"""``inferflow quantize``: write a model with its weights in a quantized format.

The model is a spec (a built-in name or a spec file: its checkpoint is read) or a checkpoint
path (GGUF, safetensors, pickle, HF directory; ``package://`` paths too). An output ending in
``.gguf`` is one GGUF file holding every tensor and, from a GGUF source, all of its metadata
(hyperparameters, tokenizer, chat template), plus ``inferflow.quantize.*`` keys recording the
settings: any Inferflow command runs it directly. GGML formats (Q8_0, Q4_0, ...) give a file
llama.cpp runs; Inferflow's own formats (Q3H, Q4_B32, ...) are stored under tensor types of their
own (``quant/minmax.py``), which llama.cpp refuses. Any other output name gets Inferflow's
safetensors container (``loaders/quantized.py``), tensors only.

Which tensors are packed, and the default mix of formats: ``inferflow.quant.targets`` (the
same rule as quantization at load time).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferflow.convert import (
    LLAMA_FTYPE,
    _kept_dtype,
    as_float,
    atomic_output,
    gguf_data,
    gguf_tensor_type,
    gguf_view,
    parse_per_tensor,
    parse_quant_format,
    weight_progress,
    write_gguf_from,
)
from inferflow.errors import CheckpointError, QuantError
from inferflow.hf_gguf import HFAsGGUF
from inferflow.imatrix import NAMED, ImportanceMatrix, named_imatrix
from inferflow.loaders import detect_format, open_files
from inferflow.loaders.base import Weight, WeightSource
from inferflow.loaders.quantized import (
    QuantEntry,
    StoredTensor,
    packed_shape,
    quant_metadata,
    write_safetensors,
)
from inferflow.quant.formats import METHODS, QuantFormat
from inferflow.quant.targets import is_quant, tensor_formats

logger = logging.getLogger(__name__)
Encode = Callable[[str, Weight, str], torch.Tensor]  # (name, weight, type name) -> raw data


@dataclass(frozen=True)
class QuantizeResult:
    out: Path
    formats: dict[str, str]  # tensor name -> format it was stored in (a dtype when kept)
    nbytes: int


def open_model(ref: str | Path) -> tuple[str, Path, WeightSource]:
    """(checkpoint format, first file, lazily opened source) of a spec or a checkpoint path."""
    from inferflow.paths import expand_user
    from inferflow.spec import find_spec_file, load_spec

    given = expand_user(ref)
    if given.is_dir():  # an HF model directory
        return "hf", given, open_files("hf", [given])
    path = find_spec_file(ref)  # a file or a built-in spec's (else: names them)
    if path.suffix in (".yaml", ".yml"):
        spec = load_spec(path)
        files = spec.source.files
        return spec.source.format, files[0], open_files(spec.source.format, files)
    fmt = detect_format(path)
    return fmt, path, open_files(fmt, [path])


def quantize_checkpoint(
    src: str | Path,
    out: str | Path,
    fmt: str,
    per_tensor: Sequence[str] = (),
    force: bool = False,
    progress: bool = False,
    method: str = "search",
    imatrix: str | Path | None = None,
) -> QuantizeResult:
    """Write the model ``src`` names to ``out`` with its weights in ``fmt`` (module docstring).
    ``method``: how Inferflow formats choose their codes (``inferflow.quant.quantize``);
    ``imatrix``: an importance-matrix GGUF of this model (``inferflow.imatrix``), or a name
    (``imatrix.named_imatrix``, computed once and cached): "builtin" from Hamlet, "generated"
    from the model's own samples (no text)."""
    default, rules = parse_quant_format(fmt), parse_per_tensor(per_tensor)
    if method not in METHODS:
        raise QuantError(f"unknown --method {method!r}; allowed: {', '.join(METHODS)}")
    if Path(out).exists() and not force:
        raise CheckpointError(f"output {out} already exists; pass --force to overwrite it")
    if str(imatrix) in NAMED:
        imatrix = named_imatrix(str(imatrix), src)
    matrix = ImportanceMatrix.read(Path(imatrix)) if imatrix is not None else None
    src_format, src_path, source = open_model(src)
    if matrix is not None:
        try:
            matrix.check(source, f"--imatrix {imatrix}")  # by the checkpoint's own names
        except BaseException:
            source.close()
            raise
    gguf = Path(out).suffix.lower() == ".gguf"
    if gguf:
        src_format, source = gguf_view(src_format, src_path, source)
    # an HF directory's tensors are renamed for GGUF; the imatrix knows them by their own names
    own_name = source.source_name if isinstance(source, HFAsGGUF) else str
    try:
        targets = tensor_formats(source, default, rules)

        def encode(name: str, w: Weight, type_name: str) -> torch.Tensor:
            imp = matrix.importance(own_name(name)) if matrix is not None else None
            return gguf_data(w, type_name, method, imp)

        settings: dict[str, Any] = {"inferflow.quantize.method": method}
        if matrix is not None:
            settings["inferflow.quantize.imatrix"] = Path(imatrix or "").name
            settings["inferflow.quantize.imatrix_datasets"] = matrix.datasets or ["?"]
        if gguf:
            formats = _write_gguf(
                source, src_format, src_path, out, fmt, per_tensor, targets, force, progress,
                encode, settings,
            )  # fmt: skip
        else:
            formats = _write_container(source, src_format, out, targets, force, progress, encode)
    finally:
        source.close()
    packed = sum(1 for f in formats.values() if is_quant(f))
    logger.info("wrote %s: %d of %d tensors quantized", out, packed, len(formats))
    return QuantizeResult(Path(out), formats, Path(out).stat().st_size)


def _write_gguf(
    source: WeightSource,
    src_format: str,
    src_path: Path,
    out: str | Path,
    fmt: str,
    per_tensor: Sequence[str],
    targets: dict[str, QuantFormat | None],
    force: bool,
    progress: bool,
    encode: Encode,
    settings: dict[str, Any],
) -> dict[str, str]:
    def type_for(name: str, shape: tuple[int, ...], dtype: str) -> str:
        target = targets[name]
        if target is None:  # kept: plain types as they are, packed ones as float32
            return gguf_tensor_type(name, shape, dtype, "F32" if is_quant(dtype) else None)
        return gguf_tensor_type(name, shape, dtype, target.name)

    extra: dict[str, Any] = {
        "inferflow.quantize.format": fmt.upper(),
        "inferflow.quantize.source": src_path.name,
        **settings,
    }
    if per_tensor:
        extra["inferflow.quantize.per_tensor"] = list(per_tensor)
    ftype = LLAMA_FTYPE.get(fmt.upper())
    plans = write_gguf_from(
        source, src_format, src_path, out, type_for, force, progress, extra, ftype,
        lambda p, w: encode(p.name, w, p.type_name),
    )  # fmt: skip
    return {p.name: p.type_name for p in plans}


def _write_container(
    source: WeightSource,
    src_format: str,
    out: str | Path,
    targets: dict[str, QuantFormat | None],
    force: bool,
    progress: bool,
    encode: Encode,
) -> dict[str, str]:
    plans: list[StoredTensor] = []
    entries: dict[str, QuantEntry] = {}
    for name, target in targets.items():
        shape, dtype = source.shape(name), source.dtype_name(name)
        if target is None:
            plans.append(StoredTensor(name, _kept_dtype(dtype), shape))
        else:
            plans.append(StoredTensor(name, "U8", packed_shape(target, shape)))
            entries[name] = QuantEntry(target.name, shape)
    # safetensors' own string metadata carries over; GGUF key/values have no place here
    keep = src_format == "safetensors"
    meta = {k: v for k, v in source.metadata.items() if keep and isinstance(v, str)}
    meta.update(quant_metadata(entries))
    bar = weight_progress(source, "quantize", progress)

    def produce(t: StoredTensor) -> torch.Tensor:
        w, target = source.get(t.name), targets[t.name]
        data = as_float(w) if target is None else encode(t.name, w, target.name)
        if target is not None:
            data = data.reshape(t.shape)
        bar.update(math.prod(source.shape(t.name)))
        return data

    with bar, atomic_output(out, force) as f:
        write_safetensors(f, plans, produce, meta)
    return {p.name: (e.format if (e := entries.get(p.name)) else p.dtype) for p in plans}
