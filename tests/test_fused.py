"""The one-call decode path (inferflow.model.fused, kernels/quant_decode.c) and the C planes of
QuantLinear against independent float32 references: ``x @ W.dequantize().T`` for one layer, the
module path over a float model holding the dequantized weights for a whole decoder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from inferflow import kernels
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import SchedulerConfig
from inferflow.kernels import quant_decode
from inferflow.model.batch import ContiguousKVCache, FlatBatch
from inferflow.model.build import load_model
from inferflow.quant import quantize
from inferflow.quant.apply import QuantPolicy, quantize_model
from inferflow.quant.linear import AFFINE_VIEWS, QuantLinear, affine_parts
from inferflow.spec import load_spec
from tests.conftest import (
    AFFINE_WRITABLE,
    dequantized_copy,
    load_quant_llama,
    random_blocks,
    randomize,
    spec_doc,
)


def _reset() -> None:
    kernels._library.cache_clear()
    quant_decode.library.cache_clear()


@pytest.fixture(scope="module")
def lib():  # noqa: ANN201
    if quant_decode.library() is None:
        pytest.skip("no C compiler here: the kernel cannot be built (the torch paths run)")
    return quant_decode.library()


def test_8_bit_tiles_reuse_the_codes_storage(lib) -> None:  # noqa: ANN001
    """An 8-bit plane in tiles (AVX-512 builds) is laid out in the decoded codes' own storage,
    a few tiles at a time (1,100 tiles here: two steps), so a large table (Gemma-3's Q8_0
    embedding, 168 MB) is never held twice; its rows and products stay the codec's."""
    if not quant_decode.tiles16_built():
        pytest.skip("this build keeps 8-bit codes as rows (no AVX-512)")
    g = torch.Generator().manual_seed(0)
    qt = quantize(torch.randn(16 * 1100, 256, generator=g) * 0.05, "Q8_0")
    codes, scale, mn = affine_parts(qt)
    plane = quant_decode.make_plane(codes, scale, mn, 256, 128)
    assert plane is not None and plane.codes.dim() == 5
    assert plane.codes.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
    ids = torch.tensor([0, 17, 16 * 1024 + 3, 16 * 1100 - 1])
    assert torch.equal(plane.rows(ids), qt.dequantize()[ids])
    x = torch.randn(3, 256, generator=g)
    ref = x.double() @ qt.dequantize().double().t()
    assert float((plane.matmul_f32(x) - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("name", [*AFFINE_WRITABLE, "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_plane_matvec_matches_dequantize(name: str, lib) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    if name.endswith("_K"):
        qt = random_blocks(name, 96, 512)
    else:
        w = torch.randn(200, 576, generator=g) * 0.05 + torch.randn(200, 1, generator=g) * 0.05
        qt = quantize(w, name)
    view = AFFINE_VIEWS.get(qt.format)
    plane = quant_decode.make_plane(*affine_parts(qt), view.levels, view.zero)
    assert plane is not None
    # symmetric formats (the codec's min is -zero * scale) hold no mins: the kernels derive them
    symmetric = name in ("Q4_0", "Q5_0", "Q8_0", "Q3_K", "Q6_K")
    assert (plane.min is None) == symmetric
    # 4-bit tiles; 5-bit ones (a tile of the low four bits and a plane of the fifth) where the
    # groups are multiples of 32; 6-bit ones (Q6_K, Q6: a tile of the low four bits and a plane
    # of the top two) on AVX-512 builds; else one byte per code. Groups of 16 go in tiles on
    # AVX-512 builds only.
    tiles = view.group % 32 == 0 or quant_decode.tiles16_built()
    five = view.levels in (17, 32) and view.group % 32 == 0  # (no format has 17..31 levels)
    six = 32 < view.levels <= 64 and quant_decode.tiles16_built()
    assert plane.bits == (4 if view.levels <= 16 and tiles else 5 if five else 6 if six else 8)
    if plane.bits in (5, 6):
        assert plane.high is not None
        assert (
            plane.codes.nbytes + plane.high.nbytes
            == -(-qt.shape[0] // 16) * 16 * qt.shape[1] * plane.bits // 8
        )
    # the writable formats' scales and mins are their blocks' float16 fields: exact in float16,
    # so held so where the build reads them (k-quants' d * sub-scale products stay float32)
    half = quant_decode.half_built() and name in AFFINE_WRITABLE
    dtypes = {t.dtype for t in (plane.scale, plane.min) if t is not None}
    assert dtypes == {torch.float16 if half else torch.float32}
    x = torch.randn(7, qt.shape[1], generator=g)  # (rows of x go 2-4 at a time: 7 = 4 + 3)
    ref = (x.double() @ qt.dequantize().double().t()).float()
    # float32 sums of <= 576 terms: accumulation-order noise only
    bound = 1e-5 * (x.abs() @ qt.dequantize().abs().t()) + 1e-6
    assert ((plane.matvec(x) - ref).abs() <= bound).all()
    # rows read back from the plane (a tied embedding's lookups) are the codec's values exactly
    ids = torch.tensor([0, qt.shape[0] - 1, 17, 5, 5, 16])
    assert torch.equal(plane.rows(ids), qt.dequantize()[ids])
    # QuantLinear holds the plane alone and takes every call there: one row through matvec,
    # more rows through the many-row kernel, which gives each row the same float32 operations
    ql = QuantLinear(qt)
    assert ql.plane is not None and ql.kernel_name == "plane" and ql.nbytes == ql.plane.nbytes
    assert ql.nbytes <= plane.nbytes  # (k-quants' scales in two levels: fewer)
    assert torch.equal(ql(x[:1]), plane.matvec(x[:1]))
    many = plane.matmul_f32(x)
    assert ((many - ref).abs() <= bound).all()
    assert torch.equal(ql(x), many)
    # batch invariance: a row's outputs are the same bits alone, in any company, at any place
    assert torch.equal(many, plane.matvec(x))
    for rows in ([3], [6, 0], [5, 1, 2], [4, 4, 0, 6, 2]):
        assert torch.equal(plane.matmul_f32(x[rows]), many[rows])


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_scales_stay_in_the_files_two_levels(name: str, lib) -> None:  # noqa: ANN001
    """AVX-512 tiles hold a k-quant's scales as the file does (a float16 d per 256 weights,
    int8 sub-scales per group; mins likewise): the float32 products and rows are those of the
    plane with float32 group scales, bit for bit, in fewer bytes (Q4_K: 0.58 bytes a weight
    against the file's 0.5625, was 0.75). 8-bit products too, except where VNNI takes x in
    super-blocks over the integer sub-scales (x_per 256: tests/test_act8.py holds those against
    gguf-py's weights)."""
    if not quant_decode.tiles16_built():
        pytest.skip("two-level scales are read by the AVX-512 tiles only")
    qt = random_blocks(name, 72, 768)
    view = AFFINE_VIEWS.get(name)
    flat = quant_decode.make_plane(*affine_parts(qt), view.levels, view.zero)
    two = QuantLinear(qt).plane
    assert flat is not None and two is not None and flat.sb == 0
    assert two.sb == 256 // view.group and two.sc8 is not None and two.sc8.dtype == torch.int8
    assert two.nbytes < flat.nbytes
    if name == "Q4_K":  # (72 rows are 5 tiles of 16: 80 rows held)
        assert two.nbytes <= 1.03 * qt.data.nbytes * 80 / 72
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(2))
    assert torch.equal(two.matmul_f32(x), flat.matmul_f32(x))
    if two.x_per() == 32:
        assert torch.equal(two.matmul_f32(x, True), flat.matmul_f32(x, True))
    ids = torch.tensor([0, 71, 17, 5, 16])
    assert torch.equal(two.rows(ids), qt.dequantize()[ids])


@pytest.mark.parametrize("name", ["Q4_B32", "Q4_B64", "Q3H", "Q4_1", "Q4_0"])
def test_plane_keeps_float32_activations(name: str, lib) -> None:  # noqa: ANN001
    """x values bf16 cannot hold (1 + 2^-9 + 2^-18 + 2^-20, times powers of two) and positive
    weights (no cancellation): one bf16 rounding of x would be off by ~2e-3, a two-part bf16
    split by ~4e-6 in the same direction everywhere; the one-row kernel's float32 summation
    stays near 1e-7."""
    g = torch.Generator().manual_seed(0)
    qt = quantize(torch.rand(200, 576, generator=g) + 0.1, name)
    w = qt.dequantize().double()
    assert (w > 0).all()
    plane = quant_decode.make_plane(*affine_parts(qt), AFFINE_VIEWS.get(name).levels)
    assert plane is not None
    exact = (1 + 2**-9 + 2**-18 + 2**-20) * 2.0 ** torch.randint(-3, 4, (2, 576), generator=g)
    x = exact.float()
    assert torch.equal(x.double(), exact)
    ref = x.double() @ w.t()
    assert ((plane.matvec(x).double() - ref).abs() / ref).max() < 1e-6
    # the many-row kernel: the same operations per row
    assert torch.equal(plane.matmul_f32(x), plane.matvec(x))


def test_forced_int4pack_builds_no_plane() -> None:
    # quant: {kernel: int4pack} is torch's kernel alone (bf16 activations), no C plane
    qt = quantize(torch.randn(64, 64), "Q4_B32")
    forced, auto = QuantLinear(qt, kernel="int4pack"), QuantLinear(qt)
    assert forced.plane is None and forced.kernel_name == "int4pack"
    assert auto.kernel_name == "plane" and auto.nbytes == auto.plane.nbytes


def test_no_plane_where_the_kernel_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERFLOW_KERNELS", "0")
    _reset()
    try:
        ql = QuantLinear(quantize(torch.randn(64, 64), "Q4_B32"))
        assert ql.plane is None
        assert ql(torch.randn(1, 64)).shape == (1, 64)
    finally:
        monkeypatch.delenv("INFERFLOW_KERNELS")
        _reset()


# --- whole decoders ------------------------------------------------------------------------


def _load(quant_llamas: dict[str, Path], write_spec, network: dict | None = None):  # noqa: ANN001, ANN202
    return load_quant_llama(quant_llamas["untied"], write_spec, **(network or {}))


POLICY = QuantPolicy(
    default="Q4_B32",
    overrides=[
        ("dec.*.feed_forward.w13", "Q3H"),
        ("dec.*.self_attn.wo", "Q8"),
        ("dec.1.*", "Q4_0"),
    ],
)


def _quantized_and_reference(model):  # noqa: ANN001, ANN202
    """(model quantized by POLICY, float copy holding each weight's dequantized value). The
    model decodes a token while still float first: its stack must decide again afterwards."""
    ref = dequantized_copy(model, POLICY)
    _token_by_token(model, [1])
    assert model.dec.fused_decode() is None  # float projections
    quantize_model(model, POLICY)
    return model, ref


def _token_by_token(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Logits after each token, every token fed alone (each one a one-token decode step)."""
    h = model.spec.hparams
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, len(ids), torch.float32)
    out = []
    with torch.no_grad():
        for i, t in enumerate(ids):
            out.append(model(FlatBatch.single(torch.tensor([t]), i, cache))[0])
    return torch.stack(out)


def _prefill(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Logits of every row, the whole prompt in one forward pass."""
    h = model.spec.hparams
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, len(ids), torch.float32)
    batch = FlatBatch.single(torch.tensor(ids), 0, cache)
    batch.logits_rows = torch.arange(len(ids))
    with torch.no_grad():
        return model(batch)


@pytest.mark.parametrize(
    "network",
    [
        None,
        {"position": {"type": "rope", "pairing": "adjacent"}},
        {"position": {"type": "rope", "partial": 0.5}, "norm": "rms_offset"},
    ],
    ids=["llama", "adjacent", "partial-offset"],
)
def test_fused_decoder_matches_the_dequantized_float_model(
    quant_llamas: dict[str, Path],
    write_spec,  # noqa: ANN001
    network: dict | None,
    lib,  # noqa: ANN001
) -> None:
    """Token by token, and the whole prompt in one call (every row's logits: a prompt's later
    rows read the K/V its earlier rows wrote in the same call), against the float model
    holding the dequantized weights."""
    model, ref = _quantized_and_reference(_load(quant_llamas, write_spec, network))
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = _token_by_token(model, ids)
    assert model.dec.fused_decode() is not None  # the one-call path ran
    assert ref.dec.fused_decode() is None  # float projections: the module path
    want = _token_by_token(ref, ids)
    for got in (ours, _prefill(model, ids)):
        err = (got - want).abs().max() / want.abs().max()
        assert err < 1e-5, f"relative error {err:.2e}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def _tiny_hf(tmp: pytest.TempPathFactory, write_spec, arch: str, hidden: int, inner: int):  # noqa: ANN001, ANN202
    """A two-layer random transformers model of ``arch`` (llama, qwen2: 4 heads, 2 KV heads),
    saved and loaded float32 by its spec."""
    tf = pytest.importorskip("transformers")
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    config, causal = classes[arch]
    cfg = getattr(tf, config)(
        hidden_size=hidden, intermediate_size=inner, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = getattr(tf, causal)(cfg)
    randomize(hf)
    d = tmp.mktemp(arch)
    hf.save_pretrained(d)
    return load_model(load_spec(write_spec(spec_doc(arch, d, "safetensors"))), torch.float32)


def test_qkv_bias_is_read_by_the_fused_decoder(
    tmp_path_factory: pytest.TempPathFactory,
    write_spec,  # noqa: ANN001
    lib,  # noqa: ANN001
) -> None:
    """A qwen2 stack (biases on q, k and v only) decodes in the one call too, against the
    float model holding the dequantized weights; without the bias the kernel would be off by
    the bias's share of each logit (checked: the model's biases are not zero)."""
    model = _tiny_hf(tmp_path_factory, write_spec, "qwen2", hidden=128, inner=192)
    model, ref = _quantized_and_reference(model)
    bias = model.dec.layers()[0].self_attn.wqkv.bias
    assert bias is not None and float(bias.abs().max()) > 0.01
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = _token_by_token(model, ids)
    assert model.dec.fused_decode() is not None
    want = _token_by_token(ref, ids)
    err = (ours - want).abs().max() / want.abs().max()
    assert err < 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", ["act8", "float32"])
def test_a_token_decoded_in_one_call_equals_it_prefilled(dtype: str, lib) -> None:  # noqa: ANN001
    """SmolLM2's logits for a prompt's last token are the same bits whether the prompt runs
    through the modules (the batched RMS norm, the products, the C SiLU gate, the paged
    attention kernel), through the one-call C decode (quant_decode.c's decode_stack, every
    prompt row in one call), or the token is one one-call decode step after the rest; so are
    K and V of every position in every layer (each row's states through each layer): what a
    model drafting for itself needs for every draft to be accepted, and what lets a prompt's
    rows take either path. (Under act8 one flipped 8-bit code moves a logit by up to ~0.5.)"""
    from inferflow.model.batch import ContiguousKVCache
    from inferflow.runtime import load
    from tests.conftest import smollm2_path

    smollm2_path()
    lm = load("smollm2-135m-instruct", dtype)
    m, h = lm.model, lm.model.spec.hparams
    ids = lm.tokenizer.encode("Copy the code: def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    n = len(ids)
    caches = [
        ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, n, torch.float32) for _ in "abc"
    ]
    with torch.no_grad():
        fused = m.dec.fused_decode()
        assert fused is not None
        m.dec._fused = None  # the modules
        modules = m(FlatBatch.single(torch.tensor(ids), 0, caches[0]))
        m.dec._fused = fused  # the one-call C decode
        prefilled = m(FlatBatch.single(torch.tensor(ids), 0, caches[1]))
        m(FlatBatch.single(torch.tensor(ids[:-1]), 0, caches[2]))
        last = m(FlatBatch.single(torch.tensor(ids[-1:]), n - 1, caches[2]))
    assert torch.equal(modules[-1], prefilled[-1])
    assert torch.equal(modules[-1], last[-1])
    for c in caches[1:]:
        assert torch.equal(caches[0].k[:, :n], c.k[:, :n])
        assert torch.equal(caches[0].v[:, :n], c.v[:, :n])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_the_last_layer_runs_only_the_rows_asked_for(
    quant_llamas: dict[str, Path],
    write_spec,  # noqa: ANN001
    lib,  # noqa: ANN001
    kv_dtype: torch.dtype,
) -> None:
    """Asked for some rows' outputs only (those that need logits), the one-call decode gives
    each of them the bits it gives when every row's output is asked for, and writes every
    row's K/V of every layer the same (the last layer's too: later steps attend to them).
    (Checked to fail with the kept rows' q, x, key counts or lists left unmoved.)"""
    model, ref = _quantized_and_reference(_load(quant_llamas, write_spec))
    h = model.spec.hparams
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(5))
    n = len(ids)

    def run(m, rows: list[int] | None) -> tuple[torch.Tensor, ContiguousKVCache]:  # noqa: ANN001
        cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, n, kv_dtype)
        batch = FlatBatch.single(ids, 0, cache)
        keep = None if rows is None else torch.tensor(rows, dtype=torch.long)
        with torch.no_grad():
            return m.dec.run_layers(m.dec.embed(batch), batch, keep), cache

    assert model.dec.fused_decode() is not None and ref.dec.fused_decode() is None
    every, want = run(model, None)
    floats, _ = run(ref, None)  # (the float model of the dequantized weights, the modules)
    assert every.shape == (n, h.hidden)
    # (rows out of order or repeated: every row computed, then those picked)
    for rows in ([n - 1], [0, 4, 5, 17, n - 1], [], list(range(n)), [1, 2, 3, 4, 5], [7, 2, 7]):
        got, cache = run(model, rows)
        assert torch.equal(got, every[rows]), rows
        torch.testing.assert_close(got, floats[rows], rtol=1e-4, atol=1e-4 * floats.abs().max())
        assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v), rows


def test_engine_single_sequence_decode_is_fused(
    quant_llamas: dict[str, Path], write_spec, lib
) -> None:  # noqa: ANN001
    """The engine's paged cache (a one-sequence decode group) feeds the same kernel; greedy
    tokens equal the module path on the same quantized weights (float32 one-row planes)."""
    model, _ = _quantized_and_reference(_load(quant_llamas, write_spec))
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(7)).tolist()

    def greedy() -> list[int]:
        eng = Engine(model, None, EngineConfig(SchedulerConfig(max_batched_tokens=8), block_size=4))
        free0 = eng.cache.alloc.num_free
        rid = eng.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        out: list[int] = []
        while eng.has_unfinished():
            for o in eng.step():
                assert o.request_id == rid
                out.extend(o.token_ids)
        assert eng.cache.alloc.num_free == free0
        return out

    fused = greedy()
    assert model.dec.fused_decode() is not None
    model.dec._fused = None  # the module path from now on
    assert greedy() == fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [32, 64, 80, 128, 256])
def test_a_prompts_rows_at_once_are_each_row_alone(lib, D: int, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The one-call decode takes a prompt's rows a few at a time in one attention task
    (attend_rows_any: a block of keys read once for all of them): every row's output is the
    bits it gets alone as a decode row, and softmax(q K^T s) V in float64 within float32's
    rounding. Blocks of 1 to 4 rows, keys in scattered slots, key counts across the 16-key
    blocks (and, D = 128, more rows than one pass keeps in the registers)."""
    g = torch.Generator().manual_seed(D)
    S = 80
    slots = torch.randperm(S, generator=g)
    k = torch.randn(S, D, generator=g).to(dtype)
    v = torch.randn(S, D, generator=g).to(dtype)
    scale = D**-0.5
    for lens in ([1, 2], [15, 16, 17], [31, 32, 33, 34], [5, 40, 16, 80], [64], [70, 71, 72, 73]):
        q = torch.randn(len(lens), D, generator=g) * 3
        at_once = quant_decode.attend_rows(q, k, v, slots, lens, scale)
        alone = quant_decode.attend_rows(q, k, v, slots, lens, scale, one_by_one=True)
        assert torch.equal(at_once, alone), lens
        for r, n in enumerate(lens):
            keys, vals = k[slots[:n]].double(), v[slots[:n]].double()
            want = torch.softmax(keys @ q[r].double() * scale, 0) @ vals
            torch.testing.assert_close(at_once[r].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [None, "float16", "q8"])
def test_engine_prompts_in_one_call_equal_the_modules_alone(
    quant_llamas: dict[str, Path],
    write_spec,  # noqa: ANN001
    lib,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
    kv_dtype: str | None,
) -> None:
    """A step's rows of several prompts (chunked, beside decode rows) in one decode_stack
    call, each row reading its own sequence's slot list (a prompt's rows a few at a time in
    one attention task: attend_rows_any), with each KV cache type: every generated token's
    log-probs (the top two too) are the bits each prompt gets alone through the module path."""
    from inferflow.model import fused as fused_mod

    model, _ = _quantized_and_reference(_load(quant_llamas, write_spec))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 33, 12, 27)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2)
    shared: list[bool] = []  # per fused call: whether rows shared their sequence's list
    row_slots = fused_mod.row_slots

    def spy(batch):  # noqa: ANN001, ANN202
        got = row_slots(batch)
        shared.append(got is not None and got[3] is not None)
        return got

    monkeypatch.setattr(fused_mod, "row_slots", spy)

    def run(group: list[list[int]]) -> list[list]:
        sched = SchedulerConfig(max_batched_tokens=48, max_prefill_tokens=40)
        eng = Engine(model, None, EngineConfig(sched, block_size=4, kv_cache_dtype=kv_dtype))
        rids = [eng.add_request(p, params) for p in group]
        seen: dict[str, list] = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                seen[o.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]
        return [seen[r] for r in rids]

    model.dec.forget_fused()
    batched = run(prompts)
    assert model.dec.fused_decode() is not None and any(shared)
    model.dec._fused = None  # the module path from now on
    alone = [run([p])[0] for p in prompts]
    assert batched == alone


@pytest.mark.parametrize(
    "network,policy,why",
    [
        ({"attention": {"sliding_window": 16}}, "Q4_B32", "sliding window"),
        ({"attention": {"softcap": 30.0}}, "Q4_B32", "soft-cap"),
        (None, None, "without a C plane"),  # dec.1.self_attn.wo stays float
    ],
)
def test_other_stacks_keep_the_module_path(
    quant_llamas: dict[str, Path],
    write_spec,  # noqa: ANN001
    network: dict | None,
    policy: str | None,
    why: str,
    caplog: pytest.LogCaptureFixture,
    lib,  # noqa: ANN001
) -> None:
    model = _load(quant_llamas, write_spec, network)
    overrides = [] if policy else [("dec.1.self_attn.wo", None)]
    quantize_model(model, QuantPolicy(default="Q4_B32", overrides=overrides))
    with caplog.at_level(logging.INFO, logger="inferflow.model.fused"):
        assert model.dec.fused_decode() is None
    assert why in caplog.text
    ids = [3, 1, 4, 1, 5]
    assert _token_by_token(model, ids).shape == (5, 256)  # the module path runs instead


@pytest.mark.parametrize(
    "flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-fma"]], ids=["vector-types", "no-fma"]
)
def test_portable_builds(
    flags: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    quant_llamas: dict[str, Path],
    write_spec,  # noqa: ANN001
    lib,  # noqa: ANN001
) -> None:
    """The loops that CPUs without AVX-512 (GCC vector types), and without FMA, compile: the
    same references, and the same bits per row whatever the number of rows."""
    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, *flags])
    _reset()
    try:
        assert quant_decode.library() is not None
        for name in ("Q4_B64", "Q5_1", "Q8_0", "Q4_0", "Q6_K"):
            g = torch.Generator().manual_seed(1)
            qt = (
                random_blocks(name, 100, 256)
                if name == "Q6_K"
                else quantize(torch.randn(100, 256, generator=g), name)
            )
            view = AFFINE_VIEWS.get(name)
            plane = quant_decode.make_plane(*affine_parts(qt), view.levels, view.zero)
            assert plane is not None
            x = torch.randn(7, 256)
            ref = (x.double() @ qt.dequantize().double().t()).float()
            bound = 1e-5 * (x.abs() @ qt.dequantize().abs().t()) + 1e-6
            assert ((plane.matvec(x) - ref).abs() <= bound).all()
            assert torch.equal(plane.matmul_f32(x), plane.matvec(x)), name
        model, ref_model = _quantized_and_reference(_load(quant_llamas, write_spec))
        ids = [5, 17, 200, 3, 99, 42, 7, 128]
        ours, want = _token_by_token(model, ids), _token_by_token(ref_model, ids)
        assert model.dec.fused_decode() is not None
        assert (ours - want).abs().max() / want.abs().max() < 1e-5
    finally:
        monkeypatch.undo()
        _reset()


def test_a_prompt_through_the_gated_ffn_a_few_rows_at_a_time(lib, monkeypatch) -> None:  # noqa: ANN001
    """Many rows (a prompt) go through GatedFFN a few at a time (ffn.PASS_BYTES: the gated
    hidden rows stay in the caches and below glibc's mmap ceiling): on quantized W13 / W2
    (batch-invariant products) the rows come out bit for bit as all at once."""
    import torch.nn.functional as F

    from inferflow.blocks import ffn
    from inferflow.spec.types import HParams

    g = torch.Generator().manual_seed(3)
    block = ffn.GatedFFN(ffn.FFNArgs(64, 96, F.silu, False, HParams.__new__(HParams)))
    block.w13 = QuantLinear(quantize(torch.randn(192, 64, generator=g) * 0.1, "Q4_0"))
    block.w2 = QuantLinear(quantize(torch.randn(64, 96, generator=g) * 0.1, "Q4_0"))
    x = torch.randn(37, 64, generator=g)
    whole = block(x)
    passes: list[int] = []
    rows = block._rows
    monkeypatch.setattr(block, "_rows", lambda t: passes.append(len(t)) or rows(t))
    monkeypatch.setattr(ffn, "PASS_BYTES", 5 * 2 * 96 * 4)  # (5 rows a pass)
    assert torch.equal(block(x), whole)
    assert passes == [5] * 7 + [2]


def test_projections_in_two_formats_decode_in_one_call(
    tmp_path_factory: pytest.TempPathFactory,
    write_spec,  # noqa: ANN001
    lib,  # noqa: ANN001
) -> None:
    """q/k/v whose q and k rows are Q4_K and v rows Q6_K (as Q4_K_M files hold them), and a
    gated FFN whose gate is Q4_K and up Q6_K: each layer of two planes, which the one-call
    decode writes into one output row; token by token and a whole prompt against the float
    model holding the dequantized weights (v's rows or up's dropped or misplaced would be off
    by their whole share)."""
    model = _tiny_hf(tmp_path_factory, write_spec, "llama", hidden=256, inner=512)
    policy = QuantPolicy(default="Q4_K")
    ref = dequantized_copy(model, policy)
    splits = {"self_attn.wqkv": 256 + 128, "feed_forward.w13": 512}  # rows before the Q6_K ones
    parts: dict[str, list] = {}
    for i, layer in enumerate(model.dec.layers()):
        for name, rows in splits.items():
            w = layer.get_submodule(name).weight.detach()
            parts[f"{i}.{name}"] = [quantize(w[:rows], "Q4_K"), quantize(w[rows:], "Q6_K")]
            exact = torch.cat([q.dequantize() for q in parts[f"{i}.{name}"]])
            with torch.no_grad():
                ref.dec.layers()[i].get_submodule(name).weight.copy_(exact)
    quantize_model(model, policy)
    for i, layer in enumerate(model.dec.layers()):
        for name in splits:
            two = QuantLinear.from_row_parts(parts[f"{i}.{name}"])
            assert two is not None and two.tail is not None
            owner, attr = name.split(".")
            setattr(layer.get_submodule(owner), attr, two)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = _token_by_token(model, ids)
    assert model.dec.fused_decode() is not None  # the one-call path ran
    want = _token_by_token(ref, ids)
    for got in (ours, _prefill(model, ids)):
        err = (got - want).abs().max() / want.abs().max()
        assert err < 1e-5, f"relative error {err:.2e}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
