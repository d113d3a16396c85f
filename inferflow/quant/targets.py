"""Which format each checkpoint tensor is quantized to: one rule for ``inferflow quantize`` and
for quantization at load time (``--quant``), so both pack the same tensors the same way.

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
from collections.abc import Sequence

from inferflow.errors import QuantError
from inferflow.loaders.base import WeightSource
from inferflow.quant.formats import FORMATS, QuantFormat, get_format

logger = logging.getLogger(__name__)


def is_quant(dtype: str) -> bool:
    """A packed format name (GGML Q4_1, Inferflow Q3H, ...), as opposed to a plain dtype."""
    return dtype in FORMATS and FORMATS.get(dtype).block_size > 1


def is_float(dtype: str) -> bool:
    return is_quant(dtype) or dtype in ("F32", "F16", "BF16", "F64") or dtype.startswith("F8")


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
    # (quant.logscale) V alone: 4.52-4.56 bits per weight on SmolLM2 / Gemma-3 / Qwen2.5-0.5B
    # (the down projection at Q5_E32 too, 4.79-4.81, measured no better on Gemma-3)
    "Q4_E32": ((V_NAMES, "Q6"),),
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


def tensor_formats(
    source: WeightSource,
    default: QuantFormat | None,
    rules: list[tuple[str, QuantFormat | None]],
    what: str = "--per-tensor",
) -> dict[str, QuantFormat | None]:
    """Each tensor's format (None: kept as it is, or float). ``rules``: (name pattern, format)
    in order, the first match wins; ``what`` names where they come from in errors."""
    names = source.names()
    for pattern, _ in rules:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise QuantError(
                f"{what} pattern {pattern!r} matches no tensor; names look like: "
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
        if rule is not None and rule >= mixed and is_quant(dtype):
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
            not is_float(dtype) or len(shape) < 2 or name.endswith("_norm.weight")
        ):
            target = None  # norms, biases and integer tensors are never packed
        elif (
            target is not None
            and shape[-1] % target.block_size
            and rule is not None
            and (rule < given)
        ):
            raise QuantError(
                f"{what} {rules[rule][0]}={target.name}: {name} has rows of {shape[-1]} "
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
