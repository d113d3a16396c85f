"""Give every parameter of a network built on the meta device its storage, once, in its final
form (``materialise``), following a ``WeightPlan`` (inferflow.model.binding).

With ``keep`` (the default for checkpoints stored quantized, e.g. GGUF Q4_1 / Q8_0 / Q4_K):

- a ``Linear`` whose weight the checkpoint stores in blocks of a format the fast kernels read
  (int4pack and the C plane: the affine formats) becomes a ``QuantLinear`` over those blocks;
  other formats (Q6_K, Q2_K ...) are dequantized to float, which is faster on CPU than their
  dequantize-per-call path;
- a tied head (logits = h @ E^T) whose embedding E is stored so gets a QuantLinear over E's
  blocks, and then E itself keeps its blocks too (lookups dequantize the rows they read);
- an embedding stored quantized keeps its blocks unless a float tied head reads the table.

Everything else is read into a tensor of the run dtype, one parameter at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from inferflow.blocks.linear import Embedding, Linear
from inferflow.errors import WeightBindingError
from inferflow.loaders.base import WeightSource
from inferflow.model.binding import WeightPlan, read_param, set_param, stored_blocks
from inferflow.quant.apply import forget_fused
from inferflow.quant.linear import QuantLinear, select_kernel
from inferflow.quant.tensor import QuantTensor

log = logging.getLogger(__name__)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _fast(qt: QuantTensor | None) -> QuantTensor | None:
    return qt if qt is not None and select_kernel(qt.qformat) == "int4pack" else None


def materialise(
    model: nn.Module,
    source: WeightSource,
    plan: WeightPlan,
    keep: bool,
    kernel: str | None = None,
    ties: Sequence[tuple[str, str]] = (),
) -> int:
    """Fill ``model`` (built on the meta device) from ``source``; returns how many linear
    layers kept the checkpoint's blocks. ``ties``: (head path, embedding path) pairs of tied
    heads, which are absent modules until a QuantLinear is put there."""
    done: set[str] = set()  # parameters given storage (or replaced)
    kept = 0
    if keep:
        for path, mod in list(model.named_modules()):
            if type(mod) is not Linear:
                continue
            qt = _fast(
                stored_blocks(source, plan.parts.get(f"{path}.weight", []), mod.out_features)
            )
            if qt is None:
                continue
            bias = None
            if mod.bias is not None:
                bias = read_param(model, source, mod.bias, plan.parts[f"{path}.bias"])
            _set(model, path, QuantLinear(qt, bias, kernel))
            done.update((f"{path}.weight", f"{path}.bias"))
            kept += 1
        for head, embed in ties:
            if not _absent(model, head):
                continue  # the head is not tied after all
            table = model.get_submodule(embed)
            assert isinstance(table, Embedding)
            rows = table.weight.shape[0]
            qt = _fast(stored_blocks(source, plan.parts.get(f"{embed}.weight", []), rows))
            if qt is not None:
                _set(model, head, QuantLinear(qt, None, kernel))
                kept += 1
        float_heads = {e for h, e in ties if _absent(model, h)}
        for path, mod in list(model.named_modules()):
            if isinstance(mod, Embedding) and path not in float_heads:
                pname = f"{path}.weight"
                qt = stored_blocks(source, plan.parts.get(pname, []), mod.weight.shape[0])
                if qt is not None:
                    mod.keep_blocks(qt)
                    done.add(pname)
    for pname, param in list(model.named_parameters()):
        if pname in done:
            continue
        if pname not in plan.parts:
            raise WeightBindingError(f"{pname}: no checkpoint tensor fills it")
        set_param(model, pname, read_param(model, source, param, plan.parts[pname]))
    forget_fused(model)
    log.info("kept %d checkpoint-quantized linear layers in their blocks", kept)
    return kept


def _absent(model: nn.Module, path: str) -> bool:
    parent, _, name = path.rpartition(".")
    return getattr(model.get_submodule(parent) if parent else model, name, None) is None
