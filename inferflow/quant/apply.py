"""Quantize a built model in place: every ``Linear`` the policy names becomes a ``QuantLinear``.

A policy maps canonical module paths (``dec.3.self_attn.wqkv``, ``dec.output``) to a format name
or None (keep float): a default, then ordered ``fnmatch`` overrides, last match wins::

    QuantPolicy(default="Q4_B32", overrides=[("dec.tok_embed", None), ("dec.output", "Q8")])

Embeddings are never Linear, so they stay float. A tied output head (``logits = h @ E^T`` with the
embedding E, no ``dec.output`` module) stays float too, unless ``tie_outputs`` names it: then the
head gets its own quantized copy of E (E stays float for lookups), which costs that copy's bytes
but makes the largest matmul of a small model (SmolLM2: 49152 x 576) int4pack-fast.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn

from inferflow.blocks.linear import Linear
from inferflow.errors import QuantError
from inferflow.quant import QuantTensor, get_format, ggml, quantize
from inferflow.quant.linear import QuantLinear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantPolicy:
    """Which format each module path gets: ``default``, then ``overrides`` (last match wins)."""

    default: str | None = None
    overrides: Sequence[tuple[str, str | None]] = ()
    # (head path, embedding path) pairs: give a tied head a quantized copy of the embedding,
    # e.g. (("dec.output", "dec.tok_embed"),); the head's format is format_for(head path)
    tie_outputs: Sequence[tuple[str, str]] = ()
    # None: each layer's fastest kernel; "dequant": float32 matmuls over dequantized tiles (the
    # reference: int4pack rounds activations to bf16)
    kernel: str | None = None
    # how codes are chosen (inferflow.quant.METHODS); loading with a runtime format passes
    # the spec's (quant.method: "search" by default, as `inferflow quantize`)
    method: str = "minmax"

    def __post_init__(self) -> None:
        for name in (self.default, *(f for _, f in self.overrides)):
            if name is not None:
                get_format(name)  # fail at construction, naming the known formats

    def format_for(self, path: str) -> str | None:
        fmt = self.default
        for pattern, name in self.overrides:
            if fnmatchcase(path, pattern):
                fmt = name
        return fmt


@dataclass(frozen=True)
class LayerReport:
    path: str
    shape: tuple[int, int]  # (out, in)
    format: str | None  # None: kept float
    kernel: str | None
    bytes_before: int  # weight only (a bias is unchanged)
    bytes_after: int


@dataclass(frozen=True)
class QuantReport:
    layers: list[LayerReport] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.layers)

    def table(self) -> str:
        """One line per layer plus a total, for logs and the CLI."""
        lines = [f"{'layer':40} {'shape':>14} {'format':>8} {'kernel':>9} {'MB before':>10} after"]
        for r in self.layers:
            shape = f"{r.shape[0]}x{r.shape[1]}"
            lines.append(
                f"{r.path:40} {shape:>14} {r.format or 'float':>8} {r.kernel or '-':>9} "
                f"{r.bytes_before / 1e6:10.2f} {r.bytes_after / 1e6:.2f}"
            )
        lines.append(
            f"{'total':40} {'':>14} {'':>8} {'':>9} "
            f"{self.bytes_before / 1e6:10.2f} {self.bytes_after / 1e6:.2f}"
        )
        return "\n".join(lines)


def _quant_linear(
    path: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    kernel: str | None,
    method: str = "minmax",
) -> QuantLinear:
    block = get_format(fmt).block_size
    if weight.shape[-1] % block:
        # we never pad: the model would see a different shape; keep this layer float instead
        raise QuantError(
            f"{path}.weight of shape {list(weight.shape)}: in_features {weight.shape[-1]} is not "
            f"a multiple of {fmt}'s block size {block}; map {path!r} to None (float) or another "
            "format in the quant policy"
        )
    return QuantLinear(quantize(weight.detach(), fmt, method), bias, kernel)


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` (a dotted module path) in ``model``."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def forget_fused(model: nn.Module) -> None:
    """Stacks decide on their one-call decode at first use; a stack that ran before its layers
    were swapped decides again."""
    from inferflow.model.stack import Stack

    for m in model.modules():
        if isinstance(m, Stack):
            m.forget_fused()


def stack_rows(parts: dict[int, QuantTensor], rows: int) -> QuantTensor | None:
    """Row blocks of one parameter as one QuantTensor, or None unless they cover all ``rows``
    in order and share a format, directly or by an exact widening (a fused q/k/v with a Q8_0 v
    among Q5_0 parts becomes Q8_0; one with a Q6_K v among Q4_K stays float)."""
    ordered = rows_in_order(parts, rows)
    fmt = None if ordered is None else ggml.common_format({p.format for p in ordered})
    if ordered is None or fmt is None:
        return None
    if len(ordered) == 1:
        return ordered[0]
    data = torch.cat([_blocks_as(p, fmt) for p in ordered])
    return QuantTensor(data, fmt, (rows, ordered[0].shape[1]))


def rows_in_order(parts: dict[int, QuantTensor], rows: int) -> list[QuantTensor] | None:
    """2-D row blocks by first row, in order, or None unless they cover rows 0 .. ``rows``
    without gaps or overlaps."""
    starts = sorted(parts)
    ordered = [parts[k] for k in starts]
    ends = [s + p.shape[0] for s, p in zip(starts, ordered, strict=True)]
    if any(len(p.shape) != 2 for p in ordered) or not starts:
        return None
    if starts[0] != 0 or ends[-1] != rows or starts[1:] != ends[:-1]:
        return None
    return ordered


def _blocks_as(w: QuantTensor, fmt: str) -> torch.Tensor:
    """``w``'s blocks (rows, bytes per row) in format ``fmt`` (the same values)."""
    rows = w.shape[0]
    if w.format == fmt:
        return w.data.reshape(rows, -1)
    src = get_format(w.format)
    blocks = w.data.reshape(-1, src.bytes_per_block)
    return ggml.EXACT_WIDENINGS[w.format, fmt](blocks).reshape(rows, -1)


def get_module(model: nn.Module, path: str) -> nn.Module | None:
    """The module at ``path``, or None where that child is absent (e.g. a tied head)."""
    parent, _, name = path.rpartition(".")
    return getattr(model.get_submodule(parent) if parent else model, name, None)


def quantize_linear(path: str, lin: Linear, policy: QuantPolicy) -> QuantLinear | None:
    """The QuantLinear the policy makes of layer ``path`` (None: it stays float). Loading calls
    it per layer as soon as the layer's float weight is read (no float model first)."""
    fmt = policy.format_for(path)
    if fmt is None:
        return None
    return _quant_linear(path, lin.weight, lin.bias, fmt, policy.kernel, policy.method)


def quantize_model(model: nn.Module, policy: QuantPolicy) -> QuantReport:
    """Replace every ``Linear`` whose path the policy maps to a format, in place.

    Raises QuantError when a weight's in_features is not a multiple of its format's block size
    (naming the layer): the policy must say None for it, nothing is padded or skipped silently.
    """
    layers: list[LayerReport] = []
    targets = [(p, m) for p, m in model.named_modules() if isinstance(m, Linear)]
    for path, lin in targets:
        shape = (lin.out_features, lin.in_features)
        before = lin.weight.nbytes
        q = quantize_linear(path, lin, policy)
        if q is None:
            layers.append(LayerReport(path, shape, None, None, before, before))
            continue
        set_module(model, path, q)
        layers.append(LayerReport(path, shape, q.format, q.kernel_name, before, q.nbytes))
    for head, embed in policy.tie_outputs:
        fmt = policy.format_for(head)
        if fmt is None or get_module(model, head) is not None:
            continue  # float head, or an untied (or already quantized) head
        weight = model.get_submodule(embed).weight
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise QuantError(f"tie_outputs: {embed}.weight is not a 2-D tensor")
        q = _quant_linear(head, weight, None, fmt, policy.kernel, policy.method)
        set_module(model, head, q)
        # the embedding stays float, so the head's bytes are all extra
        shape = (weight.shape[0], weight.shape[1])
        layers.append(LayerReport(head, shape, fmt, q.kernel_name, 0, q.nbytes))
    forget_fused(model)
    report = QuantReport(layers)
    n = sum(r.format is not None for r in layers)
    log.info(
        "quantized %d of %d linear layers: %.1f MB -> %.1f MB",
        n,
        len(layers),
        report.bytes_before / 1e6,
        report.bytes_after / 1e6,
    )
    return report
