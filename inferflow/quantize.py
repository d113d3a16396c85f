"""``inferflow quantize``: write a model with its weights in a quantized format.

The model is a spec (a built-in name or a spec file: its checkpoint is read) or a checkpoint
path (GGUF, safetensors, pickle, HF directory; ``package://`` paths too). An output ending in
``.gguf`` is one GGUF file holding every tensor and, from a GGUF source, all of its metadata
(hyperparameters, tokenizer, chat template), plus ``inferflow.quantize.*`` keys recording the
settings: any Inferflow command runs it directly. GGML formats (Q8_0, Q4_0, ...) give a file
llama.cpp runs; Inferflow's own formats (Q3H, Q4_B32, ...) are stored under tensor types of their
own (``quant/minmax.py``), which llama.cpp refuses. Any other output name gets Inferflow's
safetensors container (``loaders/quantized.py``), tensors only.

Which tensors are packed: every float tensor of two or more dimensions gets the format of the
first ``--per-tensor PATTERN=FMT`` rule matching its name, else ``--format``; 1-D tensors,
norms and integer tensors stay as they are (float32 in a GGUF, as llama.cpp keeps them). A
tensor whose rows are not a multiple of a k-quant's 256 gets that format's ``FALLBACK`` (blocks
of 32, about the same bits, as llama.cpp's "fallback quantization": Qwen2.5's and Gemma-3's
widths of 896 and 640 would leave nearly every matrix float); with no fallback, or rows no
fallback takes either, it stays float; both with a warning.

Default mix: the output head (``output.weight`` / ``lm_head.weight``, or the token embeddings
when the head is tied to them) costs the most quality per bit, so below 6 bits per weight it
gets Q6 (Inferflow formats) or Q8_0 (GGML formats), as llama.cpp gives it Q6_K in its mixes.
The 4-bit Inferflow formats also give attention's V projection Q6 and the FFN's down
projection Q5 (``MIXES``), as llama.cpp's _K_M mixes do with more bits: that costs 0.16 (Q4_B32)
to 0.29 (Q4_B64) bits per weight and halves the perplexity loss (measured in ``MIXES``' note).
Tensors the source already stores quantized keep the main format instead (re-quantizing a Q4_1
file to Q4_B32 keeps its grid; Q5's blocks of 64 would not).
GGML formats keep every other tensor in the type asked for. ``--per-tensor`` rules come first
and override the mix (``--per-tensor output.weight=Q3H``).
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferflow.convert import (
    LLAMA_FTYPE,
    _is_float,
    _is_quant,
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
from inferflow.imatrix import ImportanceMatrix
from inferflow.loaders import detect_format, open_files
from inferflow.loaders.base import Weight, WeightSource
from inferflow.loaders.quantized import (
    QuantEntry,
    StoredTensor,
    packed_shape,
    quant_metadata,
    write_safetensors,
)
from inferflow.quant.formats import METHODS, QuantFormat, get_format

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


HEAD_NAMES = ("output.weight", "lm_head.weight")  # an untied output head (GGUF, HF names)
EMBED_NAMES = (
    "token_embd.weight",
    "*embed_tokens.weight",
    "*word_embeddings.weight",
    "*wte.weight",
)
HEAD_BITS = 6.0  # formats below this many bits per weight give the head HEAD_FORMAT's
HEAD_FORMAT = {True: "Q8_0", False: "Q6"}  # by whether the main format is a GGML one
V_NAMES = ("*attn_v.weight", "*self_attn.v_proj.weight")  # GGUF, HF names
DOWN_NAMES = ("*ffn_down.weight", "*mlp.down_proj.weight")
# format -> (name patterns, format) rules of its default mix. Measured on Gemma-3-270M with an
# imatrix (benchmarks/quant_quality.py, Hamlet, ctx 512, 4 windows; perplexity over float):
# Q4_B64 1.068x at 4.50 bits per weight -> 1.052x with V at Q6 (4.56) -> 1.040x with the down
# projection at Q5 too (4.79); Q4_B32 1.040x at 5.00 -> 1.024x (5.16)
_FOUR_BIT_MIX = ((V_NAMES, "Q6"), (DOWN_NAMES, "Q5"))
# k-quant -> the 32-block GGML format a tensor gets when its rows are no multiple of 256 (as
# llama.cpp does, which gives Q2_K / Q3_K rows IQ4_NL, a type we do not write: Q4_0 here)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
MIXES: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "Q4_B32": _FOUR_BIT_MIX,
    "Q4_B64": _FOUR_BIT_MIX,
}


def default_rules(
    names: Sequence[str], fmt: QuantFormat | None
) -> tuple[list[tuple[str, QuantFormat]], list[tuple[str, QuantFormat]]]:
    """The default mix for ``fmt`` (module docstring): (a higher-bit format for the output
    head, ``MIXES``' rules)."""
    if fmt is None or fmt.bits_per_weight >= HEAD_BITS:
        return [], []
    head = get_format(HEAD_FORMAT[fmt.ggml_type is not None])
    heads = [n for n in names if n in HEAD_NAMES]
    if not heads:  # tied: the head reads the token embeddings
        heads = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in EMBED_NAMES)][:1]
    more = [(p, get_format(f)) for patterns, f in MIXES.get(fmt.name, ()) for p in patterns]
    return [(n, head) for n in heads], more


def _targets(
    source: WeightSource, default: QuantFormat | None, rules: list[tuple[str, QuantFormat | None]]
) -> dict[str, QuantFormat | None]:
    """Each tensor's format (None: kept as it is, or float)."""
    names = source.names()
    for pattern, _ in rules:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise QuantError(
                f"--per-tensor pattern {pattern!r} matches no tensor; names look like: "
                f"{', '.join(names[:5])}"
            )
    given = len(rules)
    heads, mix = default_rules(names, default)
    mixed = given + len(heads)  # rules from here on are MIXES'
    rules = [*rules, *heads, *mix]
    out: dict[str, QuantFormat | None] = {}
    for name in names:
        shape, dtype = source.shape(name), source.dtype_name(name)
        rule = next((i for i, (p, _) in enumerate(rules) if fnmatch.fnmatchcase(name, p)), None)
        target = default if rule is None else rules[rule][1]
        if rule is not None and rule >= mixed and _is_quant(dtype):
            # a tensor the source stores quantized keeps the main format: the mix's formats
            # (other block sizes) cannot hold its grid, the main one may (Q4_1 -> Q4_B32)
            target = default
        if (
            rule is not None
            and rule >= given
            and target
            and shape
            and shape[-1] % target.block_size
        ):
            target = default  # a default-mix format the rows cannot take: the main one
        if target is not None and (
            not _is_float(dtype) or len(shape) < 2 or name.endswith("_norm.weight")
        ):
            target = None  # norms, biases and integer tensors are never packed
        elif (
            target is not None
            and shape[-1] % target.block_size
            and rule is not None
            and (rule < given)
        ):
            raise QuantError(
                f"--per-tensor {rules[rule][0]}={target.name}: {name} has rows of {shape[-1]} "
                f"weights, not a multiple of {target.name}'s block size {target.block_size}"
            )
        elif target is not None and shape[-1] % target.block_size:
            fallback = FALLBACK.get(target.name)
            if fallback is not None and shape[-1] % get_format(fallback).block_size == 0:
                logger.warning(
                    "%s: last dimension %d is not a multiple of the %s block size %d; %s "
                    "instead", name, shape[-1], target.name, target.block_size, fallback,
                )  # fmt: skip
                target = get_format(fallback)
            else:
                logger.warning(
                    "%s: last dimension %d is not a multiple of the %s block size %d; kept "
                    "float", name, shape[-1], target.name, target.block_size,
                )  # fmt: skip
                target = None
        out[name] = target
    return out


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
    ``imatrix``: an importance-matrix GGUF of this model (``inferflow.imatrix``)."""
    default, rules = parse_quant_format(fmt), parse_per_tensor(per_tensor)
    if method not in METHODS:
        raise QuantError(f"unknown --method {method!r}; allowed: {', '.join(METHODS)}")
    if Path(out).exists() and not force:
        raise CheckpointError(f"output {out} already exists; pass --force to overwrite it")
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
        targets = _targets(source, default, rules)

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
    packed = sum(1 for f in formats.values() if _is_quant(f))
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
            return gguf_tensor_type(name, shape, dtype, "F32" if _is_quant(dtype) else None)
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
