"""Perplexity and KL divergence against an independent computation with transformers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from inferflow.errors import InferflowError, RequestError
from inferflow.evaluate import perplexity
from tests.conftest import tiny_llama

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"), vocab_size=100, max_position_embeddings=128)


def test_perplexity_matches_transformers_cross_entropy(tiny) -> None:
    ref, model = tiny
    ids = torch.randint(0, 100, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    res = perplexity(model, ids, ctx=64)
    # independent: windows of 64, score tokens 33..63 of each from HF logits at rows 32..62
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in range(len(ids) // 64):
            chunk = torch.tensor(ids[w * 64 : (w + 1) * 64])
            logits = ref(chunk[None]).logits[0]
            nll += float(
                torch.nn.functional.cross_entropy(logits[32:63], chunk[33:64], reduction="sum")
            )
            n += 31
    assert res.scored_tokens == n and res.chunks == 3
    assert res.ppl == pytest.approx(math.exp(nll / n), rel=1e-5)


def test_kl_divergence_zero_against_itself_and_positive_against_perturbed(
    tiny, tmp_path: Path
) -> None:
    _, model = tiny
    ids = torch.randint(0, 100, (128,), generator=torch.Generator().manual_seed(4)).tolist()
    base = tmp_path / "base.st"
    perplexity(model, ids, ctx=64, save_base=base)
    same = perplexity(model, ids, ctx=64, kl_base=base)
    assert (
        same.kl is not None and same.kl.mean < 1e-3 and same.kl.top1_agreement == 1.0
    )  # fp16 storage only
    with torch.no_grad():
        w = model.dec.output.weight
        saved = w.clone()
        w.add_(torch.randn_like(w) * 0.5)
        try:
            other = perplexity(model, ids, ctx=64, kl_base=base)
        finally:
            w.copy_(saved)
    assert (
        other.kl is not None and other.kl.mean > 10 * same.kl.mean and other.kl.top1_agreement < 1.0
    )


def test_errors(tiny, tmp_path: Path) -> None:
    _, model = tiny
    with pytest.raises(RequestError, match="fewer than one window"):
        perplexity(model, [1, 2, 3], ctx=64)
    with pytest.raises(InferflowError, match="does not exist"):
        perplexity(model, list(range(64)), ctx=64, kl_base=tmp_path / "nope.st")
    base = tmp_path / "b.st"
    perplexity(model, list(range(64)), ctx=64, save_base=base)
    with pytest.raises(InferflowError, match="other tokens or another ctx"):
        perplexity(model, list(range(1, 65)), ctx=64, kl_base=base)
