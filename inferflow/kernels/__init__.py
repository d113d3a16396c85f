"""Small C kernels for work torch has no fast CPU op for, compiled on first use.

Each kernel is one C file in this folder, built with the machine's C compiler (``$CC``, else
``cc``) into ``$INFERFLOW_KERNEL_CACHE`` (default ``~/.cache/inferflow/kernels``), keyed by the
source, the flags and the CPU, and called through ctypes (which releases the GIL). A build
writes a temporary file and renames it, so processes building at once never load half a file.
The building itself is ``inferflow.kernel_build`` (no torch), which the CLI calls before it
imports torch: a command that runs a model compiles the kernels it lacks meanwhile.

Every kernel is optional: where no compiler works, or ``INFERFLOW_KERNELS=0``, the loader logs
why once and returns None, and callers keep their torch path (tests cover both).

- ``paged_decode_attention``: one decode step's attention read straight from the paged KV
  cache's blocks (``paged_attention.c``, one query head at a time by ``attend.h``, which the
  one-token decoder stack shares; with AVX-512 and heads of a multiple of 16 dims the query and
  its output stay in registers). The torch path gathers
  every sequence's keys and values into a padded copy first. On the 2-core test machine a step
  of 32 sequences of 96-160 tokens (9 query / 3 KV heads of 64) takes 0.15 ms a layer here
  against 0.99 ms, and with one sequence of 2048 among them 0.21 ms against 45 ms
  (``benchmarks/decode_attention.py``; the torch times vary up to 2x between runs there).
- ``rows``: row-wise ops torch runs as several kernels: rotary embedding in place
  (``rope_in_place``, bit for bit the torch path) and RMS norm (``rms_norm``).
- ``quant_decode`` (``quant_decode.py``): products over affine-quantized weights (QuantLinear's
  ``plane``: float32, each row the same operations whatever the batch), and the decode rows of
  a step through every layer of a pre-norm decoder in one call (inferflow.model.fused).
- ``quant_search``: the searching quantizer of Inferflow's min-max formats
  (inferflow.quant.minmax), one block at a time instead of torch passes over the whole tensor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Protocol

import torch

from inferflow.kernel_build import FLAGS, HERE, compile_kernel, enabled

log = logging.getLogger(__name__)


def build(name: str) -> Path:
    """Compile ``name``.c (once per source, the folder's headers, flags and CPU) and return the
    shared library (waiting for a build ``kernel_build.prebuild`` started)."""
    return compile_kernel(HERE, name, FLAGS)


@cache
def _library(name: str) -> ctypes.CDLL | None:
    if not enabled():
        log.info("C kernels are off (INFERFLOW_KERNELS=%s)", os.environ.get("INFERFLOW_KERNELS"))
        return None
    try:
        return ctypes.CDLL(str(build(name)))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("C kernel %s is not available, using the torch path instead: %s", name, e)
        return None


class PagedDecode(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        which: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


# The KV caches the C kernels read (paged_decode, decode_stack), by the cache tensor's dtype:
# the kind number both take. uint8: GGML Q8_0 blocks (inferflow.engine.kv_cache.KVFormat "q8").
KV_FORMATS = {torch.float32: 0, torch.uint8: 1, torch.float16: 2}


@cache
def paged_decode_attention(cache: torch.dtype = torch.float32) -> PagedDecode | None:
    """``f(q (B, H, D), k_cache, v_cache (slots, KVH, D), slots (B, S) int64, lens (B,) int64,
    scale) -> (B, H, D)``, q and the result float32 on the CPU, the caches of dtype ``cache``:
    float32, float16 (each value read exactly), or uint8 (slots, KVH, D / 32 * 34), GGML Q8_0
    blocks: sequence b attends over the keys in its first lens[b] slots (every one visible);
    slots (S,): every row reads that one list; ``which`` (B,) int64: row b reads list
    which[b] of slots (L, S) (the rows of several prompts, each its sequence's list). Each
    row's result is the same bits whatever else is in the call. None where the kernel cannot
    be built."""
    lib = _library("paged_attention")
    if lib is None:
        return None
    fn, kind = lib.paged_decode, KV_FORMATS[cache]
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
    fn.argtypes += [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int

    def run(
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        which: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, H, D = q.shape
        KVH = kc.shape[1]
        q, slots, lens = q.contiguous(), slots.contiguous(), lens.contiguous()
        if not (kc.is_contiguous() and vc.is_contiguous()):
            raise ValueError("paged_decode_attention: the cache layers must be contiguous")
        if which is not None:  # (every list it names must exist: the kernel reads them)
            which = which.contiguous()
            lists = slots.shape[0] if slots.dim() == 2 else 0
            if which.shape != (B,) or B and not 0 <= int(which.min()) <= int(which.max()) < lists:
                raise ValueError(
                    f"paged_decode_attention: which must name one of the {lists} slot lists "
                    f"for each of the {B} rows"
                )
        out = torch.empty_like(q)
        stride = 0 if slots.dim() == 1 else slots.shape[1]  # (S,): one list every row reads
        failed = fn(
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(),
            None if which is None else which.data_ptr(), lens.data_ptr(),
            B, stride, H, KVH, D, scale, out.data_ptr(), torch.get_num_threads(), kind,
        )  # fmt: skip
        if failed:
            raise MemoryError("paged_decode_attention: out of memory for the scores")
        return out

    return run


RopeInPlace = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]


@cache
def rope_in_place() -> RopeInPlace | None:
    """``f(x (N, heads, D), cos, sin (N, rd / 2), adjacent)``: rotates the first rd dims of every
    head of x in place (float32 on the CPU; heads contiguous, rows any stride), bit for bit as
    ``Rotary``'s torch path. None where the kernel cannot be built."""
    lib = _library("rows")
    if lib is None:
        return None
    fn = lib.rope_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
    fn.restype = None

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjacent: bool) -> None:
        N, heads, D = x.shape
        if (
            x.stride(2) != 1
            or x.stride(1) != D
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError("rope_in_place: heads must be contiguous and cos / sin too")
        fn(x.data_ptr(), N, x.stride(0), heads, D, 2 * cos.shape[-1], cos.data_ptr(),
           sin.data_ptr(), int(adjacent), torch.get_num_threads())  # fmt: skip

    return run


RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@cache
def rms_norm() -> RmsNorm | None:
    """``f(x (N, D), weight (D,), eps) -> (N, D)``: RMS norm of each row (float32 on the CPU,
    contiguous), torch's order of operations but one pass instead of torch's six kernels. None
    where the kernel cannot be built."""
    lib = _library("rows")
    if lib is None:
        return None
    fn = lib.rms_norm_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = None

    def run(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        N, D = x.shape
        out = torch.empty_like(x)
        fn(x.data_ptr(), N, D, weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
        return out

    return run


def cpu_float32(*ts: torch.Tensor) -> bool:
    """Whether the row kernels (rms_norm, silu_gate) may read these tensors: contiguous float32
    on the CPU, outside autograd."""
    plain = all(
        t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in ts
    )
    return plain and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


SiluGate = Callable[[torch.Tensor], torch.Tensor]


@cache
def silu_gate() -> SiluGate | None:
    """``f(h (N, 2F)) -> (N, F)``: SiLU(h[:, :F]) * h[:, F:] (the gated FFN's [gate | up] rows;
    float32 on the CPU, contiguous), each value the scalar expression with rows.h's expf (within
    2 ulp; the same bits in every build): the one-call decode's gate is the same code. None where
    the kernel cannot be built."""
    lib = _library("rows")
    if lib is None:
        return None
    fn = lib.silu_gate_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    fn.restype = None

    def run(h: torch.Tensor) -> torch.Tensor:
        N, F2 = h.shape
        out = torch.empty((N, F2 // 2), dtype=h.dtype)
        fn(h.data_ptr(), N, F2 // 2, out.data_ptr(), torch.get_num_threads())
        return out

    return run


SearchBlocks = Callable[[torch.Tensor, torch.Tensor | None, int], tuple[torch.Tensor, torch.Tensor]]


@cache
def search_blocks() -> SearchBlocks | None:
    """``f(x (n, B), importance (n, B) or None, top) -> (head (n, 2) float16: min, scale; codes
    (n, B) uint8 in [0, top])``: minmax.py's search of each block's grid (float32, contiguous,
    finite and within float16's range; B <= 256). None where the kernel cannot be built."""
    lib = _library("quant_search")
    if lib is None:
        return None
    fn = lib.search_blocks_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int

    def run(
        x: torch.Tensor, importance: torch.Tensor | None, top: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, B = x.shape
        x = x.to(torch.float32).contiguous()
        imp = None if importance is None else importance.to(torch.float32).contiguous()
        head = torch.empty(n, 2, dtype=torch.float16)
        codes = torch.empty(n, B, dtype=torch.uint8)
        imp_ptr = None if imp is None else imp.data_ptr()
        if fn(x.data_ptr(), imp_ptr, n, B, top, head.data_ptr(), codes.data_ptr(),
              torch.get_num_threads()):  # fmt: skip
            raise ValueError(f"search_blocks: blocks of {B} values (at most 256)")
        return head, codes

    return run


def causal_rows(
    kernel: PagedDecode,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    which: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query rows q (T, H, D) at ``positions`` (T,) over the keys whose
    slots ``slots`` lists by position ((S,): one sequence; (T, S): each row's own; (L, S) with
    ``which`` (T,): row t's is list which[t]), within ``window`` positions where one is given:
    every row by the decode kernel, so a row's result does not depend on how its sequence was
    chunked or batched."""
    if window is None:
        return kernel(q, kc, vc, slots, positions + 1, scale, which)
    lo = (positions - window + 1).clamp(min=0)
    lens = positions + 1 - lo
    idx = lo[:, None] + torch.arange(int(lens.max()))
    idx = idx.clamp(max=slots.shape[-1] - 1)  # (past a row's lens: never read)
    if which is not None:
        slots = slots[which]
    rows = slots.expand(len(positions), -1) if slots.dim() == 1 else slots
    return kernel(q, kc, vc, rows.gather(1, idx), lens, scale)


def decode_attention_for(cache: torch.Tensor) -> PagedDecode | None:
    """``paged_decode_attention`` where it can read this KV cache (float32, float16, or uint8:
    Q8_0 blocks, inferflow.engine.kv_cache.KVFormat "q8"; on the CPU), else None."""
    if cache.device.type != "cpu" or cache.dtype not in KV_FORMATS:
        return None
    return paged_decode_attention(cache.dtype)
