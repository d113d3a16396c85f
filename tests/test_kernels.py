"""The C decode-attention and rotary kernels (inferflow.kernels) against the torch paths they
replace, their fallback where they cannot be built, and the engine with them against the engine
without them."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inferflow import kernels
from inferflow.blocks.attention import attend_decode_group
from inferflow.blocks.norm import RMSNorm
from inferflow.blocks.position import PositionArgs, RopeOptions, Rotary
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.kv_cache import PagedKVCache, SeqBlocks, gather
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import SchedulerConfig
from tests.conftest import needs_proc, rss

BS = 4


def _reset() -> None:
    kernels._library.cache_clear()
    kernels.paged_decode_attention.cache_clear()
    kernels.rope_in_place.cache_clear()
    kernels.rms_norm.cache_clear()
    kernels.silu_gate.cache_clear()


@contextlib.contextmanager
def _without_avx512(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *more: str
) -> Iterator[None]:
    """The kernels built for a CPU without AVX-512 (the plain-C loops; ``more``: other switches,
    e.g. -mno-avx2), in a cache of their own, while the block runs; the usual ones after."""
    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path / "-".join(["cache", *more])))
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, "-mno-avx512f", *more])
    _reset()
    try:
        yield
    finally:
        monkeypatch.undo()
        _reset()


@pytest.fixture
def kernel():  # noqa: ANN201
    fn = kernels.paged_decode_attention()
    if fn is None:
        pytest.skip("no C compiler here: the kernel cannot be built (the torch path runs)")
    return fn


def _paged_case(lens: list[int], heads: int, kv_heads: int, seed: int, D: int = 8) -> dict:
    """A paged cache with each sequence's blocks scattered, and the padded reference inputs."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lens), max(lens)
    need = [-(-n // BS) for n in lens]
    perm = torch.randperm(sum(need) + 3, generator=g)
    kc = torch.randn(len(perm) * BS, kv_heads, D, generator=g)
    vc = torch.randn(len(perm) * BS, kv_heads, D, generator=g)
    read = torch.zeros((B, S), dtype=torch.long)  # padding reads slot 0, masked out
    at = 0
    for i, n in enumerate(lens):
        p = torch.arange(n)
        read[i, :n] = perm[at : at + need[i]][p // BS] * BS + p % BS
        at += need[i]
    pos = torch.arange(S)
    valid = pos[None, :] < torch.tensor(lens)[:, None]
    q = torch.randn(B, heads, D, generator=g)
    return dict(q=q, kc=kc, vc=vc, read=read, valid=valid, pos=pos.expand(B, S))


@pytest.mark.parametrize(
    "lens,heads,kv_heads",
    [
        ([1], 4, 2),
        ([37], 9, 3),
        ([5, 1, 17, 9, 33], 9, 3),  # GQA, one sequence of a single key
        ([12, 3, 40], 4, 1),  # MQA
        ([8, 21], 4, 4),  # MHA
        # sequences enough for tasks of all KV heads (reading each slot's row whole), while a
        # sequence alone runs as tasks of one head: its rows must come out bit for bit the same
        ([7, 30, 2, 19, 11, 1, 25, 4, 16], 9, 3),
    ],
)
@pytest.mark.parametrize("scale", [0.3, 6.0, 60.0])  # softmax weights down to e^-40, e^-400
# head sizes of the plain loops (8, 40) and of the AVX-512 path (multiples of 16 up to 256,
# unrolled for 32, 64 and 128)
@pytest.mark.parametrize("D", [8, 32, 40, 64, 80])
def test_kernel_equals_padded_torch_attention(kernel, lens, heads, kv_heads, scale, D) -> None:  # noqa: ANN001
    c = _paged_case(lens, heads, kv_heads, seed=len(lens) * heads, D=D)
    got = kernel(c["q"], c["kc"], c["vc"], c["read"], c["valid"].sum(1), scale)
    k, v = gather(c["kc"], c["read"]), gather(c["vc"], c["read"])
    q_pos = torch.tensor(lens) - 1
    want = attend_decode_group(c["q"], k, v, q_pos, c["pos"], c["valid"], scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale * D / 8)
    # as exact as the torch path: large scales and heads make both drift from float64 alike.
    # The allowance is 16 float32 ulps of the largest output: where torch lands unusually close
    # (1.8e-7 off) the kernel's plain loops (no AVX-512) may be 1.5e-6 off, still float32 noise;
    # built for a Sapphire Rapids guest (-march=native) they were 7.1e-6 off where torch was
    # 1.1e-6 (D 40, scale 6, MQA), over the 8 ulps allowed before
    exact = attend_decode_group(
        c["q"].double(), k.double(), v.double(), q_pos, c["pos"], c["valid"], scale
    )
    ulps = 16 * torch.finfo(torch.float32).eps * exact.abs().max()
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + ulps
    # each sequence alone gives the same rows, bit for bit: no sequence depends on the others
    for i in range(len(lens)):
        alone = kernel(
            c["q"][i : i + 1],
            c["kc"],
            c["vc"],
            c["read"][i : i + 1],
            c["valid"][i : i + 1].sum(1),
            scale,
        )
        assert torch.equal(alone[0], got[i])


def test_portable_build_without_avx512(
    kernel,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The plain-C loops (expf, no prefetch vectors) of CPUs without AVX-512: the same result."""
    c = _paged_case([5, 1, 37, 16], 9, 3, seed=3)
    args = (c["q"], c["kc"], c["vc"], c["read"], c["valid"].sum(1), 6.0)
    fast = kernel(*args)
    with _without_avx512(monkeypatch, tmp_path):
        plain = kernels.paged_decode_attention()
        assert plain is not None and plain is not kernel
        torch.testing.assert_close(plain(*args), fast, rtol=1e-5, atol=1e-6)


def test_loading_the_kernel_keeps_subnormal_numbers(kernel) -> None:  # noqa: ANN001
    """A library built with -ffast-math would turn on flush-to-zero for the whole process."""
    tiny = float("5e-324")
    assert tiny * 1.0 > 0.0
    assert torch.tensor([tiny], dtype=torch.float64).mul(1.0).item() > 0.0


def test_group_view_attend_writes_the_new_keys(kernel) -> None:  # noqa: ANN001
    cache = PagedKVCache(2, 2, 8, BS, 16, torch.float32)
    seqs = [SeqBlocks(), SeqBlocks()]
    for s, n in zip(seqs, (6, 10), strict=True):
        cache.reserve(s, n)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    view = cache.group_view(seqs, [5, 9])
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    out = view.attend(1, q, k, v, 0.5)
    assert out is not None
    assert torch.equal(cache.k[1, view.write], k) and torch.equal(cache.v[1, view.write], v)
    kp, vp, kpos, valid = view.update(1, k, v)
    want = attend_decode_group(q, kp, vp, torch.tensor([5, 9]), kpos, valid, 0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_joined_prompt_rows_equal_each_sequence_alone(kernel, window) -> None:  # noqa: ANN001
    """Several sequences' prompt chunks (PagedView.join: one K/V write, one kernel call, each
    row reading its sequence's slot list through ``which``) give every row the bits its
    sequence's own view gives it, and write the same K/V."""
    chunks = [(0, 7), (3, 9), (10, 11), (0, 1)]  # (start, end) of each sequence's rows
    cache = PagedKVCache(2, 2, 8, BS, 32, torch.float32)
    seqs = [SeqBlocks() for _ in chunks]
    for s, (_, end) in zip(seqs, chunks, strict=True):
        cache.reserve(s, end)
    g = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    views = [cache.view(s, a, b) for s, (a, b) in zip(seqs, chunks, strict=True)]
    positions = torch.cat([torch.arange(a, b) for a, b in chunks])
    T = len(positions)
    q, k, v = (torch.randn(T, n, 8, generator=g) for n in (4, 2, 2))
    k0, v0 = cache.k.clone(), cache.v.clone()
    alone, row = [], 0
    for view, (a, b) in zip(views, chunks, strict=True):
        rows = slice(row, row + b - a)
        out = view.attend(1, q[rows], k[rows], v[rows], positions[rows], 0.5, window)
        assert out is not None
        alone.append(out)
        row += b - a
    k1, v1 = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k0), cache.v.copy_(v0)
    joined = type(views[0]).join(views, positions)
    assert joined is not None
    got = joined.attend(1, q, k, v, 0.5, window)
    assert torch.equal(got, torch.cat(alone))
    assert torch.equal(cache.k, k1) and torch.equal(cache.v, v1)
    # and each row is softmax attention over its own sequence's keys, in float64 (GQA: query
    # head h reads KV head h // 2), the new rows' K/V among them
    row = 0
    for view, (a, b) in zip(views, chunks, strict=True):
        for p in range(a, b):
            lo = 0 if window is None else max(0, p - window + 1)
            slots = view.read[lo : p + 1]
            keys, vals = cache.k[1][slots].double(), cache.v[1][slots].double()
            for h in range(4):
                w = torch.softmax(keys[:, h // 2] @ q[row, h].double() * 0.5, 0)
                want = w @ vals[:, h // 2]
                torch.testing.assert_close(got[row, h].double(), want, rtol=1e-5, atol=1e-6)
            row += 1
    with pytest.raises(ValueError, match="which must name one of the 4 slot lists"):
        kernel(q, cache.k[1], cache.v[1], joined.lists, positions + 1, 0.5, joined.which + 1)


def test_off_switch_and_failed_build_fall_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path))
    try:
        monkeypatch.setenv("INFERFLOW_KERNELS", "0")
        _reset()
        assert kernels.paged_decode_attention() is None
        cache = PagedKVCache(1, 1, 4, BS, 4, torch.float32)
        seq = SeqBlocks()
        cache.reserve(seq, 3)
        view = cache.group_view([seq], [2])
        k = torch.ones(1, 1, 4)
        assert view.attend(0, torch.ones(1, 2, 4), k, k, 1.0) is None
        assert not cache.k.any()  # nothing written: the caller's update path writes
        assert not cache.kernel_decode()

        monkeypatch.setenv("INFERFLOW_KERNELS", "1")
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        _reset()
        with caplog.at_level(logging.WARNING, logger="inferflow.kernels"):
            assert kernels.paged_decode_attention() is None
        assert "not available, using the torch path" in caplog.text
        assert not os.listdir(tmp_path)  # no half-built file left behind
    finally:
        monkeypatch.undo()
        _reset()


def test_engine_with_kernel_equals_engine_without(
    tiny_model, kernel, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """Mixed lengths, arrivals between steps (tests/test_engine.py compares the engine, kernel
    and all, with each request run alone through the contiguous cache's torch path)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in (3, 40, 1, 17, 29)]

    def run(with_kernel: bool) -> list[list[int]]:
        eng = Engine(tiny_model, None, EngineConfig(SchedulerConfig(max_batched_tokens=48)))
        assert eng.cache.kernel_decode() is with_kernel
        free0 = eng.cache.alloc.num_free
        params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
        ids = [eng.add_request(prompts[0], params[0])]
        out: dict[str, list[int]] = {}
        step = 0
        while eng.has_unfinished() or len(ids) < len(prompts):
            if len(ids) < len(prompts) and step % 2:
                ids.append(eng.add_request(prompts[len(ids)], params[len(ids)]))
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
            step += 1
        assert eng.cache.alloc.num_free == free0
        return [out[i] for i in ids]

    with_kernel = run(True)
    monkeypatch.setenv("INFERFLOW_KERNELS", "0")
    _reset()
    try:
        without = run(False)
    finally:
        monkeypatch.delenv("INFERFLOW_KERNELS")
        _reset()
    assert with_kernel == without


def _rope_case(pairing: str, partial: float) -> tuple[Rotary, torch.Tensor, torch.Tensor]:
    rope = Rotary(PositionArgs(576, 9, 64, 4096, RopeOptions(pairing=pairing, partial=partial)))
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(37, (9 + 2 * 3) * 64, generator=g)  # a fused q / k / v projection's output
    return rope, qkv, torch.randint(0, 4000, (37,), generator=g)


@pytest.mark.parametrize("pairing", ["half", "adjacent"])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("fused", [True, False])
def test_rope_kernel_rotates_in_place_bit_for_bit(
    pairing: str, partial: float, fused: bool
) -> None:
    if kernels.rope_in_place() is None:
        pytest.skip("no C compiler here: the kernel cannot be built (the torch path runs)")
    rope, qkv, pos = _rope_case(pairing, partial)
    q, k = qkv[:, :576].view(37, 9, 64), qkv[:, 576:768].view(37, 3, 64)
    if not fused:  # separate buffers: one call each
        q, k = q.clone(), k.clone()
    cos, sin = rope.cos_sin(pos, torch.float32)
    want = rope._rotate_one(torch.cat((q, k), dim=1), cos, sin)  # the torch path, on copies
    v = qkv[:, 768:].clone()
    assert rope.rotate_(q, k, pos)
    assert torch.equal(q, want[:, :9]) and torch.equal(k, want[:, 9:])
    assert torch.equal(qkv[:, 768:], v)  # the values next to k are untouched


def test_rope_in_place_declines_where_the_kernel_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rope, qkv, pos = _rope_case("adjacent", 1.0)
    q, k = qkv[:, :576].view(37, 9, 64), qkv[:, 576:768].view(37, 3, 64)
    before = qkv.clone()
    cos, sin = rope.cos_sin(pos, torch.float32)
    want = rope._rotate_one(torch.cat((q, k), dim=1), cos, sin)
    aliased = qkv[:, :576].view(37, 9, 64)
    for case in ("grad", "bf16", "aliased", "off"):
        qq, kk = q, k
        if case == "grad":
            qq = q.clone().requires_grad_(True)
        elif case == "bf16":
            qq, kk = q.bfloat16(), k.bfloat16()
        elif case == "aliased":  # rotated twice if done in place
            qq, kk = aliased, aliased[:, :3]
        else:
            monkeypatch.setattr(kernels, "rope_in_place", lambda: None)
        assert not rope.rotate_(qq, kk, pos)  # declined, nothing changed
        assert torch.equal(qkv, before)
        if case == "aliased":
            continue
        q2, k2 = rope.rotate(qq, kk, pos)
        tol = dict(rtol=0.02, atol=0.05) if case == "bf16" else dict(rtol=0, atol=0)
        torch.testing.assert_close(q2.float(), want[:, :9], **tol)
        torch.testing.assert_close(k2.float(), want[:, 9:], **tol)
    assert torch.equal(qkv, before)  # rotate never changes its inputs


def test_rms_norm_kernel_against_float64_and_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels.rms_norm() is None:
        pytest.skip("no C compiler here: the kernel cannot be built (the torch path runs)")
    g = torch.Generator().manual_seed(9)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    x = torch.randn(300, 576, generator=g) * torch.logspace(-3, 3, 300)[:, None]  # row scales
    with torch.inference_mode():
        got = norm(x)
        x64, w64 = x.double(), norm.weight.double()
        want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)  # a few float32 ulp
        for i in (0, 7, 299):  # a row alone: bit for bit its row of the batch
            assert torch.equal(norm(x[i : i + 1]), got[i : i + 1])
        monkeypatch.setattr(kernels, "rms_norm", lambda: None)  # the torch path: same values
        torch.testing.assert_close(norm(x), got, rtol=1e-6, atol=0)
    with torch.enable_grad():  # autograd takes the torch path
        y = norm(x[:3].clone().requires_grad_(True))
        assert y.requires_grad


def test_silu_gate_kernel_against_float64_alone_and_without_avx512(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SiLU(gate) * up by rows.h's own expf: within a few float32 ulp of float64 over the whole
    range (gates below -88.7, whose exp overflows float32, give -0 against at most ~1e-36 |up|;
    NaN and the infinities as the expression gives them); a row alone and a column anywhere in
    its row get the same bits; builds without AVX-512 (AVX2's 8 at a time) and without AVX2 (the
    scalar loop) give the same bits as the AVX-512 one."""
    fast = kernels.silu_gate()
    if fast is None:
        pytest.skip("no C compiler here: the kernel cannot be built (the torch path runs)")
    g = torch.Generator().manual_seed(4)
    N, F = 37, 1003  # (F not a multiple of 16 or 8: a masked last vector, a scalar tail)
    gate = torch.randn(N, F, generator=g) * torch.logspace(-6, 2, N)[:, None]
    gate[0, :12] = torch.tensor([-120.0, -104.5, -103.9, -88.8, -87.3, -1e-40, 0.0, 1e-40, 88.8,
                                 89.5, 120.0, -0.0])  # fmt: skip
    gate[1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    up = torch.randn(N, F, generator=g)
    h = torch.cat([gate, up], 1)
    got = fast(h)
    g64, u64 = gate.double(), up.double()
    want = g64 / (1 + torch.exp(-g64)) * u64
    torch.testing.assert_close(got.double(), want, rtol=6e-7, atol=5e-36, equal_nan=True)
    assert got[0, :4].eq(0).all() and torch.signbit(got[0, :4]).ne(torch.signbit(up[0, :4])).all()
    for i in (0, 5, 36):  # a row alone: bit for bit its row of the batch
        assert torch.equal(fast(h[i : i + 1]), got[i : i + 1])
    rolled = torch.cat([gate.roll(7, 1), up.roll(7, 1)], 1)  # every column elsewhere in its row
    torch.testing.assert_close(fast(rolled), got.roll(7, 1), rtol=0, atol=0, equal_nan=True)
    for more in ((), ("-mno-avx2", "-mno-fma")):  # AVX2's 8 at a time, then one at a time
        with _without_avx512(monkeypatch, tmp_path, *more):
            plain = kernels.silu_gate()
            assert plain is not None and plain is not fast
            torch.testing.assert_close(plain(h), got, rtol=0, atol=0, equal_nan=True)


def test_a_changed_header_rebuilds_the_kernels_that_include_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if kernels.rms_norm() is None:
        pytest.skip("no C compiler here: the kernel cannot be built (the torch path runs)")
    src = tmp_path / "src"
    src.mkdir()
    for f in ("rows.c", "rows.h", "expf.h"):
        (src / f).write_bytes((kernels.HERE / f).read_bytes())
    monkeypatch.setattr(kernels, "HERE", src)
    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path / "cache"))
    first = kernels.build("rows")
    assert kernels.build("rows") == first  # cached
    (src / "rows.h").write_text((src / "rows.h").read_text() + "\n/* changed */\n")
    assert kernels.build("rows") != first  # a stale library would keep the old row code


@needs_proc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_costs_no_memory_until_written(dtype: torch.dtype) -> None:
    """A paged cache of 256-512 MiB (K and V) reads as zeros and is not resident until written
    (torch.zeros writes every byte: the process would grow by the whole cache)."""
    before = rss()
    cache = PagedKVCache(8, 4, 64, 16, 2048, dtype)  # K: 8 layers x 32768 slots x 4 x 64
    assert cache.k.numel() * cache.k.element_size() * 2 >= (256 << 20)
    assert rss() - before < (32 << 20)
    assert cache.k.dtype == dtype and not cache.k[:, :1000].any() and not cache.v[-1].any()
    cache.k[0, :16] = 1.0
    assert cache.k[0, :16].eq(1).all() and rss() - before < (64 << 20)


def test_prebuild_compiles_in_the_background_and_build_takes_its_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`kernel_build.prebuild` compiles on its own threads (what the CLI starts before `import
    torch`); a later `build` returns that library without compiling again."""
    if kernels.rms_norm() is None:
        pytest.skip("no C compiler here: the kernel cannot be built (the torch path runs)")
    import subprocess
    import threading

    from inferflow import kernel_build

    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path))
    compiled_on: list[str] = []
    real_run = subprocess.run

    def run(cmd, **kw):  # noqa: ANN001, ANN003, ANN202
        compiled_on.append(threading.current_thread().name)
        return real_run(cmd, **kw)

    monkeypatch.setattr(kernel_build.subprocess, "run", run)
    kernel_build.prebuild(["rows"])
    for t in threading.enumerate():
        if t.name.startswith("build-"):
            t.join()
    assert compiled_on == ["build-rows"]
    assert kernels.build("rows").parent == tmp_path and compiled_on == ["build-rows"]


def test_model_commands_start_the_kernel_builds_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from inferflow import kernel_build
    from inferflow.cli.main import main

    started: list[bool] = []
    monkeypatch.setattr(kernel_build, "prebuild", lambda: started.append(True))
    for command, expected in (("validate", []), ("generate", [True]), ("serve", [True, True])):
        with pytest.raises(SystemExit):
            main(["-v", command, "--help"])
        assert started == expected, command
