"""An upper bound on a serving process's resident memory, from the spec and the engine's
limits (benchmarks/serve_load.py --limits checks the server's RSS against it under load).

Each term is computed, none observed from the server:

- weights: every checkpoint tensor once in float32 (4 bytes a weight: no kept format is larger),
- checkpoint files: their full size (memory-mapped; every page may be resident),
- KV cache: the blocks the engine allocates from its byte budget,
- a speculative draft model (``--draft``): its weights, files and KV cache as the target's,
- activations: the largest transient buffers of one step (one layer at a time): a decode step
  gathers every running sequence's keys and values padded to the longest, expanded to all query
  heads; a prefill chunk's attention scores against the longest context; the hidden and FFN
  states of the batch; the logits of the sampled rows and their log-softmax,
- runtime: what Python, torch, the HTTP stack and the tokenizer take before any of the above
  (measured by the caller in a process that imports them: ``runtime_rss``),
- slack: 10% of everything above for allocator fragmentation.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, fields
from math import prod
from pathlib import Path

import torch

from inferflow.engine.engine import EngineConfig
from inferflow.engine.kv_cache import CachePlan, PagedKVCache, plan_cache
from inferflow.spec import Spec

F32 = 4


@dataclass(frozen=True)
class MemoryBound:
    weights: int
    checkpoint_files: int
    kv_cache: int
    activations: int
    runtime: int
    slack: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def rows(self) -> list[tuple[str, int]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)] + [("total", self.total)]


def kv_plan(spec: Spec, cfg: EngineConfig, dtype: torch.dtype) -> CachePlan:
    """The KV cache the engine allocates for the spec's model loaded whole."""
    h = spec.hparams
    geometry = (h.n_layers, h.n_kv_heads, h.head_dim)
    return plan_cache(
        geometry, cfg.block_size, cfg.kv_cache_bytes, dtype, h.max_positions, cfg.kv_cache_dtype
    )


def weight_elements(spec: Spec) -> int:
    from inferflow.loaders import open_files  # (reads headers only)

    src = open_files(spec.source.format, spec.source.files, spec.source.keys)
    try:
        return sum(prod(src.shape(n)) for n in src.names())
    finally:
        src.close()


def draft_kv_bytes(draft: Spec, cfg: EngineConfig, blocks: int, dtype: torch.dtype) -> int:
    """A draft model's KV cache (speculative.DraftProposer): as many blocks as the target's,
    of the draft's geometry, in the activations' dtype."""
    h = draft.hparams
    geometry = (h.n_layers, h.n_kv_heads, h.head_dim)
    return blocks * PagedKVCache.bytes_per_block(*geometry, cfg.block_size, dtype)


def memory_bound(
    spec: Spec,
    cfg: EngineConfig,
    runtime: int,
    dtype: torch.dtype = torch.float32,
    draft: Spec | None = None,
) -> MemoryBound:
    """``draft``: the speculative draft model (``serve --draft``), whose weights, files and KV
    cache add to the target's (its activations are the target's or less)."""
    h = spec.hparams
    per_block, blocks, longest = kv_plan(spec, cfg, dtype)
    running, chunk = cfg.scheduler.max_running, cfg.scheduler.max_batched_tokens
    # K and V of every running sequence padded to the longest: gathered (KV heads), then
    # repeated per query head (SDPA's GQA path on CPU)
    decode = 2 * running * longest * (h.n_kv_heads + h.n_heads) * h.head_dim * F32
    # one sequence's chunk: its scores and their softmax, its K and V gathered and repeated
    prefill = 2 * chunk * longest * h.n_heads * F32
    prefill += 2 * longest * (h.n_kv_heads + h.n_heads) * h.head_dim * F32
    states = chunk * (6 * h.hidden + 3 * h.ffn_hidden) * F32
    logits = 3 * running * h.vocab_size * F32  # logits, their float copy, log-softmax
    models = [spec] if draft is None else [spec, draft]
    before = {
        "weights": sum(weight_elements(s) for s in models) * F32,
        "checkpoint_files": sum(_size(p) for s in models for p in s.source.files),
        "kv_cache": blocks * per_block
        + (0 if draft is None else draft_kv_bytes(draft, cfg, blocks, dtype)),
        "activations": max(decode, prefill) + states + logits,
        "runtime": runtime,
    }
    return MemoryBound(**before, slack=sum(before.values()) // 10)


def _size(path: Path) -> int:
    """A file's size, or a directory's files' (an HF model directory)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.is_file() else 0


RUNTIME_PROBE = """
import psutil, inferflow.server.app, uvicorn, torch
from inferflow.spec import load_spec
from inferflow.runtime import tokenizer_for
tok = tokenizer_for(load_spec({spec!r}))
torch.zeros(1) @ torch.zeros(1)
print(psutil.Process().memory_info().rss)
"""


def runtime_rss(spec_ref: str) -> int:
    """Resident bytes of a fresh interpreter holding the server's imports and the spec's
    tokenizer (no weights): the fixed part of a serving process."""
    out = subprocess.run(
        [sys.executable, "-c", RUNTIME_PROBE.format(spec=spec_ref)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.strip().splitlines()[-1])
