"""Perplexity and KL divergence over a fixed text, following llama.cpp's ``perplexity`` protocol.

The text is tokenized once, with the model's BOS in front when its tokenizer adds one
(``text_ids``), and cut into non-overlapping windows of ``ctx`` tokens. For such a model each
window's first token is replaced by BOS, as ``llama-perplexity`` does, so every window starts
the way the model always runs (Gemma's predictions without BOS are far worse). In each window
the first ``ctx // 2`` tokens are context only and every later token is scored, so each scored
token is predicted from at least ``ctx // 2`` tokens. ``--kl-divergence-base`` saves the scored
log-probabilities (fp16) of a reference run; a later run of a quantized model against that
file reports the KL divergence of its next-token distributions from the reference's and how
often both agree on the most likely token.
"""

from __future__ import annotations

import json
import math
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferflow.engine.generate import new_cache
from inferflow.errors import InferflowError, RequestError
from inferflow.model.batch import FlatBatch
from inferflow.model.network import Network
from inferflow.tokenizer import Tokenizer


@dataclass
class KLStats:
    mean: float
    p99: float
    maximum: float
    top1_agreement: float


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    scored_tokens: int
    chunks: int
    ctx: int
    kl: KLStats | None = None
    per_chunk_ppl: list[float] = field(default_factory=list)


def text_ids(tok: Tokenizer, text: str) -> tuple[list[int], int | None]:
    """(token ids of ``text``, the BOS id every window starts with, or None): llama.cpp's
    ``common_tokenize(text, add_special=true)``, BOS only where the tokenizer adds one."""
    ids = tok.encode(text, add_special_tokens=False)
    if tok.add_bos and tok.bos_id is not None:
        return [tok.bos_id, *ids], tok.bos_id
    return ids, None


def windows(
    ids: list[int], ctx: int, max_chunks: int | None, bos: int | None = None
) -> list[list[int]]:
    """The first ``max_chunks`` whole windows of ``ctx`` tokens, each starting with ``bos``
    (replacing the window's first token) when one is given."""
    if ctx < 4:
        raise RequestError(f"ctx must be at least 4 tokens, got {ctx}")
    n = len(ids) // ctx
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n == 0:
        raise RequestError(f"the text has {len(ids)} tokens: fewer than one window of ctx={ctx}")
    out = [ids[i * ctx : (i + 1) * ctx] for i in range(n)]
    if bos is not None:
        out = [[bos, *w[1:]] for w in out]
    return out


@torch.inference_mode()
def scored_logprobs(
    model: Network, chunks: list[list[int]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per window: log-probs (ctx - ctx//2 - 1, vocab) float32 and the tokens they predict."""
    for chunk in chunks:
        ctx = len(chunk)
        first = ctx // 2
        batch = FlatBatch.single(torch.tensor(chunk), 0, new_cache(model, ctx))
        batch.logits_rows = torch.arange(first, ctx - 1)
        logits = model(batch).float()
        yield torch.log_softmax(logits, dim=-1), torch.tensor(chunk[first + 1 :])


@dataclass
class PromptLogprobs:
    """Teacher-forced log-probabilities of a prompt's tokens 1..T-1 under the model (token 0
    has none): each token's own, its rank (1: the most likely) and the ``top`` most likely
    (token id, log-probability) pairs at its position."""

    chosen: list[float]
    rank: list[int]
    top: list[list[tuple[int, float]]]


def prompt_logprobs(
    model: Network, ids: list[int], top: int = 0, chunk: int = 256
) -> PromptLogprobs:
    """The prompt's log-probabilities (what lm-evaluation-harness scores over ``echo``): the
    prompt runs once, ``chunk`` positions at a time over a cache of its own, so the
    (positions, vocabulary) log-softmax never holds more than ``chunk`` rows."""
    steps = prompt_logprobs_steps(model, ids, top, chunk)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def prompt_logprobs_steps(
    model: Network, ids: list[int], top: int = 0, chunk: int = 256
) -> Generator[None, None, PromptLogprobs]:
    """``prompt_logprobs`` as a generator that yields after each chunk and returns the result:
    a server interleaves the chunks with other work and stops between two."""
    cache = new_cache(model, len(ids))
    out = PromptLogprobs([], [], [])
    for a in range(0, len(ids) - 1, chunk):  # tokens a..b-1 predict a+1..b
        b = min(a + chunk, len(ids) - 1)
        batch = FlatBatch.single(torch.tensor(ids[a:b]), a, cache)
        batch.logits_rows = torch.arange(b - a)
        lp = torch.log_softmax(model(batch).float(), dim=-1)
        own = lp.gather(1, torch.tensor(ids[a + 1 : b + 1])[:, None])
        out.chosen += own[:, 0].tolist()
        out.rank += ((lp > own).sum(1) + 1).tolist()
        if top:
            v, i = lp.topk(min(top, lp.shape[1]), dim=-1)
            out.top += [
                list(zip(r, x, strict=True)) for r, x in zip(i.tolist(), v.tolist(), strict=True)
            ]
        else:
            out.top += [[] for _ in range(b - a)]
        yield
    return out


def perplexity(
    model: Network,
    ids: list[int],
    ctx: int = 512,
    max_chunks: int | None = None,
    save_base: Path | None = None,
    kl_base: Path | None = None,
    bos: int | None = None,
) -> PerplexityResult:
    """Perplexity of ``ids`` (from ``text_ids``) in windows of ``ctx``, each starting with
    ``bos`` when given; saves or compares reference log-probs for KL divergence."""
    chunks = windows(ids, ctx, max_chunks, bos)
    base = _BaseFile.open(kl_base, ids, ctx, bos, len(chunks)) if kl_base else None
    saved: dict[str, torch.Tensor] = {}
    nll_sum, count, per_chunk = 0.0, 0, []
    kls: list[torch.Tensor] = []
    agree = 0
    for i, (lp, targets) in enumerate(scored_logprobs(model, chunks)):
        nll = -lp.gather(1, targets[:, None]).squeeze(1)
        nll_sum += float(nll.sum())
        count += nll.numel()
        per_chunk.append(math.exp(float(nll.mean())))
        if save_base is not None:
            saved[f"chunk{i}"] = lp.half()
        if base is not None:
            ref = base.chunk(i).float()
            kls.append((ref.exp() * (ref - lp)).sum(-1))
            agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
    if save_base is not None:
        _BaseFile.write(save_base, saved, ids, ctx, bos)
    kl = None
    if kls:
        k = torch.cat(kls).clamp_min(0)
        kl = KLStats(
            float(k.mean()), float(torch.quantile(k, 0.99)), float(k.max()), agree / k.numel()
        )
    return PerplexityResult(
        math.exp(nll_sum / count), nll_sum / count, count, len(chunks), ctx, kl, per_chunk
    )


class _BaseFile:
    """Reference log-probs in a safetensors file; metadata ties it to the exact token windows."""

    def __init__(self, path: Path, handle: object) -> None:
        self.path, self.handle = path, handle

    @staticmethod
    def _key(ids: list[int], ctx: int, bos: int | None) -> str:
        import hashlib

        return hashlib.sha256(json.dumps([ctx, ids, bos]).encode()).hexdigest()

    @classmethod
    def write(
        cls,
        path: Path,
        tensors: dict[str, torch.Tensor],
        ids: list[int],
        ctx: int,
        bos: int | None,
    ) -> None:
        from safetensors.torch import save_file

        tmp = path.with_name(path.name + ".tmp")
        save_file(
            tensors,
            str(tmp),
            metadata={"inferflow.kl_base": cls._key(ids, ctx, bos), "ctx": str(ctx)},
        )
        tmp.replace(path)

    @classmethod
    def open(
        cls, path: Path, ids: list[int], ctx: int, bos: int | None, n_chunks: int
    ) -> _BaseFile:
        from safetensors import safe_open

        if not path.is_file():
            raise InferflowError(
                f"KL base file {path} does not exist: write it first with --kl-divergence-base alone"
            )
        handle = safe_open(str(path), framework="pt")
        meta = handle.metadata() or {}
        if meta.get("inferflow.kl_base") != cls._key(ids, ctx, bos):
            raise InferflowError(
                f"KL base file {path} was made from other tokens or another ctx (its ctx: {meta.get('ctx')}, this "
                f"run: {ctx}); use the same text, tokenizer and --ctx"
            )
        missing = [i for i in range(n_chunks) if f"chunk{i}" not in handle.keys()]
        if missing:
            raise InferflowError(
                f"KL base file {path} holds fewer windows than this run ({n_chunks}): use --chunks"
            )
        return cls(path, handle)

    def chunk(self, i: int) -> torch.Tensor:
        return self.handle.get_tensor(f"chunk{i}")  # type: ignore[attr-defined]
