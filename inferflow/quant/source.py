"""Quantization at load time (``--quant FMT``) as a view of the checkpoint: ``QuantizingSource``
reads each tensor as ``inferflow quantize`` would write it (``quant.targets`` picks its format,
the same ``method`` and importance matrix choose its codes), so loading through it gives the
model that loading the quantized file gives, block for block, without writing the file: linear
weights become QuantLinears over those blocks, a tied head and its table share them, an
embedding keeps them for its lookups (``model.materialise``'s keep path).

``quantize_on_load`` sets it up for ``load_model``: every tensor's format as ``quantize`` picks
it (``tensor_formats``: the default mix, the head, the embeddings, fallbacks), then the spec's
``quant.overrides`` by canonical module path (a tied head's override is its table's). A linear
weight that does not land as stored (transposed, reordered, a tensor-parallel slice) is not
packed in the view, whose blocks it could not keep: it is quantized after it is read, in its
checkpoint tensors' format (the most bits of them), without the importance matrix (whose columns
are the stored tensor's).

A tensor is packed when it is read, one at a time; the packed copy is kept until the loader
releases that tensor (a fused q/k/v reads its parts twice: once to look at their formats, once
to join them), so the float values of one tensor at most exist at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from inferflow.loaders.base import Weight, WeightSource
from inferflow.quant.apply import QuantPolicy
from inferflow.quant.formats import QuantFormat, get_format
from inferflow.quant.targets import is_quant, tensor_formats
from inferflow.quant.tensor import QuantTensor

if TYPE_CHECKING:
    from inferflow.imatrix import ImportanceMatrix
    from inferflow.model.binding import WeightPlan
    from inferflow.spec.types import QuantSpec

log = logging.getLogger(__name__)


class QuantizingSource:
    """``inner``'s tensors, each packed in ``targets[name]`` (None: float32 where stored
    packed), with ``method`` and ``imatrix``'s importance of that name; tensors ``targets``
    does not name as ``inner`` holds them."""

    def __init__(
        self,
        inner: WeightSource,
        targets: Mapping[str, QuantFormat | None],
        method: str,
        imatrix: ImportanceMatrix | None = None,
    ) -> None:
        self.inner, self.targets = inner, dict(targets)
        self.method, self.imatrix = method, imatrix
        self._packed: dict[str, Weight] = {}

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.inner.metadata

    def names(self) -> list[str]:
        return self.inner.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def dtype_name(self, name: str) -> str:
        stored = self.inner.dtype_name(name)
        if name not in self.targets:
            return stored
        target = self.targets[name]
        return target.name if target is not None else "F32" if is_quant(stored) else stored

    def get(self, name: str) -> Weight:
        if name in self._packed:
            return self._packed[name]
        from inferflow.convert import as_float, quantize_rows

        w = self.inner.get(name)
        if name not in self.targets:
            return w
        target = self.targets[name]
        if target is None:
            return as_float(w)
        imp = self.imatrix.importance(name) if self.imatrix is not None else None
        data = quantize_rows(w, target, self.method, imp)
        packed = QuantTensor(data, target.name, tuple(w.shape))
        self._packed[name] = packed
        return packed

    def release(self, name: str) -> None:
        """The loader is done with ``name``: its packed copy (and the file's pages) may go."""
        self._packed.pop(name, None)
        release = getattr(self.inner, "release", None)
        if release is not None:
            release(name)

    def __iter__(self) -> Iterator[tuple[str, Weight]]:
        for name in self.names():
            yield name, self.get(name)

    def close(self) -> None:
        self._packed.clear()
        self.inner.close()


def quantize_on_load(
    source: WeightSource,
    plan: WeightPlan,
    quant: QuantSpec,
    ties: Sequence[tuple[str, str]] = (),
) -> tuple[QuantizingSource, QuantPolicy | None]:
    """The view ``load_model`` reads ``source`` through for ``quant`` (module docstring), and
    the policy for linear weights quantized after they are read (None: there are none)."""
    matrix = None
    if quant.imatrix is not None:
        from inferflow.imatrix import ImportanceMatrix

        matrix = ImportanceMatrix.read(quant.imatrix)
        matrix.check(source, f"--imatrix {quant.imatrix}")  # by the checkpoint's own names
    default = get_format(quant.weights) if quant.weights else None
    # checkpoint tensor -> the module paths it fills (a tied table's: its head's too)
    heads = {embed: head for head, embed in ties}
    modules: dict[str, list[str]] = {}
    for pname, parts in plan.parts.items():
        module = pname.rpartition(".")[0]
        for b in parts:
            paths = modules.setdefault(b.name, [])
            paths.append(module)
            if module in heads:
                paths.append(heads[module])
    rules: list[tuple[str, QuantFormat | None]] = []
    for name, paths in modules.items():
        chosen = [f for p, f in quant.overrides if any(fnmatchcase(m, p) for m in paths)]
        if chosen:  # (the last matching override wins)
            rules.append((name, get_format(chosen[-1]) if chosen[-1] else None))
    targets = tensor_formats(source, default, rules, "quant.overrides")
    if default is None and quant.checkpoint == "keep":  # overrides alone: the rest as stored
        targets = {name: fmt for name, fmt in rules if name in targets}
    after: list[tuple[str, str | None]] = []
    for pname, parts in plan.parts.items():
        if all(b.as_stored for b in parts):
            continue
        fmts = [f for b in parts if (f := targets.pop(b.name, None)) is not None]
        if fmts and pname.endswith(".weight"):
            best = max(fmts, key=lambda f: f.bits_per_weight)
            after.append((pname.rpartition(".")[0], best.name))
    packed = sum(f is not None for f in targets.values())
    log.info(
        "quantizing %d tensors as they are read (%s, method %s%s)%s",
        packed,
        quant.weights or "overrides only",
        quant.method,
        f", importance matrix {quant.imatrix}" if matrix is not None else "",
        f"; {len(after)} linear weights after reading (they do not land as stored)"
        if after
        else "",
    )
    policy = None
    if after:
        policy = QuantPolicy(None, after, kernel=quant.kernel, method=quant.method)
    return QuantizingSource(source, targets, quant.method, matrix), policy
