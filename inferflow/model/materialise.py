"""Give every parameter of a network built on the meta device its storage, once, in its final
form (``materialise``), following a ``WeightPlan`` (inferflow.model.binding).

With ``keep`` (the default for checkpoints stored quantized, e.g. GGUF Q4_1 / Q8_0 / Q4_K):

- a ``Linear`` whose weight the checkpoint stores in blocks of a format the fast kernels read
  (the C plane, or int4pack without it: the affine formats) becomes a ``QuantLinear`` holding
  one copy of those blocks in its kernel's layout;
  other formats (Q2_K, Q3_K, IQ types ...) are dequantized to float, which is faster on CPU than their
  dequantize-per-call path;
- a tied head (logits = h @ E^T) whose embedding E is stored so gets a QuantLinear over E's
  blocks, and E's lookups read that layer's C plane (one copy of the table; with int4pack, E
  keeps its own copy of the blocks); lookups dequantize the rows they read;
- an embedding stored quantized keeps its blocks unless a float tied head reads the table: the
  checkpoint's own bytes, a view of a memory-mapped file (GGUF), so only the rows lookups read
  become resident, as llama.cpp's mapped tables (the file must not be truncated while in use).

Everything else is read into a tensor of the run dtype, one parameter at a time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence

from torch import nn

from inferflow.blocks.linear import Embedding, Linear
from inferflow.errors import CheckpointError, WeightBindingError
from inferflow.loaders.base import WeightSource
from inferflow.model.binding import (
    Bound,
    WeightPlan,
    read_param,
    set_param,
    stored_blocks,
    stored_parts,
)
from inferflow.quant import ggml
from inferflow.quant.apply import (
    QuantPolicy,
    forget_fused,
    get_module,
    quantize_linear,
    rows_in_order,
    set_module,
)
from inferflow.quant.formats import FORMATS, QuantFormat
from inferflow.quant.linear import QuantLinear, kernel_bytes, select_kernel
from inferflow.quant.tensor import QuantTensor

log = logging.getLogger(__name__)


def _fast(qt: QuantTensor | None) -> QuantTensor | None:
    return qt if qt is not None and select_kernel(qt.qformat) != "dequant" else None


def _mixed_rows(
    source: WeightSource, parts: Sequence[Bound], mod: Linear
) -> list[QuantTensor] | None:
    """Row blocks of a linear weight stored in several formats, in row order and covering its
    rows (``QuantLinear.from_row_parts`` holds them in its planes); else None."""
    blocks = stored_parts(source, parts)
    if blocks is None or len(blocks) < 2:
        return None
    return rows_in_order(blocks, mod.out_features)


def materialise(
    model: nn.Module,
    source: WeightSource,
    plan: WeightPlan,
    keep: bool,
    kernel: str | None = None,
    ties: Sequence[tuple[str, str]] = (),
    policy: QuantPolicy | None = None,
) -> int:
    """Fill ``model`` (built on the meta device) from ``source``; returns how many linear
    layers kept the checkpoint's blocks. ``ties``: (head path, embedding path) pairs of tied
    heads, which are absent modules until a QuantLinear is put there. ``policy``: runtime
    quantization, applied to each linear layer as soon as its float weight is read."""
    check_memory(model, source, plan, available_memory())
    done: set[str] = set()  # parameters given storage (or replaced)
    kept, loading = 0, _Loading(source, plan)
    if keep:  # tied heads and quantized tables first: the largest tensors (see below)
        for head, embed in ties:
            if get_module(model, head) is not None:
                continue  # the head is not tied after all
            table = model.get_submodule(embed)
            assert isinstance(table, Embedding)
            rows = table.weight.shape[0]
            qt = _fast(stored_blocks(source, plan.parts.get(f"{embed}.weight", []), rows))
            if qt is not None:
                tied = QuantLinear(qt, None, kernel)
                set_module(model, head, tied)
                kept += 1
                if tied.plane is not None:  # one copy: lookups read the head's plane
                    table.share_plane(tied.plane)
                    done.add(f"{embed}.weight")
                    loading.finished(f"{embed}.weight")
        float_heads = {e for h, e in ties if get_module(model, h) is None}
        for path, mod in list(model.named_modules()):
            if isinstance(mod, Embedding) and path not in float_heads and mod.plane is None:
                pname = f"{path}.weight"
                qt = stored_blocks(source, plan.parts.get(pname, []), mod.weight.shape[0])
                if qt is not None:  # a view of a mapped file: rows resident once looked up
                    mod.keep_blocks(QuantTensor(qt.data, qt.format, qt.shape))
                    done.add(pname)
                    loading.finished(pname)
        # largest first: a tensor's file pages and its kernel's layout are both resident while
        # it is repacked, so the peak is lowest while little else is loaded yet
        linears = [(p, m) for p, m in model.named_modules() if type(m) is Linear]
        linears.sort(key=lambda pm: -pm[1].in_features * pm[1].out_features)
        for path, mod in linears:
            wparts = plan.parts.get(f"{path}.weight", [])
            qt = _fast(stored_blocks(source, wparts, mod.out_features))
            mixed = None if qt is not None or kernel else _mixed_rows(source, wparts, mod)
            if qt is None and mixed is None:
                continue
            bias = None
            if mod.bias is not None:
                bias = read_param(model, source, mod.bias, plan.parts[f"{path}.bias"])
            if mixed is not None:
                built = QuantLinear.from_row_parts(mixed, bias)
                if built is None:
                    continue
                set_module(model, path, built)
            else:
                assert qt is not None
                set_module(model, path, QuantLinear(qt, bias, kernel))
            done.update((f"{path}.weight", f"{path}.bias"))
            loading.finished(f"{path}.weight", f"{path}.bias")
            kept += 1
    for pname, param in list(model.named_parameters()):
        if pname in done:
            continue
        if pname not in plan.parts:
            raise WeightBindingError(f"{pname}: no checkpoint tensor fills it")
        set_param(model, pname, read_param(model, source, param, plan.parts[pname]))
        loading.finished(pname)
        if policy is not None:  # a linear layer whose parameters are all read: quantize it
            path = pname.rpartition(".")[0]
            lin = model.get_submodule(path)
            if type(lin) is Linear and not any(p.is_meta for p in lin.parameters()):
                q = quantize_linear(path, lin, policy)
                if q is not None:
                    set_module(model, path, q)
    forget_fused(model)
    log.info("%s", resident_summary(model, kept))
    return kept


def resident_bytes(model: nn.Module) -> tuple[int, int, int]:
    """Bytes the weights hold: quantized linear layers as their kernels read them (repacked
    copies included), float tensors, quantized embedding rows."""
    quant = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    floats = sum(p.nbytes for p in model.parameters())
    blocks = sum(
        m.blocks.data.nbytes
        for m in model.modules()
        if isinstance(m, Embedding) and m.blocks is not None
    )
    return quant, floats, blocks


def resident_summary(model: nn.Module, kept: int) -> str:
    """What the weights hold in memory, by kind: the kernels' copies are explicit."""
    quant, floats, blocks = (b / (1 << 20) for b in resident_bytes(model))
    return (
        f"weights resident: {quant + floats + blocks:.0f} MiB (quantized linear layers as "
        f"their kernels read them: {quant:.0f} MiB, {kept} of them over the checkpoint's "
        f"blocks; float tensors {floats:.0f} MiB; quantized embedding rows {blocks:.0f} MiB, "
        "resident as they are read where mapped from the file)"
    )


def _proc_kib(path: str, key: str) -> int | None:
    """The ``key: N kB`` line of a /proc file in bytes; None where the system does not say."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the system does not say."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def _block_format(dtype: str) -> QuantFormat | None:
    """The format of a tensor stored in quantized blocks (None: a plain dtype)."""
    f = FORMATS.get(dtype) if dtype in FORMATS else None
    return f if f is not None and f.block_size > 1 else None


def check_memory(
    model: nn.Module, source: WeightSource, plan: WeightPlan, available: int | None
) -> None:
    """Refuse, before anything is allocated, a load whose declared sizes need more memory than
    ``available``: a parameter stored in blocks of a format a fast kernel reads at its kernel's
    bytes (``kernel_bytes``), every other one at its dtype's size (it is read as float). The
    error names the largest tensors."""
    if available is None:
        return
    need: list[tuple[int, str]] = []
    for pname, parts in plan.parts.items():
        param = model.get_parameter(pname)
        size = param.numel() * param.element_size()
        names = {source.dtype_name(b.name) for b in parts}
        common = ggml.common_format(names)  # (parts stored in two formats that fuse into one)
        fmt = _block_format(common) if common is not None else None
        if fmt is not None and param.dim() >= 2:
            rows = param.shape[0]
            kept = kernel_bytes(fmt, rows, param.numel() // rows)
            size = size if kept is None else kept
        need.append((size, pname))
    total = sum(n for n, _ in need)
    if total > available:
        gib = 1 << 30
        largest = ", ".join(
            f"{name} {list(model.get_parameter(name).shape)} ({n / gib:.2f} GiB)"
            for n, name in sorted(need, reverse=True)[:3]
        )
        raise CheckpointError(
            f"loading this model needs about {total / gib:.1f} GiB and {available / gib:.1f} GiB "
            f"of memory is available; the largest tensors: {largest}"
        )


def peak_rss() -> int:
    """This process's peak resident memory in bytes: VmHWM of /proc/self/status, the high-water
    mark of this program's own memory. (``ru_maxrss`` also counts the parent's memory at the
    fork that started this process: a model loaded from a large test process reported the
    test process's 6 GiB.) Where /proc is absent, ``ru_maxrss``."""
    peak = _proc_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # (bytes on macOS, KiB on Linux)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    # looked up in the process itself (no library search, which starts a subprocess), on first
    # use (not at import: parsing a spec imports this module)
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def trim_heap() -> None:
    """glibc's malloc_trim(0), elsewhere nothing. Loading frees many large temporaries of mixed
    sizes; glibc keeps such freed memory in its heap (its mmap threshold grows after each large
    free), 0.65 GB of it after runtime-quantizing SmolLM2, unless trimmed. Called at most once a
    second while loading, and once loaded."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class _Loading:
    """Parameters in their final form: a source that maps its file lets their checkpoint
    tensors' pages go (a tied head and its table read one tensor twice: harmless), and a
    progress line is logged at most every PROGRESS_S seconds."""

    PROGRESS_S = 2.0
    TRIM_S = 0.2  # (each trim makes later allocations fault their pages in again: not too often)

    def __init__(self, source: WeightSource, plan: WeightPlan) -> None:
        self.release = getattr(source, "release", None)
        self.plan, self.total, self.count = plan, len(plan.parts), 0
        self.t0 = self.last = self.trimmed = time.perf_counter()
        self.trim_s = 0.0

    def finished(self, *params: str) -> None:
        now = time.perf_counter()
        if now - self.trimmed >= self.TRIM_S:  # freed temporaries back to the system
            trim_heap()
            self.trimmed = time.perf_counter()
            self.trim_s += self.trimmed - now
        for p in params:
            parts = self.plan.parts.get(p, ())
            self.count += bool(parts)
            if self.release is not None:
                for b in parts:
                    self.release(b.name)
        now = time.perf_counter()
        if now - self.last >= self.PROGRESS_S:
            self.last = now
            log.info(
                "loading weights: %d%% (%d of %d tensors) after %.1f s",
                100 * self.count // max(1, self.total),
                self.count,
                self.total,
                now - self.t0,
            )
