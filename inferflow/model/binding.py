"""Strict weight binding: every checkpoint tensor lands in exactly one parameter (rows), and
every parameter is filled, or a WeightBindingError names what is missing or unused."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from inferflow.errors import WeightBindingError
from inferflow.loaders.base import WeightSource
from inferflow.model.names import NameMap
from inferflow.quant.tensor import QuantTensor

log = logging.getLogger(__name__)

# canonical leaf -> (fused parameter leaf, shard id): separate checkpoint tensors filling row
# ranges of one fused parameter (vLLM's stacked_params_mapping)
STACKED: dict[str, tuple[str, str]] = {
    "self_attn.wq": ("self_attn.wqkv", "q"),
    "self_attn.wk": ("self_attn.wqkv", "k"),
    "self_attn.wv": ("self_attn.wqkv", "v"),
    "cross_attn.wk": ("cross_attn.wkv", "k"),
    "cross_attn.wv": ("cross_attn.wkv", "v"),
    "feed_forward.w1": ("feed_forward.w13", "w1"),
    "feed_forward.w3": ("feed_forward.w13", "w3"),
}
SHARDS: dict[str, tuple[str, ...]] = {
    "self_attn.wqkv": ("q", "k", "v"),
    "cross_attn.wkv": ("k", "v"),
    "feed_forward.w13": ("w1", "w3"),
}
# a checkpoint's own fused tensor is reordered by the owning block (e.g. per-head qkv rows)
FUSED_LOADERS: dict[str, str] = {"self_attn.wqkv": "load_fused"}

_SHOW = 12  # names listed in one error before "... and N more"


def _listing(names: list[str]) -> str:
    head = ", ".join(names[:_SHOW])
    return head + (f", ... and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


class _Target:
    """Where one canonical tensor goes: a parameter, optionally a row range, optionally a reorder."""

    def __init__(
        self,
        param: str,
        rows: slice | None,
        shard: str | None,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self.param, self.rows, self.shard, self.prepare = param, rows, shard, prepare


def _resolve(model: nn.Module, params: dict[str, nn.Parameter], canon: str) -> _Target | None:
    module_path, _, leaf = canon.rpartition(".")  # e.g. dec.3.self_attn.wq , weight
    if canon in params:
        prepare = None
        for suffix, method in FUSED_LOADERS.items():
            if module_path.endswith("." + suffix):
                prepare = getattr(model.get_submodule(module_path.rpartition(".")[0]), method)
        return _Target(canon, None, None, prepare)
    for src, (dst, shard) in STACKED.items():
        if module_path.endswith("." + src):
            fused_path = module_path[: -len(src)] + dst
            name = f"{fused_path}.{leaf}"
            if name in params:
                parent: Any = model.get_submodule(fused_path.rpartition(".")[0])
                return _Target(name, parent.shard_rows(shard), shard, None)
    return None


def _take_slice(model: nn.Module, param: str, shard: str | None, t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel block's part of a whole checkpoint tensor (the block knows its cut)."""
    path = param.rsplit(".", 2)
    if len(path) < 3:  # e.g. dec.logits_bias: not inside a block
        return t
    take = getattr(model.get_submodule(path[0]), "take_slice", None)
    return t if take is None else take(path[1], path[2], shard, t)


def bind_weights(
    model: nn.Module,
    source: WeightSource,
    name_map: NameMap,
    quantized: dict[str, dict[int, QuantTensor]] | None = None,
    elsewhere: Callable[[str], bool] | None = None,
) -> set[str]:
    """Copy the checkpoint into the model's parameters; returns the checkpoint names consumed.

    With ``quantized``, every checkpoint tensor stored quantized that lands unchanged (no
    transpose, reorder or tensor-parallel slice) in a parameter is also recorded there as
    ``{param: {first row: QuantTensor}}``, so a caller can keep the blocks
    (inferflow.quant.apply.keep_checkpoint). ``elsewhere(canonical name)``: tensors another rank
    of a partitioned model holds; they are neither read nor reported unused.
    """
    params = dict(model.named_parameters())
    filled: dict[str, set[str | None]] = {}
    consumed: set[str] = set()
    unused: list[str] = []
    errors: list[str] = []
    for name in source.names():
        mapped = name_map(name)
        if mapped is None:
            if not name_map.ignored(name):
                unused.append(name)
            continue
        canon, transpose = mapped
        if elsewhere is not None and elsewhere(canon):
            consumed.add(name)
            continue
        target = _resolve(model, params, canon)
        if target is None:
            unused.append(f"{name} (as {canon})")
            continue
        shard_key = target.shard
        if shard_key in filled.get(target.param, set()):
            errors.append(f"{name}: {canon} is given twice")
            continue
        w = source.get(name)
        t = w.dequantize() if isinstance(w, QuantTensor) else w
        if transpose:
            t = t.t()
        param = params[target.param]
        dest = param.data if target.rows is None else param.data[target.rows]
        if target.prepare is not None:
            try:
                t = target.prepare(t)
            except RuntimeError:  # a reorder that cannot view the tensor: a wrong shape
                errors.append(f"{name}: shape {list(t.shape)} does not fit the fused {canon}")
                continue
        whole = t
        t = _take_slice(model, target.param, target.shard, t)
        if t.shape != dest.shape and t.squeeze().shape == dest.squeeze().shape:
            t = t.reshape(dest.shape)  # e.g. BART's final_logits_bias, stored (1, vocab)
        if tuple(t.shape) != tuple(dest.shape):
            cut = "" if t is whole else f" (this rank's part of {list(whole.shape)})"
            errors.append(
                f"{name}: shape {list(t.shape)}{cut} does not fit {canon} of shape "
                f"{list(dest.shape)}"
            )
            continue
        with torch.no_grad():
            dest.copy_(t)
        if quantized is not None and isinstance(w, QuantTensor) and not transpose:
            if target.prepare is None and t is whole:
                first = 0 if target.rows is None else target.rows.start
                quantized.setdefault(target.param, {})[first] = w
        filled.setdefault(target.param, set()).add(shard_key)
        consumed.add(name)
    missing: list[str] = []
    unfilled: set[str] = set()
    for pname in params:
        got = filled.get(pname, set())
        leaf_module = pname.rpartition(".")[0]
        need = next((set(s) for k, s in SHARDS.items() if leaf_module.endswith(k)), {None})
        if None in got:
            continue
        lacking = need - got
        if lacking:
            unfilled.add(pname)
            missing.append(
                pname
                if need == {None}
                else f"{pname} (shards {', '.join(sorted(map(str, lacking)))})"
            )
    problems = [f"tensors that do not fit the network: {_listing(errors)}"] if errors else []
    for stack, role in (("enc.", "encoder"), ("dec.", "decoder")):
        mine = [p for p in params if p.startswith(stack)]
        if mine and all(p in unfilled for p in mine):
            problems.append(
                f"no checkpoint tensor maps to the {role} ({stack}*): is network.type right "
                f"(the checkpoint may not have an {role}), and does network.tensors map its names?"
            )
    if missing:
        problems.append(
            f"the checkpoint lacks {len(missing)} tensor(s) the network needs: {_listing(missing)}"
        )
    if unused:
        problems.append(
            f"the checkpoint has {len(unused)} tensor(s) the network does not use: {_listing(unused)}"
        )
    if problems:
        raise WeightBindingError(
            "; ".join(problems) + " (check network.tensors (map / ignore) and settings such as "
            "attention.bias, output.tied, hparams)"
        )
    log.debug("bound %d checkpoint tensors into %d parameters", len(consumed), len(params))
    return consumed
