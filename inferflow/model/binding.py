"""Strict weight binding in two passes over a network built on the meta device.

``plan_weights`` maps every checkpoint tensor to exactly one parameter (or a row range of one)
and checks every shape on meta tensors, reading no data: a missing, unused or mis-shaped tensor
is a WeightBindingError naming it. ``materialise`` then gives each parameter its storage once,
in its final form: a linear weight the checkpoint stores in blocks a fast kernel reads becomes a
QuantLinear over those blocks (no float copy), everything else is read, dequantized and copied
into a tensor of the run dtype. Nothing holds a second copy of the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import nn

from inferflow.errors import WeightBindingError
from inferflow.loaders.base import WeightSource
from inferflow.model.names import NameMap, Use
from inferflow.quant.tensor import QuantTensor
from inferflow.spec.types import MapEntry

log = logging.getLogger(__name__)

# a canonical linear's name -> (the fused linear beside it, shard id): separate checkpoint tensors
# filling row ranges of one fused parameter (vLLM's stacked_params_mapping). The fused one's
# owner (attention, a gated FFN, an MoE expert) says which rows each shard takes (shard_rows).
STACKED: dict[str, tuple[tuple[str, str], ...]] = {
    "wq": (("wqkv", "q"),),
    "wk": (("wqkv", "k"), ("wkv", "k")),  # self-attention's qkv, cross-attention's kv
    "wv": (("wqkv", "v"), ("wkv", "v")),
    "w1": (("w13", "w1"),),
    "w3": (("w13", "w3"),),
}
SHARDS: dict[str, tuple[str, ...]] = {
    "wqkv": ("q", "k", "v"),
    "wkv": ("k", "v"),
    "w13": ("w1", "w3"),
}
# a checkpoint's own fused tensor is reordered by the owning block (e.g. per-head qkv rows)
FUSED_LOADERS: dict[str, str] = {"self_attn.wqkv": "load_fused"}

_SHOW = 12  # names listed in one error before "... and N more"


def _listing(names: list[str]) -> str:
    head = ", ".join(names[:_SHOW])
    return head + (f", ... and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


class _Target(NamedTuple):
    """Where one canonical tensor goes: a parameter, optionally a row range, optionally a reorder."""

    param: str
    rows: slice | None
    shard: str | None
    prepare: Callable[[torch.Tensor], torch.Tensor] | None


class Bound(NamedTuple):
    """One checkpoint tensor and the (part of a) parameter it fills."""

    name: str  # the checkpoint's
    canon: str
    entry: MapEntry  # the rule's steps (transpose, slice, chunk, reshape, scale)
    target: _Target
    as_stored: bool  # lands unchanged: no step, reorder or tensor-parallel slice


@dataclass
class WeightPlan:
    """Checkpoint tensors per parameter (in row order), and every checkpoint name consumed
    (those another rank holds included)."""

    parts: dict[str, list[Bound]] = field(default_factory=dict)
    consumed: set[str] = field(default_factory=set)


class _Misfit(Exception):
    pass


def _resolve(model: nn.Module, params: dict[str, nn.Parameter], canon: str) -> _Target | None:
    module_path, _, leaf = canon.rpartition(".")  # e.g. dec.3.self_attn.wq , weight
    if canon in params:
        prepare = None
        for suffix, method in FUSED_LOADERS.items():
            if module_path.endswith("." + suffix):
                prepare = getattr(model.get_submodule(module_path.rpartition(".")[0]), method)
        return _Target(canon, None, None, prepare)
    owner, _, linear = module_path.rpartition(".")
    for fused, shard in STACKED.get(linear, ()):
        name = f"{owner}.{fused}.{leaf}"
        if name in params:
            parent: Any = model.get_submodule(owner)
            return _Target(name, parent.shard_rows(shard), shard, None)
    return None


def _take_slice(model: nn.Module, param: str, shard: str | None, t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel block's part of a whole checkpoint tensor (the block knows its cut)."""
    path = param.rsplit(".", 2)
    if len(path) < 3:  # e.g. dec.logits_bias: not inside a block
        return t
    take = getattr(model.get_submodule(path[0]), "take_slice", None)
    return t if take is None else take(path[1], path[2], shard, t)


def _fit(model: nn.Module, b: Bound, t: torch.Tensor, dest: torch.Size) -> torch.Tensor:
    """Checkpoint tensor ``t`` as its destination (of shape ``dest``) takes it. The same steps
    check every shape on meta tensors before any data is read."""
    t = _steps(b, t, _heads(model, b))
    if b.target.prepare is not None:
        try:
            t = b.target.prepare(t)
        except RuntimeError:  # a reorder that cannot view the tensor: a wrong shape
            raise _Misfit(
                f"{b.name}: shape {list(t.shape)} does not fit the fused {b.canon}"
            ) from None
    whole = t
    t = _take_slice(model, b.target.param, b.target.shard, t)
    if t.shape != dest and t.squeeze().shape == torch.empty(dest, device="meta").squeeze().shape:
        t = t.reshape(dest)  # e.g. BART's final_logits_bias, stored (1, vocab)
    if t.shape != dest:
        cut = "" if t is whole else f" (this rank's part of {list(whole.shape)})"
        raise _Misfit(
            f"{b.name}: shape {list(t.shape)}{cut} does not fit {b.canon} of shape {list(dest)}"
        )
    return t


def _heads(model: nn.Module, b: Bound) -> int:
    """The head count a ``rope_rows`` step names (0 without one): a number, or the n_heads /
    n_kv_heads of the stack the target is in."""
    count = b.entry.rope_rows[0] if b.entry.rope_rows is not None else 0
    if isinstance(count, int):
        return count
    spec = getattr(model, "spec", None)
    if spec is None:
        raise _Misfit(f"{b.name}: rope_rows: {count} needs the network's hyperparameters")
    h = spec.encoder_hparams if b.canon.startswith("enc.") else spec.hparams
    return int(getattr(h, count))


def rope_rows(t: torch.Tensor, heads: int, to: str) -> torch.Tensor:
    """Each head's rows between the rope layouts: ``half`` (HF: dims i and i + d/2 rotate
    together) from ``adjacent`` (llama.cpp's GGUF: dims 2i and 2i + 1), or back (``adjacent``:
    the permutation llama.cpp's convert_hf_to_gguf.py applies to llama's q and k)."""
    n, rest = t.shape[0], t.shape[1:]
    d = n // heads
    if to == "half":  # rows (head, d/2, 2) -> (head, 2, d/2)
        return t.reshape(heads, d // 2, 2, *rest).transpose(1, 2).reshape(n, *rest)
    return t.reshape(heads, 2, d // 2, *rest).transpose(1, 2).reshape(n, *rest)


def _rope_rows(b: Bound, t: torch.Tensor, heads: int) -> torch.Tensor:
    to = b.entry.rope_rows[1] if b.entry.rope_rows is not None else "half"
    n = t.shape[0]
    if heads < 1 or n % (2 * heads):
        raise _Misfit(
            f"{b.name}: rope_rows: {n} rows do not split into {heads} heads of an even size"
        )
    return rope_rows(t, heads, to)


def _steps(b: Bound, t: torch.Tensor, heads: int = 0) -> torch.Tensor:
    """The map entry's steps, in their documented order (MapEntry)."""
    e, shape = b.entry, list(t.shape)
    if e.pick is not None:
        if t.dim() < (1 if e.per_layer else 2) or e.pick >= t.shape[0]:
            what = "layer" if e.per_layer else "expert"
            raise _Misfit(
                f"{b.name}: {what} {e.pick} of a stacked tensor of shape {shape} (the {what}s "
                "along the first axis)"
            )
        t, shape = t[e.pick], shape[1:]
    if e.transpose:
        if t.dim() != 2:
            raise _Misfit(f"{b.name}: transpose needs a 2-D tensor, the stored one is {shape}")
        t = t.t()
    for step, cut in (("slice", e.slice), ("chunk", e.chunk)):
        if cut is None:
            continue
        axis = cut[0]
        if axis >= t.dim():
            raise _Misfit(f"{b.name}: {step} axis {axis} of a tensor of shape {list(t.shape)}")
        n = t.shape[axis]
        if step == "slice":
            start, stop = cut[1], cut[2]
        else:
            parts, index = cut[1], cut[2]
            if n % parts:
                raise _Misfit(
                    f"{b.name}: chunk: axis {axis} of shape {list(t.shape)} does not split "
                    f"into {parts} equal parts"
                )
            start, stop = index * n // parts, (index + 1) * n // parts
        if stop > n:
            raise _Misfit(
                f"{b.name}: slice {start}:{stop} of axis {axis} is out of range for shape "
                f"{list(t.shape)}"
            )
        t = t.narrow(axis, start, stop - start)
    if e.rope_rows is not None:
        t = _rope_rows(b, t, heads)
    if e.reshape is not None:
        try:
            t = t.reshape(e.reshape)
        except RuntimeError:
            raise _Misfit(
                f"{b.name}: shape {list(t.shape)} cannot be reshaped to {list(e.reshape)}"
            ) from None
    if e.scale is not None:
        t = t * e.scale
    if e.pad is not None:
        axis, size = e.pad
        if axis >= t.dim() or size < t.shape[axis]:
            raise _Misfit(
                f"{b.name}: pad axis {axis} to {size}: the tensor of shape {list(t.shape)} "
                "has no such axis or is already longer"
            )
        widths = [0, 0] * (t.dim() - 1 - axis) + [0, size - t.shape[axis]]
        t = torch.nn.functional.pad(t, widths)
    return t


def _layers(params: dict[str, nn.Parameter]) -> dict[str, list[int]]:
    """The layer indices of each stack ("enc" / "dec"), from the parameter names."""
    out: dict[str, set[int]] = {}
    for p in params:
        stack, _, rest = p.partition(".")
        head = rest.partition(".")[0]
        if head.isdigit():
            out.setdefault(stack, set()).add(int(head))
    return {k: sorted(v) for k, v in out.items()}


def _targets(
    canon: str,
    layers: dict[str, list[int]],
    params: dict[str, nn.Parameter],
    stored: Sequence[int],
    per_layer: bool = False,
) -> list[tuple[str, int | None]]:
    """(canonical name, pick) pairs: the name itself, every layer's when a shared source left
    its ``{i}`` (``per_layer``: each picking its layer's element of the stored tensor), and
    every expert's, each picking its row of the stacked tensor, when a stacked source left its
    ``{e}``."""
    if "{i}" in canon:
        stack = canon.partition(".")[0]
        ids = layers.get(stack, [])
        if per_layer:
            total = max(ids, default=-1) + 1
            if not stored or stored[0] != total:
                raise _Misfit(
                    f"per_layer: a tensor of shape {list(stored)} gives one value per layer "
                    f"along its first axis, but {stack} has {total} layers"
                )
            return [(canon.replace("{i}", str(i)), i) for i in ids]
        names = [canon.replace("{i}", str(i)) for i in ids]
    else:
        names = [canon]
    if "{e}" not in canon:
        return [(n, None) for n in names]
    out: list[tuple[str, int | None]] = []
    for n in names:
        before = n.partition("{e}")[0]
        experts = sorted(
            {
                int(h)
                for p in params
                if p.startswith(before) and (h := p[len(before) :].partition(".")[0]).isdigit()
            }
        )
        if experts and (not stored or stored[0] != len(experts)):
            raise _Misfit(
                f"a tensor of shape {list(stored)} stacks its experts along the first axis, "
                f"but {before.rstrip('.')} holds {len(experts)} experts"
            )
        out += [(n.replace("{e}", str(e)), e) for e in experts]
    return out


def _dest_shape(param: torch.Tensor, rows: slice | None) -> torch.Size:
    return param.shape if rows is None else param[rows].shape


def plan_weights(
    model: nn.Module,
    source: WeightSource,
    name_map: NameMap,
    elsewhere: Callable[[str], bool] | None = None,
) -> WeightPlan:
    """Which checkpoint tensors fill which parameters, every shape checked, no data read.

    ``elsewhere(canonical name)``: tensors another rank of a partitioned model holds; they are
    neither read nor reported unused."""
    params = dict(model.named_parameters())
    plan = WeightPlan()
    filled: dict[str, set[str | None]] = {}
    unused: list[str] = []
    errors: list[str] = []
    layers = _layers(params)
    for name in source.names():
        uses = name_map(name)
        if uses is None:
            if not name_map.ignored(name):
                unused.append(name)
            continue
        used = False
        for use in uses:
            try:
                targets = _targets(
                    use.target, layers, params, source.shape(name), use.entry.per_layer
                )
            except _Misfit as e:
                errors.append(f"{name}: {e} (mapped by {use.origin})")
                continue
            for canon, pick in targets:
                if pick is not None:
                    use = use._replace(entry=replace(use.entry, pick=pick))
                if elsewhere is not None and elsewhere(canon):
                    used = True
                    continue
                try:
                    if _plan_one(model, params, plan, filled, source, name, canon, use):
                        used = True
                    else:
                        unused.append(f"{name} (as {canon}, by {use.origin})")
                except _Misfit as e:
                    errors.append(str(e))
        if used:
            plan.consumed.add(name)
    for pattern in name_map.unmatched_ignores():  # a typo, or a template's entry this lacks
        log.warning(
            "network.tensors.ignore: %r matches no tensor of the checkpoint (names are matched "
            "after the prefix %r; {i} stands for a layer index, * for any text)",
            pattern,
            name_map.prefix,
        )
    for parts in plan.parts.values():  # row order: how stacked blocks are concatenated
        parts.sort(key=lambda b: 0 if b.target.rows is None else b.target.rows.start)
    _report(params, filled, errors, unused)
    return plan


def _plan_one(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    plan: WeightPlan,
    filled: dict[str, set[str | None]],
    source: WeightSource,
    name: str,
    canon: str,
    use: Use,
) -> bool:
    """Plan checkpoint tensor ``name`` into ``canon``; False when no parameter takes ``canon``.
    Raises _Misfit naming the tensor, the shapes and the rule."""
    target = _resolve(model, params, canon)
    if target is None:
        return False
    into = use.entry.rows
    if into is not None:  # one of several tensors concatenated along the first axis
        if target.rows is not None:
            raise _Misfit(
                f"{name}: rows: {canon} is itself a part of a fused tensor ({use.origin})"
            )
        n = params[target.param].shape[0]
        if into[1] > n:
            raise _Misfit(
                f"{name}: rows {into[0]}:{into[1]} lie past the {n} rows of {canon} ({use.origin})"
            )
        taken = [_span(s) for s in filled.get(target.param, set()) if s is not None]
        if any(a < into[1] and into[0] < b for a, b in taken):
            raise _Misfit(
                f"{name}: rows {into[0]}:{into[1]} of {canon} are given twice ({use.origin})"
            )
        target = target._replace(rows=slice(*into), shard=f"rows {into[0]}:{into[1]}")
    if target.shard in filled.get(target.param, set()):
        raise _Misfit(f"{name}: {canon} is given twice (by {use.origin})")
    b = Bound(name, canon, use.entry, target, False)
    meta = torch.empty(source.shape(name), device="meta")
    try:
        fitted = _fit(model, b, meta, _dest_shape(params[target.param], target.rows))
    except _Misfit as e:
        raise _Misfit(f"{e} (mapped by {use.origin})") from None
    as_stored = fitted is meta and use.entry.as_stored
    plan.parts.setdefault(target.param, []).append(b._replace(as_stored=as_stored))
    filled.setdefault(target.param, set()).add(target.shard)
    return True


def _span(shard: str) -> tuple[int, int]:
    """(start, stop) of a "rows a:b" part (a tensor concatenated into a parameter)."""
    if not shard.startswith("rows "):
        return (0, 0)
    a, b = shard[5:].split(":")
    return int(a), int(b)


def _report(
    params: dict[str, nn.Parameter],
    filled: dict[str, set[str | None]],
    errors: list[str],
    unused: list[str],
) -> None:
    missing: list[str] = []
    unfilled: set[str] = set()
    for pname in params:
        got = filled.get(pname, set())
        linear = pname.rpartition(".")[0].rpartition(".")[2]
        need = set(SHARDS.get(linear, (None,)))
        if None in got:
            continue
        spans = sorted(_span(s) for s in got if s is not None and s.startswith("rows "))
        if spans:  # concatenated parts: every row exactly once (overlaps were refused)
            n, gaps, at = params[pname].shape[0], [], 0
            for a, b in [*spans, (params[pname].shape[0], 0)]:
                if a > at:
                    gaps.append(f"{at}:{a}")
                at = max(at, b)
            if gaps:
                unfilled.add(pname)
                missing.append(f"{pname} (rows {', '.join(gaps)} of {n})")
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


def stored_blocks(source: WeightSource, parts: Sequence[Bound], rows: int) -> QuantTensor | None:
    """The checkpoint's own blocks for a whole parameter of ``rows`` rows, when every part is
    stored quantized in one format and lands as stored; else None."""
    blocks = stored_parts(source, parts)
    if blocks is None:
        return None
    from inferflow.quant.apply import stack_rows

    return stack_rows(blocks, rows)


def stored_parts(source: WeightSource, parts: Sequence[Bound]) -> dict[int, QuantTensor] | None:
    """The checkpoint's quantized row blocks of a parameter by first row, when every part is
    stored quantized and lands as stored; else None."""
    if not parts or not all(b.as_stored for b in parts):
        return None
    blocks: dict[int, QuantTensor] = {}
    for b in parts:
        w = source.get(b.name)
        if not isinstance(w, QuantTensor):
            return None
        blocks[0 if b.target.rows is None else b.target.rows.start] = w
    return blocks


def read_param(
    model: nn.Module, source: WeightSource, param: nn.Parameter, parts: Sequence[Bound]
) -> torch.Tensor:
    """The parameter's values, read from the checkpoint into one tensor of its dtype."""
    out = torch.empty(param.shape, dtype=param.dtype)
    for b in parts:
        w = source.get(b.name)
        t = w.dequantize() if isinstance(w, QuantTensor) else w
        dest = out if b.target.rows is None else out[b.target.rows]
        with torch.no_grad():
            dest.copy_(_fit(model, b, t, dest.shape))
    return out


def set_param(model: nn.Module, pname: str, value: torch.Tensor) -> None:
    path, _, leaf = pname.rpartition(".")
    module = model.get_submodule(path) if path else model
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
