"""A step's rows (decode tokens, prompt rows) through a whole decoder stack in a single C call.

A decode step is a few hundred small torch ops (norms, four projections, rotary embedding,
cache write, attention, gating, residuals, per layer), and at these sizes their dispatch costs
more than their arithmetic; a prompt step's rows pay the same dispatch per layer, and a step
with both kinds read every weight twice. ``FusedDecode`` runs every layer of a stack in one
call of ``decode_stack`` (inferflow/kernels/quant_decode.c) when the stack is one it implements,
for every row of a step (inferflow.model.stack sends them all here, alone or many, prompt rows
and decode rows alike: the module path's operations, bit for bit, tests/test_fused.py):

- residual ``pre_norm`` with ``rms`` / ``rms_offset`` norms (one eps for the stack);
- attention without bias, q/k-norm, sliding window, soft-cap or additive position bias, with
  ``rope`` (either pairing, partial rotary, any scaling: cos / sin come from the rope block);
- ``gated`` FFN with ``silu``;
- every projection a ``QuantLinear`` with a C plane (an affine format: Q2-Q8, Q3H, GGML Q4_0 ..
  Q8_0, Q2_K .. Q6_K), whole (no tensor-parallel split), float32 activations on the CPU; a bias
  on the q/k/v projection only (Qwen2's), added to its outputs as the module does.

Anything else keeps the module path; ``FusedDecode.build`` logs why once. Embedding, final norm
and head stay in torch. The math is float32 on the codec's exact weights, so it equals the
module path with ``dequantize()``-d float weights up to summation order (tests/test_fused.py);
its products are QuantLinear's plane arithmetic, bit for bit.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.nn import functional as F

from inferflow.blocks import RESIDUALS
from inferflow.blocks.ffn import GatedFFN
from inferflow.blocks.norm import RMSNorm
from inferflow.blocks.position import Rotary
from inferflow.kernels import KV_FORMATS
from inferflow.kernels.quant_decode import CDims, CLayer, CQMat, QPlane, library
from inferflow.model.batch import FlatBatch

if TYPE_CHECKING:
    from inferflow.model.stack import Layer, Stack

log = logging.getLogger(__name__)


class _Parts(NamedTuple):
    attn_norm: RMSNorm
    ffn_norm: RMSNorm
    planes: list[QPlane]  # wqkv, wo, w13, w2
    qkv_bias: torch.Tensor | None  # float32, contiguous
    tails: list[QPlane | None]  # wqkv's and w13's later rows in a plane of their own, or None


def _layer_parts(layer: Layer) -> _Parts | str:
    """What the kernel reads of one layer, or why it cannot run it."""
    a, f = layer.self_attn, layer.feed_forward
    if layer.wiring is not RESIDUALS.get("pre_norm") or layer.cross_attn is not None:
        return "residual wiring other than pre_norm, or cross-attention"
    if layer.reduce is not None or a.split.size > 1:
        return "a tensor-parallel layer"
    if layer.mix is not None or layer.attn_gate is not None:
        return "learned residual gates"
    if a.a.qk_norm is not None or a.a.window is not None or a.a.softcap is not None:
        return "q/k-norm, sliding window or soft-cap"
    if not a.a.causal:
        return "bidirectional attention"
    if not isinstance(f, GatedFFN) or f.act is not F.silu:
        return "an FFN other than gated silu"
    norms = (layer.attn_norm, layer.ffn_norm)
    if not (isinstance(norms[0], RMSNorm) and isinstance(norms[1], RMSNorm)):
        return "norms other than rms"
    mods = (a.wqkv, a.wo, f.w13, f.w2)
    planes = [getattr(m, "plane", None) for m in mods]
    if not all(isinstance(p, QPlane) for p in planes):
        return "a projection without a C plane (float, or a non-affine format)"
    if any(m.bias is not None for m in mods[1:]):
        return "a bias on the output, FFN or down projection (q/k/v biases are read)"
    tails = [getattr(m, "tail", None) for m in mods]
    if tails[1] is not None or tails[3] is not None:
        return "an output or down projection in two planes (q/k/v's and the gated FFN's are read)"
    bias = None if a.wqkv.bias is None else a.wqkv.bias.detach().float().contiguous()
    held = [p for p in planes if isinstance(p, QPlane)]
    second = [None if t is None else t.plane for t in (tails[0], tails[2])]
    return _Parts(norms[0], norms[1], held, bias, second)


def _stack_parts(stack: Stack) -> list[_Parts] | str:
    """What the kernel reads of every layer, or the first reason it cannot run the stack."""
    if library() is None:
        return "the C kernel is not available"
    if not isinstance(stack.pos_embed, Rotary) or stack.pos_embed.has_bias:
        return f"position {type(stack.pos_embed).__name__} (rope only)"
    parts = []
    for layer in stack.layers():
        p = _layer_parts(layer)
        if isinstance(p, str):
            return p
        parts.append(p)
    if len({(n.eps, n.offset) for p in parts for n in (p.attn_norm, p.ffn_norm)}) > 1:
        return "norms with different eps or offsets"
    return parts


class FusedDecode:
    def __init__(self, stack: Stack, parts: list[_Parts]) -> None:
        first = stack.layers()[0]
        a, ffn, rope, norm = (
            first.self_attn,
            first.feed_forward,
            stack.pos_embed,
            parts[0].attn_norm,
        )
        assert isinstance(rope, Rotary) and isinstance(ffn, GatedFFN)
        self.rope = rope
        self.qkv = a.wqkv  # (its act8 says whether the products take 8-bit inputs)
        self.dims = CDims(
            a.a.hidden, a.n_heads, a.n_kv_heads, a.a.head_dim, ffn.inner, rope.rotary_dim,
            int(rope.pairing == "adjacent"), norm.eps, norm.offset, a.scale,
        )  # fmt: skip
        self.layers = (CLayer * len(parts))()
        self._work = torch.empty(0)
        # what the structs point at: norm weights, and the planes (alive while this object is,
        # whatever happens to the modules that made them)
        self._keep: list[torch.Tensor | QPlane] = []
        for i, p in enumerate(parts):
            ws = [n.weight.detach().float().contiguous() for n in (p.attn_norm, p.ffn_norm)]
            self._keep += [*ws, *p.planes, *(t for t in p.tails if t is not None)]
            mats = [CQMat.from_buffer_copy(q.struct) for q in p.planes]
            tails = [CQMat() for _ in p.tails]  # (n 0: none)
            for j, (at, tail) in enumerate(zip((0, 2), p.tails, strict=True)):
                if tail is not None:  # both planes write the output's rows (their stride)
                    tails[j] = CQMat.from_buffer_copy(tail.struct)
                    mats[at].ldy = tails[j].ldy = mats[at].n + tail.n
            bias = None
            if p.qkv_bias is not None:
                self._keep.append(p.qkv_bias)
                bias = p.qkv_bias.data_ptr()
            self.layers[i] = CLayer(ws[0].data_ptr(), ws[1].data_ptr(), *mats, bias, *tails)

    @classmethod
    def build(cls, stack: Stack) -> FusedDecode | None:
        parts = _stack_parts(stack)
        if isinstance(parts, str):
            log.info("fused decode is off for this stack: %s", parts)
            return None
        return cls(stack, parts)

    def run(
        self, x: torch.Tensor, batch: FlatBatch, rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The stack's output (N, hidden) for the batch's rows (decode tokens, prompt rows:
        each a position of its sequence), or None where the batch's KV views cannot be read by
        the kernel (then the module path runs). ``rows`` (strictly increasing, as
        Stack.run_layers sees to): only their outputs, (len(rows), hidden); the last layer
        attends and runs its products for them alone (every row's K/V still written)."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        kv = row_slots(batch)
        if kv is None:
            return None
        k, v, slots, which, lens = kv
        self.dims.kv_format = KV_FORMATS[k.dtype]
        self.dims.act_q8 = int(getattr(self.qkv, "act8", False))
        B, S = len(lens), slots.shape[1]
        cos, sin = self.rope.cos_sin(batch.positions, torch.float32)
        cos, sin = cos.reshape(B, -1).contiguous(), sin.reshape(B, -1).contiguous()
        out = x.reshape(B, -1).clone()
        keep = None if rows is None else rows.to(torch.int64).contiguous()
        threads, lib = torch.get_num_threads(), library()
        assert lib is not None
        dims = ctypes.byref(self.dims)
        scratch = self._scratch(lib.decode_stack_scratch(dims, B, S, threads))
        lib.decode_stack(
            self.layers, len(self.layers), dims, B, out.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(), k[0].nbytes,
            slots.data_ptr(), None if which is None else which.data_ptr(), S, lens.data_ptr(),
            None if keep is None else keep.data_ptr(), 0 if keep is None else keep.numel(),
            scratch.data_ptr(), threads,
        )  # fmt: skip
        return out if keep is None else out[: keep.numel()]

    def _scratch(self, n: int) -> torch.Tensor:
        """n floats of working memory, kept between calls: a prompt step's rows need tens of
        MiB, which as a fresh allocation each call would be fresh pages each call (glibc maps
        blocks past 32 MiB anew)."""
        if self._work.numel() < n:
            self._work = torch.empty(n, dtype=torch.float32)
        return self._work


def row_slots(
    batch: FlatBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """For the batch's rows (each a position of its sequence: a decode step's token, a prompt's
    rows): every layer's K and V (layers, slots, KV heads, D) float32, float16 or Q8_0 blocks,
    slot lists (lists, S) int64, which list each row reads ((N,) int64; None: row b reads list
    b) and lens (N,): row b's keys are the first lens[b] slots of its list (positions 0 .. its
    own), the last where its K/V go. None where a view cannot say (a group view's
    ``slot_table()``; ``decode_slots(position)``, the slots through a position, of
    ContiguousKVCache and the engine's paged views)."""
    lens = batch.positions + 1
    which = None
    if batch.group is not None:
        table = getattr(batch.group, "slot_table", None)
        if table is None:
            return None
        k, v, slots = table()
    else:
        views = [getattr(view, "decode_slots", None) for view in batch.kv]
        if any(f is None for f in views):
            return None
        # each sequence's list through its last row's position
        ends = [int(batch.positions[s.start + s.length - 1]) for s in batch.seqs]
        got = [f(e) for f, e in zip(views, ends, strict=True)]  # type: ignore[misc]
        k, v = got[0][0], got[0][1]
        if any(g[0] is not k or g[1] is not v for g in got):
            return None  # (sequences in different caches)
        slots = torch.zeros((len(got), max(g[2].numel() for g in got)), dtype=torch.long)
        for i, g in enumerate(got):
            slots[i, : g[2].numel()] = g[2]
        if any(s.length != 1 or s.start != i for i, s in enumerate(batch.seqs)):
            which = torch.empty(len(lens), dtype=torch.long)
            for i, s in enumerate(batch.seqs):
                which[s.start : s.start + s.length] = i
    if k.dtype not in KV_FORMATS:
        return None
    return k, v, slots.contiguous(), which, lens.contiguous()
