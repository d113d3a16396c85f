"""``--dtype float32`` means float32 with the checkpoint's quantized blocks kept (the default
load): teacher-forced logits within 1e-4 (relative to the position's largest logit) of
transformers in fp32 on the same GGUF, which dequantizes every block; prefill, one token a
step, and two sequences batched through the engine's paged cache. One bf16 rounding of the
activations (unit roundoff 2^-8) would be off by far more."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from inferflow.engine.generate import new_cache
from inferflow.engine.kv_cache import PagedKVCache, SeqBlocks
from inferflow.model.batch import FlatBatch, SeqSlice
from inferflow.quant.linear import QuantLinear
from inferflow.runtime import LanguageModel, load
from tests.conftest import gemma3_path, qwen_coder_path, smollm2_path
from tests.test_real_models import TEXT

tf = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

OTHER = (
    "In the spring the river rose over its banks and the farmers moved their sheep to the high "
    "pastures, where the grass was short and the wind never stopped blowing across the hills. "
    "By midsummer the water had gone back, leaving mud, broken fences and a smell of rot."
)
MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": smollm2_path,
    "gemma-3-270m": gemma3_path,
    "qwen2.5-coder-0.5b-instruct": qwen_coder_path,
}
N, P = 40, 12  # tokens per text, of which the prompt


@pytest.fixture(scope="module", params=list(MODELS))
def case(
    request: pytest.FixtureRequest,
) -> tuple[LanguageModel, list[list[int]], list[torch.Tensor]]:
    path = MODELS[request.param]()
    ours = load(request.param, "float32")  # the default: the file's quantized blocks kept
    assert any(isinstance(m, QuantLinear) for m in ours.model.modules())
    ref = tf.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    texts = [ours.tokenizer.encode(t)[:N] for t in (TEXT, OTHER)]
    assert all(len(t) == N for t in texts)
    with torch.no_grad():
        want = [ref(torch.tensor([ids])).logits[0] for ids in texts]
    return ours, texts, want


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max())


@torch.inference_mode()
def test_prefill_and_one_token_steps(case) -> None:  # noqa: ANN001
    ours, (ids, _), (want, _) = case
    cache = new_cache(ours.model, N)
    batch = FlatBatch.single(torch.tensor(ids), 0, cache)
    batch.logits_rows = torch.arange(N)
    assert _rel(ours.model(batch), want) <= 1e-4
    cache = new_cache(ours.model, N)
    batch = FlatBatch.single(torch.tensor(ids[:P]), 0, cache)
    batch.logits_rows = torch.arange(P)
    rows = [ours.model(batch)]
    for p in range(P, N):  # (the one-call C decode where the stack has one)
        rows.append(ours.model(FlatBatch.single(torch.tensor(ids[p : p + 1]), p, cache)))
    assert _rel(torch.cat(rows), want) <= 1e-4


@torch.inference_mode()
def test_two_sequences_batched_in_the_paged_cache(case) -> None:  # noqa: ANN001
    """The engine's path: both prompts in one prefill step, then decode steps of both at once
    (a group view; the C decode batch where the stack has one)."""
    ours, texts, want = case
    model = ours.model
    cache = PagedKVCache(*model.kv_geometry(), 16, 8, torch.float32)
    seqs = [SeqBlocks(), SeqBlocks()]
    for s in seqs:
        cache.reserve(s, N)
    ids = [t for text in texts for t in text[:P]]
    views = [cache.view(s, 0, P) for s in seqs]
    pos = torch.arange(P).repeat(2)
    batch = FlatBatch(torch.tensor(ids), pos, [SeqSlice(0, P), SeqSlice(P, P)], views)  # type: ignore[arg-type]
    batch.logits_rows = torch.arange(2 * P)
    first = model(batch)
    got = [[first[:P]], [first[P:]]]
    for p in range(P, N):
        step = FlatBatch(
            torch.tensor([texts[0][p], texts[1][p]]),
            torch.tensor([p, p]),
            [SeqSlice(0, 1), SeqSlice(1, 1)],
            [],
            torch.arange(2),
        )
        step.group = cache.group_view(seqs, [p, p])
        out = model(step)
        got[0].append(out[:1])
        got[1].append(out[1:])
    for rows, w in zip(got, want, strict=True):
        assert _rel(torch.cat(rows), w) <= 1e-4
