"""KV-cache dtypes (EngineConfig.kv_cache_dtype, ``inferflow serve --kv-cache-dtype``): q8 keeps
gguf-py's Q8_0 blocks bit for bit, the cache holds 3.76x the tokens of float32 in the same
bytes (float16 and bfloat16 2x), copy-on-write keeps the blocks, the C kernels read and write
q8 and float16 caches as gguf-py and torch round them, and SmolLM2 read through q8 / float16 /
bfloat16 K/V stays close to float32 K/V (KL and top-1 over a real text)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from inferflow import kernels
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.forward import Rows, forward_rows
from inferflow.engine.kv_cache import KVFormat, PagedKVCache, SeqBlocks, plan_cache
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import SchedulerConfig
from inferflow.errors import InferflowError
from inferflow.kernels import quant_decode
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
        for kd in ("float32", "float16", "bfloat16", "q8")
    }
    assert tokens["bfloat16"] / tokens["float32"] == pytest.approx(2, rel=1e-3)
    assert tokens["float16"] / tokens["float32"] == pytest.approx(2, rel=1e-3)
    assert tokens["q8"] / tokens["float32"] == pytest.approx(4 / (34 / 32), rel=1e-3)


def test_errors_name_the_allowed_values() -> None:
    with pytest.raises(
        InferflowError, match="'q4' is unknown; known: float32, float16, bfloat16, q8"
    ):
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


@contextlib.contextmanager
def _built_with(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[None]:
    """The kernels built with extra compiler flags, in a cache of their own."""
    built = (kernels._library, kernels.paged_decode_attention, quant_decode.library)
    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, *flags])
    for fn in built:
        fn.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        for fn in built:
            fn.cache_clear()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 reference: q (H, D) over k, v (n, KVH, D)."""
    r = q.shape[0] // k.shape[1]
    k, v = k.double().repeat_interleave(r, 1), v.double().repeat_interleave(r, 1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), k) * scale, -1)
    return torch.einsum("hn,nhd->hd", w, v)


def _stored_values(kv_dtype: str, c: torch.Tensor) -> torch.Tensor:
    """The float32 values a cache of ``kv_dtype`` holds, by an independent reader: gguf-py's
    Q8_0 decoder, or the halves' exact values."""
    if kv_dtype == "float16":
        return c.float()
    gguf = pytest.importorskip("gguf")
    return torch.from_numpy(gguf.quants.dequantize(c.numpy(), gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("flags", [[], ["-mno-avx512f", "-mno-f16c"]], ids=["native", "portable"])
@pytest.mark.parametrize("D", [32, 64, 96, 256])
@pytest.mark.parametrize("kv_dtype", ["q8", "float16"])
def test_attention_kernel_reads_the_cache(
    kv_dtype: str, D: int, flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Scattered slots of a Q8_0 or float16 cache (values of magnitudes 1e-6 .. 1e2): each
    sequence's rows equal float64 attention over the stored values, and the same bits alone as
    among the others."""
    with _built_with(flags, monkeypatch, tmp_path):
        fmt = KVFormat(kv_dtype, torch.float32, D)
        kernel = kernels.paged_decode_attention(fmt.store)
        if kernel is None:
            pytest.skip("no C compiler here")
        g = torch.Generator().manual_seed(D)
        slots, H, KVH, scale = 64, 6, 2, D**-0.5
        mag = 10.0 ** torch.randint(-6, 3, (slots, KVH, 1), generator=g).float()
        k = torch.randn(slots, KVH, D, generator=g) * mag
        v = torch.randn(slots, KVH, D, generator=g) * mag
        kc, vc = fmt.encode(k), fmt.encode(v)
        lens = torch.tensor([1, 17, 40, 9])
        read = torch.stack([torch.randperm(slots, generator=g)[:40] for _ in lens])
        q = torch.randn(len(lens), H, D, generator=g)
        out = kernel(q, kc, vc, read, lens, scale)
        ks, vs = _stored_values(kv_dtype, kc), _stored_values(kv_dtype, vc)
        for b, n in enumerate(lens.tolist()):
            rows = read[b, :n]
            want = _attention(q[b], ks[rows], vs[rows], scale)
            assert (out[b].double() - want).abs().max() < 2e-5 * want.abs().max()
            alone = kernel(q[b : b + 1], kc, vc, read[b : b + 1], lens[b : b + 1], scale)
            assert torch.equal(alone[0], out[b])


@pytest.mark.parametrize("flags", [[], ["-mno-avx512f", "-mno-f16c"]], ids=["native", "portable"])
def test_decode_stack_writes_gguf_q8_0_blocks(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The Q8_0 writer of the C decode (kvq8.h: its own float16 rounding where the CPU has no
    F16C) against gguf-py, over scales from float16 subnormals to infinity."""
    gguf = pytest.importorskip("gguf")
    with _built_with(flags, monkeypatch, tmp_path):
        if quant_decode.library() is None:
            pytest.skip("no C compiler here")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 256, generator=g)
        x *= 10.0 ** torch.randint(-12, 8, (64, 8, 1), generator=g).float().repeat_interleave(
            32, 1
        ).squeeze(-1)
        x[0, :32] = 0
        x[1, :32] = 0.5  # ties of round half away from zero
        # scales halfway between two float16 values, rounded to the even one: up (a normal
        # 1 + 3 * 2^-11 and a subnormal 3 * 2^-25) and down (1 + 2^-11)
        for row, d in ((2, 1 + 3 * 2**-11), (3, -3 * 2**-25), (4, 1 + 2**-11)):
            x[row, :32] = 0
            x[row, 0] = 127 * d
        want = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(quant_decode.q8_0_rows(x).numpy(), want)


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
    ("kv_dtype", "mean_kl", "agree"),
    [("float16", 2e-5, 0.995), ("bfloat16", 2e-4, 0.995), ("q8", 4e-3, 0.97)],
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


@pytest.mark.parametrize("flags", [[], ["-mno-avx512f", "-mno-f16c"]], ids=["native", "portable"])
def test_decode_stack_writes_float16_as_torch_rounds(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Decode rows (the C decode, kvq8.h's float_to_half where the CPU has no F16C) write the
    halves torch's .half() gives of the float32 K/V a float32 cache receives: layer 0's entries
    of 8 sequences' first tokens (their K/V do not depend on the cache's dtype yet)."""
    from inferflow.runtime import load

    smollm2_path()
    with _built_with(flags, monkeypatch, tmp_path):
        if quant_decode.library() is None:
            pytest.skip("no C compiler here")
        smollm2 = load("smollm2-135m-instruct")  # (its planes for this build)
        assert smollm2.model.dec.fused_decode() is not None
        got = {}
        for kd in ("float32", "float16"):
            cache = PagedKVCache(*smollm2.model.kv_geometry(), 16, 8, torch.float32, kd)
            seqs = [SeqBlocks() for _ in range(8)]
            for s in seqs:
                cache.reserve(s, 1)
            with torch.inference_mode():
                rows = [Rows(s, 0, [1000 + 37 * i], True) for i, s in enumerate(seqs)]
                forward_rows(smollm2.model, cache, rows)
            slots = torch.tensor([s.blocks[0] * 16 for s in seqs])
            got[kd] = cache.k[0][slots], cache.v[0][slots]
        assert got["float16"][0].dtype == torch.float16
        assert torch.equal(got["float16"][0], got["float32"][0].half())
        assert torch.equal(got["float16"][1], got["float32"][1].half())


def test_engine_samples_share_q8_prompt_blocks(smollm2) -> None:  # noqa: ANN001
    """n = 3 greedy samples fork the prompt's q8 blocks and copy the last on their first write:
    all three equal the request alone."""
    eng = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(kv_cache_dtype="q8"))
    alone = eng.generate(["Once upon a time"], SamplingParams(max_new_tokens=12))[0]
    many = eng.generate(["Once upon a time"], SamplingParams(max_new_tokens=12, n=3))
    assert [r.output_ids for r in many] == [alone.output_ids] * 3
    assert eng.cache.k.dtype == torch.uint8


def test_q8_serving_is_batch_invariant(smollm2) -> None:  # noqa: ANN001
    """With a q8 cache, decode rows take the C decode (writing and reading Q8_0 blocks), prompt
    rows the modules and the C attention: 8 requests together give each one's tokens and
    logprobs alone, bit for bit."""
    prompts = [
        f"Tell me about the number {i} and the color {c}."
        for i, c in enumerate("red green blue cyan pink gray gold teal".split())
    ]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2)

    assert smollm2.model.dec.fused_decode() is not None
    together = _stream(smollm2, prompts, params)
    alone = [_stream(smollm2, [p], params)[0] for p in prompts]
    assert together == alone


def _stream(lm, prompts: list[str], params: SamplingParams) -> list[tuple[list[int], list]]:  # noqa: ANN001
    # (prompts chunked across steps, decode rows beside prefill chunks)
    sched = SchedulerConfig(max_batched_tokens=32)
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(sched, kv_cache_dtype="q8"))
    ids = [eng.add_request(p, params) for p in prompts]
    out: dict[str, tuple[list[int], list]] = {r: ([], []) for r in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend((t.token_id, t.logprob, t.top) for t in o.logprobs or [])
    return [out[r] for r in ids]
