"""KV-cache dtypes (EngineConfig.kv_cache_dtype, ``inferflow serve --kv-cache-dtype``): q8 keeps
gguf-py's Q8_0 blocks bit for bit, the cache holds 3.76x the tokens of float32 in the same
bytes, copy-on-write keeps the blocks, and SmolLM2 read through q8 / bfloat16 K/V stays close
to float32 K/V (KL and top-1 over a real text)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.forward import Rows, forward_rows
from inferflow.engine.kv_cache import KVFormat, PagedKVCache, SeqBlocks, plan_cache
from inferflow.engine.sampling import SamplingParams
from inferflow.errors import InferflowError
from tests.conftest import smollm2_path


def test_q8_stores_gguf_q8_0_blocks() -> None:
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.rand(5, 3, 1, generator=g) * 10
    x[0, 0, :32] = 0  # an all-zero block
    fmt = KVFormat("q8", torch.float32, 64)
    stored = fmt.encode(x)
    want = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert stored.dtype == torch.uint8 and stored.shape == (5, 3, 68)
    assert np.array_equal(stored.numpy(), want)
    back = gguf.quants.dequantize(want, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(fmt.decode(stored), torch.from_numpy(back))


def test_capacity_per_dtype() -> None:
    geometry = (30, 3, 64)  # SmolLM2-135M
    tokens = {
        kd: plan_cache(geometry, 16, 1 << 30, torch.float32, 1 << 20, kd).num_blocks * 16
        for kd in ("float32", "bfloat16", "q8")
    }
    assert tokens["bfloat16"] / tokens["float32"] == pytest.approx(2, rel=1e-3)
    assert tokens["q8"] / tokens["float32"] == pytest.approx(4 / (34 / 32), rel=1e-3)


def test_errors_name_the_allowed_values() -> None:
    with pytest.raises(InferflowError, match="'q4' is unknown; known: float32, bfloat16, q8"):
        KVFormat("q4", torch.float32, 64)
    with pytest.raises(InferflowError, match="multiple of 32, this model's is 40"):
        PagedKVCache(2, 2, 40, 16, 4, torch.float32, "q8")


def test_copy_on_write_keeps_q8_blocks() -> None:
    cache = PagedKVCache(2, 2, 32, 4, 8, torch.float32, "q8")
    a = SeqBlocks()
    cache.reserve(a, 6)
    k = torch.randn(6, 2, 32)
    slots = torch.tensor([a.blocks[i // 4] * 4 + i % 4 for i in range(6)])
    cache.write(1, slots, k, -k)
    a.num_computed = 6
    b = cache.fork(a)
    cache.reserve(b, 7)
    cache.view(b, 6, 7)  # b writes position 6: its second block is copied first
    assert b.blocks[1] != a.blocks[1]
    new = torch.tensor([b.blocks[i // 4] * 4 + i % 4 for i in range(6)])
    ka, va = cache.read(1, slots)
    kb, vb = cache.read(1, new)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert (ka - k).abs().max() <= k.abs().max() / 127  # (one code step)


@pytest.fixture(scope="module")
def smollm2():  # noqa: ANN201
    from inferflow.runtime import load

    smollm2_path()
    return load("smollm2-135m-instruct")


def _logits(lm, ids: list[int], kv_dtype: str) -> torch.Tensor:  # noqa: ANN001
    """The text in chunks of 32 through a paged cache: most keys come from earlier chunks."""
    cache = PagedKVCache(*lm.model.kv_geometry(), 16, -(-len(ids) // 16), torch.float32, kv_dtype)
    seq = SeqBlocks()
    cache.reserve(seq, len(ids))
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids), 32):
            part = ids[s : s + 32]
            out.append(forward_rows(lm.model, cache, [Rows(seq, s, part, False, len(part))]))
            seq.num_computed = s + len(part)
    return torch.cat(out).double()


@pytest.mark.parametrize(
    ("kv_dtype", "mean_kl", "agree"), [("bfloat16", 2e-4, 0.995), ("q8", 4e-3, 0.97)]
)
def test_smollm2_through_quantized_kv_stays_close(
    smollm2, kv_dtype: str, mean_kl: float, agree: float
) -> None:  # noqa: ANN001
    text = (
        "The quick brown fox jumps over the lazy dog. "
        * 2
        + "In the beginning God created the heaven and the earth. And the earth was without "
        "form, and void; and darkness was upon the face of the deep. And the Spirit of God "
        "moved upon the face of the waters. And God said, Let there be light: and there was "
        "light. And God saw the light, that it was good: and God divided the light from the "
        "darkness. And God called the light Day, and the darkness he called Night."
    )
    ids = smollm2.tokenizer.encode(text)
    ref, got = _logits(smollm2, ids, "float32"), _logits(smollm2, ids, kv_dtype)
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert float(kl.mean()) < mean_kl  # (measured: 9.8e-5 bfloat16, 1.4e-3 q8; top-1 all)
    assert float((ref.argmax(-1) == got.argmax(-1)).double().mean()) >= agree
    assert float(kl.mean()) > 0  # (the K/V did go through the dtype)


def test_engine_samples_share_q8_prompt_blocks(smollm2) -> None:  # noqa: ANN001
    """n = 3 greedy samples fork the prompt's q8 blocks and copy the last on their first write:
    all three equal the request alone."""
    eng = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(kv_cache_dtype="q8"))
    alone = eng.generate(["Once upon a time"], SamplingParams(max_new_tokens=12))[0]
    many = eng.generate(["Once upon a time"], SamplingParams(max_new_tokens=12, n=3))
    assert [r.output_ids for r in many] == [alone.output_ids] * 3
    assert eng.cache.k.dtype == torch.uint8
