"""Self-attention: MHA / GQA / MQA follow from n_heads vs n_kv_heads.

Q, K and V live in one fused ``wqkv`` parameter, rows ordered [q; k; v]. Checkpoints with
separate projections load into it by shard id; checkpoints with a fused tensor name their row
layout (``qkv_layout``) and are reordered on load. Attention runs per sequence against that
sequence's cached keys (the flat-batch contract in ``inferflow.model.batch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from inferflow.blocks.linear import Linear
from inferflow.blocks.norm import NORMS, NormFactory
from inferflow.blocks.options import Options
from inferflow.blocks.position import PositionBlock
from inferflow.blocks.split import WHOLE, TensorSplit
from inferflow.model.batch import FlatBatch

QKV_LAYOUTS = ("concat", "per_head", "per_group")
ATTN_BIAS = ("none", "qkv", "all")


@dataclass(frozen=True)
class AttentionOptions(Options):
    """``network.attention``: how every attention layer of the network is made."""

    bias: str = field(
        default="none",
        metadata={
            "doc": "none; qkv: on q, k, v; all: on the output too",
            "choices": lambda: ATTN_BIAS,
        },
    )
    qkv_layout: str = field(
        default="concat",
        metadata={
            "doc": "a checkpoint's fused qkv rows: concat [q; k; v], per_head (BLOOM), "
            "per_group (Falcon)",
            "choices": lambda: QKV_LAYOUTS,
        },
    )
    qk_norm: str | None = field(
        default=None,
        metadata={"doc": "a norm applied per head to q and k", "choices": lambda: NORMS.names()},
    )
    sliding_window: bool | int = field(
        default=False,
        metadata={"doc": "true: the checkpoint's window size; a number; false: none"},
    )
    global_every: int | None = field(
        default=None,
        metadata={
            "doc": "with a window: layers i with (i + 1) % N == 0 see everything",
            "schema": {"type": "integer", "minimum": 1},
        },
    )
    softcap: float | None = field(default=None, metadata={"doc": "tanh soft-cap of the scores"})
    scale: float | None = field(
        default=None, metadata={"doc": "score scale (unset: 1 / sqrt(head_dim))"}
    )


@dataclass(frozen=True)
class AttnArgs:
    layer: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    bias: str = "none"  # none | qkv | all
    qkv_layout: str = "concat"  # row layout of a checkpoint's fused qkv tensor
    qk_norm: NormFactory | None = None
    norm_eps: float = 1e-6
    window: int | None = None  # keys with q_pos - k_pos < window are visible
    softcap: float | None = None
    scale: float | None = None
    causal: bool = True  # False in encoders: every token sees the whole sequence
    memory_hidden: int = 0  # cross-attention: the encoder output's width (0: hidden)


def split_fused_qkv(
    w: torch.Tensor, layout: str, n_heads: int, n_kv: int, head_dim: int
) -> torch.Tensor:
    """Reorder a checkpoint's fused qkv rows (weight or bias) into [q; k; v]."""
    if layout == "concat":
        return w
    rest = w.shape[1:]
    if layout == "per_head":  # [q_h; k_h; v_h] for each head (GPT-NeoX, BLOOM); MHA only
        x = w.reshape(n_heads, 3, head_dim, *rest)
        return torch.cat([x[:, i].reshape(n_heads * head_dim, *rest) for i in range(3)])
    # per_group: [q_g*r .. q_g*r+r-1; k_g; v_g] for each KV group (Falcon)
    r = n_heads // n_kv
    x = w.reshape(n_kv, r + 2, head_dim, *rest)
    q = x[:, :r].reshape(n_heads * head_dim, *rest)
    return torch.cat(
        [q, x[:, r].reshape(n_kv * head_dim, *rest), x[:, r + 1].reshape(n_kv * head_dim, *rest)]
    )


def attend(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (S, KVH, D)
    v: torch.Tensor,  # (S, KVH, D)
    q_pos: torch.Tensor,  # (T,)
    k_pos: torch.Tensor,  # (S,)
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,  # (H, T, S) additive
    causal: bool = True,
) -> torch.Tensor:
    """Attention of one sequence's new queries over its keys (causal unless told otherwise);
    returns (T, H, D)."""
    T, H, _ = q.shape
    S, KVH, _ = k.shape
    # (T, S) visibility; None: every key is visible (an encoder without a window)
    visible = k_pos[None, :] <= q_pos[:, None] if causal else None
    if window is not None:
        near = (q_pos[:, None] - k_pos[None, :]) < window
        visible = near if visible is None else visible & near
    if visible is not None and T == 1 and bool(visible.all()):
        visible = None  # decode step with every key visible: no mask work at all
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H|KVH, T|S, D)
    if softcap is None:
        mask = None
        if visible is not None:
            mask = torch.zeros((T, S), dtype=q.dtype, device=q.device).masked_fill(
                ~visible, float("-inf")
            )
        if bias is not None:
            mask = bias.to(q.dtype) if mask is None else mask + bias.to(q.dtype)
        out = F.scaled_dot_product_attention(
            qh[None], kh[None], vh[None], attn_mask=mask, scale=scale, enable_gqa=H != KVH
        )[0]
        return out.transpose(0, 1)
    # soft-capped logits (Gemma 2): tanh(s / cap) * cap before the mask, so no fused kernel
    if H != KVH:
        kh, vh = kh.repeat_interleave(H // KVH, 0), vh.repeat_interleave(H // KVH, 0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(s.dtype)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, vh).transpose(0, 1)


def attend_decode_group(
    q: torch.Tensor,  # (B, H, D): one new query per sequence
    k: torch.Tensor,  # (B, S, KVH, D) padded keys
    v: torch.Tensor,
    q_pos: torch.Tensor,  # (B,)
    k_pos: torch.Tensor,  # (B, S)
    valid: torch.Tensor,  # (B, S) False on padding
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,  # (B, H, 1, S) additive (ALiBi)
) -> torch.Tensor:
    """One masked attention call for a whole decode step instead of one per sequence."""
    B, H, D = q.shape
    KVH = k.shape[2]
    visible = valid & (k_pos <= q_pos[:, None])
    if window is not None:
        visible &= (q_pos[:, None] - k_pos) < window
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))[
        :, None, None, :
    ]
    if bias is not None:
        mask = mask + bias.to(q.dtype)
    qh, kh, vh = q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KVH, 1|S, D)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=H != KVH
        )
        return out[:, :, 0, :]
    if H != KVH:
        kh, vh = kh.repeat_interleave(H // KVH, 1), vh.repeat_interleave(H // KVH, 1)
    s = torch.tanh(torch.matmul(qh, kh.transpose(-1, -2)) * scale / softcap) * softcap + mask
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), vh)[:, :, 0, :]


class Attention(nn.Module):
    """With a tensor-parallel ``split`` it holds this rank's heads only (inferflow.blocks.split);
    ``wo``'s output is then a partial sum the caller reduces across the group."""

    def __init__(self, a: AttnArgs, split: TensorSplit = WHOLE) -> None:
        super().__init__()
        self.a, self.split = a, split
        self.n_heads = a.n_heads // split.size
        self.kv_first, self.n_kv_heads = split.kv_heads(a.n_kv_heads)
        H, KVH, D = self.n_heads, self.n_kv_heads, a.head_dim
        self.q_rows, self.kv_rows = H * D, KVH * D
        self.wqkv = Linear(a.hidden, self.q_rows + 2 * self.kv_rows, bias=a.bias != "none")
        self.wo = Linear(H * D, a.hidden, bias=a.bias == "all")
        if a.qk_norm is not None:
            self.q_norm = a.qk_norm(D, a.norm_eps)
            self.k_norm = a.qk_norm(D, a.norm_eps)
        self.scale = a.scale if a.scale is not None else D**-0.5

    def shard_rows(self, shard: str) -> slice:
        """Rows of ``wqkv`` that a checkpoint's separate q / k / v tensor fills."""
        q, kv = self.q_rows, self.kv_rows
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]

    def load_fused(self, tensor: torch.Tensor) -> torch.Tensor:
        a = self.a
        return split_fused_qkv(tensor, a.qkv_layout, a.n_heads, a.n_kv_heads, a.head_dim)

    def take_slice(self, child: str, leaf: str, shard: str | None, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor for ``child.leaf`` (q / k / v shard)."""
        s, D = self.split, self.a.head_dim
        if s.size == 1:
            return t
        q = slice(s.rank * self.q_rows, (s.rank + 1) * self.q_rows)
        kv = slice(self.kv_first * D, self.kv_first * D + self.kv_rows)
        if child == "wqkv":
            if shard is None:  # a fused checkpoint tensor, already in [q; k; v] order
                Q, KV = self.a.n_heads * D, self.a.n_kv_heads * D
                return torch.cat([t[:Q][q], t[Q : Q + KV][kv], t[Q + KV :][kv]])
            return t[q] if shard == "q" else t[kv]
        if child == "wo":
            return s.row_parallel(leaf, t, q)
        return t  # q_norm / k_norm act per head_dim: the same on every rank

    def forward(self, x: torch.Tensor, batch: FlatBatch, pos: PositionBlock) -> torch.Tensor:
        a = self.a
        N = x.shape[0]
        qkv = self.wqkv(x)
        q = qkv[:, : self.q_rows].view(N, self.n_heads, a.head_dim)
        k = qkv[:, self.q_rows : self.q_rows + self.kv_rows].view(N, self.n_kv_heads, a.head_dim)
        v = qkv[:, self.q_rows + self.kv_rows :].view(N, self.n_kv_heads, a.head_dim)
        if a.qk_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not pos.rotate_(q, k, batch.positions):  # q and k are this call's own buffers
            q, k = pos.rotate(q, k, batch.positions)
        # causal attention without soft-cap or bias runs every row in the C decode kernel
        # where the KV view has it: a row's result is then the same in any batch or chunking
        plain = a.causal and a.softcap is None and not pos.has_bias
        if batch.group is not None:
            out = batch.group.attend(a.layer, q, k, v, self.scale, a.window) if plain else None
            if out is None:  # no kernel path: keys gathered into a padded copy
                kp, vp, kpos, valid = batch.group.update(a.layer, k, v)
                bias = pos.group_bias(batch.positions, kpos)
                out = attend_decode_group(
                    q, kp, vp, batch.positions, kpos, valid, self.scale, a.window, a.softcap, bias
                )
            return self.wo(out.reshape(N, -1))
        joined = batch.joined if plain else None
        out = joined.attend(a.layer, q, k, v, self.scale, a.window) if joined else None
        if out is not None:  # several sequences' rows in one call (each as when alone)
            return self.wo(out.reshape(N, -1))
        out = torch.empty_like(q)
        for i, s in enumerate(batch.seqs):
            rows = slice(s.start, s.start + s.length)
            qpos = batch.positions[rows]
            kernel = getattr(batch.kv[i], "attend", None) if plain else None
            got = (
                kernel(a.layer, q[rows], k[rows], v[rows], qpos, self.scale, a.window)
                if kernel
                else None
            )
            if got is not None:
                out[rows] = got
                continue
            k_all, v_all, k_pos = batch.kv[i].update(a.layer, k[rows], v[rows], qpos)
            out[rows] = attend(
                q[rows],
                k_all,
                v_all,
                qpos,
                k_pos,
                self.scale,
                a.window,
                a.softcap,
                pos.bias(qpos, k_pos),
                a.causal,
            )
        return self.wo(out.reshape(N, -1))


class CrossAttention(nn.Module):
    """A decoder's attention over the encoder output: queries from the decoder, keys and values
    from the encoder output, computed once per source (``memory``) and kept for every step."""

    def __init__(self, a: AttnArgs) -> None:
        super().__init__()
        self.a = a
        H, D = a.n_heads, a.head_dim
        self.rows = H * D
        self.wq = Linear(a.hidden, H * D, bias=a.bias != "none")
        self.wkv = Linear(a.memory_hidden or a.hidden, 2 * H * D, bias=a.bias != "none")
        self.wo = Linear(H * D, a.hidden, bias=a.bias == "all")
        self.scale = a.scale if a.scale is not None else D**-0.5

    def shard_rows(self, shard: str) -> slice:
        """Rows of ``wkv`` that a checkpoint's separate k / v tensor fills."""
        return {"k": slice(0, self.rows), "v": slice(self.rows, 2 * self.rows)}[shard]

    def memory(self, enc_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one source's encoder output (S, hidden): (H, S, D) each."""
        a = self.a
        kv = self.wkv(enc_out).view(-1, 2, a.n_heads, a.head_dim)
        return kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)

    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        a = self.a
        if batch.cross is None:
            raise ValueError("cross-attention needs the encoder output (FlatBatch.cross)")
        q = self.wq(x).view(-1, a.n_heads, a.head_dim)
        out = batch.cross.attend(a.layer, q, self.scale)
        return self.wo(out.reshape(x.shape[0], -1))
