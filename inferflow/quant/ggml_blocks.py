"""Byte-level helpers the GGML codecs share (inferflow.quant.ggml: the decoders and the
gguf-py quantizers; inferflow.quant.kquant_fit: the k-quant quantizers)."""

from __future__ import annotations

import torch

from inferflow.errors import QuantError

QK_K = 256  # super-block size of the k-quants (ggml-common.h)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of each block, widened to float32: (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _consts(values: list[int], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).reshape(shape)


def _shr(x: torch.Tensor, shifts: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """``x >> shifts`` broadcast like gguf-py's ``>> np.array(shifts).reshape(shape)``."""
    return x >> _consts(shifts, shape, x)


def _check(blocks: torch.Tensor, nbytes: int, name: str) -> int:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != nbytes:
        raise QuantError(
            f"{name}: expected uint8 blocks of shape (n, {nbytes}), "
            f"got {blocks.dtype} {list(blocks.shape)}"
        )
    return blocks.shape[0]


def _floats(x: torch.Tensor, block_size: int, name: str) -> torch.Tensor:
    """Quantizer input as float32 (n, block_size), like gguf-py's ``astype(np.float32)``."""
    if x.dim() != 2 or x.shape[1] != block_size or not x.is_floating_point():
        raise QuantError(
            f"{name}: expected float blocks of shape (n, {block_size}), "
            f"got {x.dtype} {list(x.shape)}"
        )
    return x.to(torch.float32)


def _to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 (n, 1) -> its fp16 bytes (n, 2), rounding to nearest even like numpy's astype."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) packed bytes -> (n, 2k): all low nibbles, then all high nibbles (ggml order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _int(x: torch.Tensor, offset: int) -> torch.Tensor:
    """Small unsigned codes minus an offset as float32 (exact: |values| < 2**8)."""
    return (x.to(torch.int16) - offset).to(torch.float32)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py Q4_K.get_scale_min: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn
