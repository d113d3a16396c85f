"""Perplexity and KL divergence against an independent computation with transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from inferflow.errors import InferflowError, RequestError
from inferflow.evaluate import perplexity, text_ids
from tests.conftest import tiny_llama

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"), vocab_size=100, max_position_embeddings=128)


def _hf_ppl(ref, windows: list[list[int]]) -> tuple[float, int]:
    """(perplexity, scored tokens) from HF logits: tokens 33..63 of each window of 64, from
    the logits at rows 32..62."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            chunk = torch.tensor(w)
            logits = ref(chunk[None]).logits[0]
            nll += float(
                torch.nn.functional.cross_entropy(logits[32:63], chunk[33:64], reduction="sum")
            )
            n += 31
    return math.exp(nll / n), n


def test_perplexity_matches_transformers_cross_entropy(tiny) -> None:
    ref, model = tiny
    ids = torch.randint(0, 100, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    res = perplexity(model, ids, ctx=64)
    ppl, n = _hf_ppl(ref, [ids[w * 64 : (w + 1) * 64] for w in range(len(ids) // 64)])
    assert res.scored_tokens == n and res.chunks == 3
    assert res.ppl == pytest.approx(ppl, rel=1e-5)


def test_bos_starts_every_window_as_llama_perplexity_does(tiny) -> None:
    """llama.cpp's protocol for a model that adds BOS: the text's tokens with BOS in front, cut
    into windows of ctx, each window's first token replaced by BOS, second half scored."""
    ref, model = tiny
    ids = torch.randint(3, 100, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    bos = 1
    stream = [bos, *ids]
    res = perplexity(model, stream, ctx=64, bos=bos)
    n_win = len(stream) // 64
    ppl, n = _hf_ppl(ref, [[bos, *stream[w * 64 + 1 : (w + 1) * 64]] for w in range(n_win)])
    assert res.scored_tokens == n and res.chunks == 3
    assert res.ppl == pytest.approx(ppl, rel=1e-5)
    assert res.ppl != pytest.approx(perplexity(model, stream, ctx=64).ppl, rel=1e-5)


class _Tok:
    def __init__(self, add_bos: bool) -> None:
        self.add_bos, self.bos_id = add_bos, 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_text_ids_put_bos_first_only_where_the_tokenizer_adds_one() -> None:
    assert text_ids(_Tok(True), "ab") == ([1, 97, 98], 1)  # type: ignore[arg-type]
    assert text_ids(_Tok(False), "ab") == ([97, 98], None)  # type: ignore[arg-type]


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


# llama.cpp's figures on F32 GGUFs of the same weights, same text, ctx and windows, made with
#   inferflow convert <the spec's GGUF> -o m-f32.gguf --type F32
#   llama-perplexity -m m-f32.gguf -f ~/.cache/inferflow/texts/hamlet.txt -c 512 --chunks 4 -t 2
# (llama.cpp from llama-cpp-python 0.3.36's sources, tools/build_llama_cpp.py; 2026-11-26)
LLAMA_PERPLEXITY = {"gemma-3-270m": 40.5314, "smollm2-135m-instruct": 36.9419}


@pytest.mark.slow
@pytest.mark.parametrize("spec", sorted(LLAMA_PERPLEXITY))
def test_ppl_follows_llama_perplexity(spec: str) -> None:
    """`inferflow ppl` in float32 agrees with llama-perplexity (Gemma adds BOS: without a BOS
    starting every window its perplexity was 67.6)."""
    from tests.conftest import gemma3_path, smollm2_path
    from tests.test_cli import run_cli

    (gemma3_path if spec.startswith("gemma") else smollm2_path)()
    text = Path.home() / ".cache" / "inferflow" / "texts" / "hamlet.txt"
    if not text.exists():
        pytest.skip(f"{text} missing (make models)")
    args = ["--text", str(text), "--ctx", "512", "--chunks", "4", "--json"]
    r = run_cli("ppl", spec, "--quant", "none", "--dtype", "float32", *args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["scored_tokens"] == 4 * 255
    assert out["ppl"] == pytest.approx(LLAMA_PERPLEXITY[spec], rel=2e-3)
