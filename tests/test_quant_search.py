"""The searching quantizer of Inferflow's formats and importance matrices, against independent
computations: errors from plain dequantization, activations from transformers' own modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inferflow import kernels
from inferflow.errors import CheckpointError, QuantError
from inferflow.imatrix import ImportanceMatrix, collect
from inferflow.quant import MINMAX_FORMATS, minmax, quantize
from inferflow.runtime import LanguageModel
from inferflow.spec import load_spec
from tests.conftest import tiny_llama


def _errors(w: torch.Tensor, fmt: str, method: str, imp: torch.Tensor):
    """Per block: (the search's objective, the plain squared error) of ``w`` (rows, cols)
    quantized, from dequantization; the objective weights ``v = imp * sqrt(2 mean(w^2) + w^2)``
    (the block's mean), as quant/minmax.py documents."""
    block = 64 if fmt in ("Q6", "Q5", "Q4_B64", "Q3H") else 32
    d = quantize(w, fmt, method, imp).dequantize().double().reshape(-1, block)
    x = w.double().reshape(-1, block)
    v = imp.double().reshape(-1, block).repeat(w.shape[0], 1)
    v = v * (2 * x.square().mean(1, keepdim=True) + x.square()).sqrt()
    sq = (d - x).square()
    return (v * sq).sum(1), sq.sum(1)


def _heavy_tailed(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    # a few outliers per row, as trained weights have: min-max spends its range on them
    idx = torch.randint(0, cols, (rows, 3), generator=g)
    return w.scatter(1, idx, torch.randn(rows, 3, generator=g) * 0.15)


@pytest.fixture(params=["c", "torch"])
def search_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The search through its C kernel (quant_search.c; skipped where none builds) or through
    minmax.py's torch passes."""
    if request.param == "torch":
        monkeypatch.setattr(minmax.kernels, "search_blocks", lambda: None)
    elif kernels.search_blocks() is None:
        pytest.skip("the quant_search C kernel cannot be built here (no C compiler)")
    return str(request.param)


@pytest.mark.parametrize("fmt", MINMAX_FORMATS)
def test_search_beats_min_max_in_squared_error(fmt: str, search_path: str) -> None:
    """In its objective the search is never worse than min-max in any block (min-max's grid is
    one of its candidates), and over the tensor both the objective and the plain squared error
    are clearly lower; through the C kernel and through torch."""
    w = _heavy_tailed(64, 256, 0)
    imp = torch.rand(256, generator=torch.Generator().manual_seed(1)) + 0.1
    mm, mm_sq = _errors(w, fmt, "minmax", imp)
    se, se_sq = _errors(w, fmt, "search", imp)
    assert bool((se <= mm * (1 + 1e-6) + 1e-15).all())
    # measured here: 13-64% less of either (Q2 gains most: min-max wastes 1 of its 4 levels)
    assert float(se.sum()) < 0.9 * float(mm.sum()), (float(se.sum()), float(mm.sum()))
    assert float(se_sq.sum()) < 0.92 * float(mm_sq.sum())


@pytest.mark.parametrize("fmt", ["Q4_B32", "Q4_B64", "Q3_B32", "Q2", "Q3H"])
def test_c_search_chooses_the_grids_of_the_torch_search(fmt: str) -> None:
    """The C kernel runs minmax.py's algorithm: the same (min, scale) per block but for blocks
    where float32 sums in another order tip a near tie (measured: <= 1% of blocks here; Q5, Q6
    and Q8, with 32-256 levels, have many more near ties: 2-30%, and are left out)."""
    if kernels.search_blocks() is None:
        pytest.skip("the quant_search C kernel cannot be built here (no C compiler)")
    lay = next(lay for lay in minmax.MINMAX_LAYOUTS if lay.name == fmt)
    w = _heavy_tailed(512, 256, 3).reshape(-1, lay.block_size)
    imp = (torch.rand(w.shape, generator=torch.Generator().manual_seed(4)) + 0.1, None)
    for v in imp:
        lo, sc = minmax._search_grid(w, lay, v)
        head, codes = kernels.search_blocks()(w, v, lay.levels - 1)
        same = (head[:, :1] == lo) & (head[:, 1:] == sc)
        assert float(same.float().mean()) >= 0.98
        q = minmax.codes_on_grid(w, lo.float(), sc.float(), lay.levels - 1)
        assert torch.equal(codes[same[:, 0]].float(), q[same[:, 0]])


def test_search_keeps_the_layout_and_exact_grids() -> None:
    """Weights already on a grid that the layout can store come back exactly; the bytes decode
    with the format's one decoder (quantize's output is an ordinary QuantTensor)."""
    q = torch.randint(0, 16, (8, 32)).float()
    q[:, 0], q[:, 1] = 0, 15  # every block spans the whole grid
    w = q * 0.0078125 - 0.0625  # scale and min exact in fp16
    t = quantize(w, "Q4_B32", "search")
    assert t.format == "Q4_B32" and torch.equal(t.dequantize(), w)


def test_importance_moves_the_error_to_unimportant_columns() -> None:
    w = _heavy_tailed(32, 64, 1)
    v = torch.ones(64)
    v[:8] = 100.0  # columns 0..7 carry large activations
    plain = (quantize(w, "Q3H", "search").dequantize() - w).square()[:, :8].sum()
    weighted = (quantize(w, "Q3H", "search", v).dequantize() - w).square()[:, :8].sum()
    assert float(weighted) < 0.7 * float(plain)
    with pytest.raises(QuantError, match="64 positive values"):
        quantize(w, "Q3H", "search", torch.ones(32))
    with pytest.raises(QuantError, match="allowed: minmax, search"):
        quantize(w, "Q3H", "best")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tiny")
    ref, model = tiny_llama(d, vocab_size=100)
    spec = load_spec(d / "spec.yaml")
    return ref, LanguageModel(spec, model, None), d


def test_imatrix_matches_transformers_activations(tiny, tmp_path: Path) -> None:
    """Sum of squared inputs per column of every projection, and of the head's input, from
    forward hooks on transformers' own modules over the same windows."""
    ref, lm, _ = tiny
    ids = torch.randint(3, 100, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    m = collect(lm, ids, 64, None, bos=1)
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_mod, args) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.square().sum(0)

        return record

    hooks = [
        mod.register_forward_pre_hook(hook(n + ".weight"))
        for n, mod in ref.named_modules()
        if isinstance(mod, torch.nn.Linear)
    ]
    with torch.no_grad():
        for w in range(3):
            ref(torch.tensor([[1, *ids[w * 64 + 1 : (w + 1) * 64]]]))
    for h in hooks:
        h.remove()
    assert set(m.sums) == set(sums)  # every projection and lm_head, under the checkpoint's names
    for n, s in sums.items():
        assert m.counts[n] == 3 * 64 and m.chunks == 3
        torch.testing.assert_close(m.sums[n], s, rtol=1e-4, atol=1e-6)


def test_imatrix_file_round_trip_and_checks(tiny, tmp_path: Path) -> None:
    _, lm, d = tiny
    ids = list(range(3, 67))
    m = collect(lm, ids, 64, 1, dataset="t.txt")
    out = tmp_path / "im.gguf"
    m.write(out)
    back = ImportanceMatrix.read(out)
    assert back.datasets == ["t.txt"] and back.chunks == 1 and back.chunk_size == 64
    assert set(back.sums) == set(m.sums)
    for n in m.sums:
        assert back.counts[n] == m.counts[n]
        torch.testing.assert_close(back.sums[n], m.sums[n].float().double())
    from inferflow.loaders import open_files

    src = open_files("hf", [d])
    back.check(src, "x")  # its own model: fine
    back.sums = {"model.layers.0.mlp.down_proj.weight": torch.ones(64)}
    with pytest.raises(QuantError, match="96 columns in the checkpoint but 64"):
        back.check(src, "x")
    back.sums = {"blk.0.attn_q.weight": torch.ones(64)}
    with pytest.raises(QuantError, match="another model.*blk.0.attn_q.weight"):
        back.check(src, "x")
    src.close()
    with pytest.raises(CheckpointError, match="not an importance matrix"):
        ImportanceMatrix.read(_plain_gguf(tmp_path))


def _plain_gguf(tmp: Path) -> Path:
    from inferflow.loaders.gguf_writer import GGUFTensorPlan, write_gguf

    p = tmp / "plain.gguf"
    with open(p, "wb") as f:
        plan = GGUFTensorPlan("w", (2,), "F32")
        write_gguf(f, {"general.architecture": "llama"}, [plan], lambda _: torch.ones(2))
    return p
