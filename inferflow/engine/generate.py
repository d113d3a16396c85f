"""The simple one-sequence generation loop (prefill, then one decode step per token).

The continuous-batching engine replaces this loop, not the network: both drive the model
through the same flat-batch forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from inferflow.engine.sampling import SamplingParams, make_sampler
from inferflow.errors import RequestError
from inferflow.model.batch import ContiguousKVCache, FlatBatch
from inferflow.model.network import Network


@dataclass(frozen=True)
class StepOutput:
    token_id: int
    finish_reason: str | None  # None while running; "stop" (end token) or "length"


def new_cache(model: Network, max_len: int) -> ContiguousKVCache:
    h = model.spec.hparams
    dtype = next(model.parameters()).dtype
    return ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, max_len, dtype)


@torch.inference_mode()
def prefill(
    model: Network, ids: list[int], cache: ContiguousKVCache, start: int = 0
) -> torch.Tensor:
    """Run ``ids`` at positions start.. and return the logits of the last one (float32)."""
    return model(FlatBatch.single(torch.tensor(ids), start, cache))[-1].float()


def generate_tokens(
    model: Network, prompt_ids: list[int], params: SamplingParams, eos_ids: tuple[int, ...] = ()
) -> Iterator[StepOutput]:
    if not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token")
    ctx = model.spec.hparams.max_positions
    if len(prompt_ids) >= ctx:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {ctx}")
    max_new = min(params.max_new_tokens, ctx - len(prompt_ids))
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    sample = make_sampler(params, eos_ids)
    cache = new_cache(model, len(prompt_ids) + max_new)
    logits = prefill(model, prompt_ids, cache)
    pos = len(prompt_ids)
    out: list[int] = []
    for n in range(max_new):
        tok = sample(logits, prompt_ids, out)
        out.append(tok)
        if tok in stops:
            yield StepOutput(tok, "stop")
            return
        if n == max_new - 1:
            yield StepOutput(tok, "length")
            return
        yield StepOutput(tok, None)
        logits = prefill(model, [tok], cache, pos)
        pos += 1
