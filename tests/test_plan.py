"""The cost-model planner (``inferflow plan``): arithmetic against hand-computed numbers, layout
validity, KV-head replication, the recommendation and the CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from inferflow.cli.main import main
from inferflow.errors import RequestError, SpecError
from inferflow.parallel.cost import (
    GiB,
    Hardware,
    estimate,
    kv_bytes_per_token,
    layer_params,
    parse_weight_bits,
    plan,
    recommend,
)
from inferflow.parallel.layout import split_problem
from inferflow.spec import load_spec
from inferflow.spec.types import Spec

# tiny GQA llama: 8 heads of 8 dims, 2 KV heads, gated FFN, untied head
TINY = {"vocab_size": 1000, "hidden": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 128}  # fmt: skip
# llama-7B-like (MHA): big enough for realistic trade-offs
BIG = {"vocab_size": 32000, "hidden": 4096, "n_layers": 32, "n_heads": 32, "ffn_hidden": 11008}
# round numbers so that the expected times below are easy to write out
HW = Hardware(memory_bytes=1e12, bandwidth=1e9, link=1e8, link_latency=1e-5, flops=1e12)


@pytest.fixture
def make_spec(tmp_path: Path):
    """make_spec(hparams, base=arch/llama, name, network overrides) -> Spec, without any
    checkpoint data."""
    (tmp_path / "w.safetensors").touch()  # hparams come from the spec, the file is never read

    def make(
        hparams: dict, base: str = "arch/llama", name: str = "spec.yaml", network: str = "{}"
    ) -> Spec:
        p = tmp_path / name
        p.write_text(
            f"name: test\nbase: {base}\nsource: {{format: safetensors, files: [w.safetensors]}}\n"
            f"hparams: {hparams}\nnetwork: {network}\n"
        )
        return load_spec(p)

    return make


def test_params_and_kv_bytes_by_hand(make_spec) -> None:
    spec = make_spec(TINY)
    # attention: wq + wk + wv = hidden*(heads + 2*kv)*head_dim; wo = heads*head_dim*hidden
    attn = 64 * (8 + 2 * 2) * 8 + 8 * 8 * 64
    ffn = 3 * 64 * 128  # gated: w1, w2, w3
    assert layer_params(spec) == attn + ffn == 34816
    # T=2: 4 query heads, 1 KV head, 64 FFN columns per rank: exactly half
    assert layer_params(spec, 2) == 64 * (4 + 2) * 8 + 4 * 8 * 64 + 3 * 64 * 64 == 34816 // 2
    # T=4: 2 query heads but still 1 KV head per rank (replicated), so more than a quarter
    assert layer_params(spec, 4) == 64 * (2 + 2) * 8 + 2 * 8 * 64 + 3 * 64 * 32 == 9216 > 34816 / 4
    # K and V, kv_heads * head_dim values of 2 bytes each
    assert kv_bytes_per_token(spec) == 2 * 2 * 8 * 2
    assert kv_bytes_per_token(spec, 2) == kv_bytes_per_token(spec, 4) == 2 * 1 * 8 * 2
    # what the layer builds decides: a plain FFN has 2 matrices (w1, w2), not 3
    plain = make_spec(TINY, name="plain.yaml", network="{ffn: plain}")
    assert layer_params(plain) == attn + 2 * 64 * 128
    assert layer_params(plain, 2) == (attn + 2 * 64 * 128) // 2


def test_parallel_residual_all_reduces_once(make_spec) -> None:
    """A parallel-residual block (attention and FFN read the same input) sums both branches
    before one all-reduce per layer; a sequential one needs two."""
    seq = estimate(make_spec(TINY), 1, 2, HW, 1, 10, 16)
    spec = make_spec(TINY, name="par.yaml", network="{residual: parallel}")
    par = estimate(spec, 1, 2, HW, 1, 10, 16)
    one = 2 * 1 / 2 * 64 * 2 / 1e8 + 1e-5  # one ring all-reduce of a token's hidden state
    assert seq.decode_s - par.decode_s == pytest.approx(4 * one)  # 4 layers, one fewer each


def test_single_device_memory_and_times_by_hand(make_spec) -> None:
    spec = make_spec(TINY)
    batch, ctx = 2, 10
    e = estimate(spec, 1, 1, HW, batch, ctx, weight_bits=16)
    layer, table = 34816, 1000 * 64
    weights = (4 * layer + 2 * table) * 2  # untied: embedding and head, bf16
    kv = batch * ctx * 4 * (2 * 2 * 8 * 2)
    assert (e.layout, e.devices, e.fits, e.note) == ("single", "0", True, "")
    assert e.weights_per_device == weights and e.kv_per_device == kv
    assert e.memory_per_device == weights + kv
    # decode: roofline of the linear layers (weights once, 2 FLOPs per weight per token) plus
    # attention per layer (KV read once, 4 FLOPs per (query, key) pair per query dim)
    lin = max((4 * layer + table) * 2 / 1e9, 2 * batch * (4 * layer + table) / 1e12)
    att = 4 * max(batch * ctx * 64 / 1e9, 4 * batch * ctx * 64 / 1e12)
    assert e.decode_s == pytest.approx(lin + att)
    assert e.decode_tokens_per_s == pytest.approx(batch / (lin + att))
    # prefill: batch*ctx tokens through the layers, the head for the last token of each prompt
    lin = max(
        (4 * layer + table) * 2 / 1e9, (2 * batch * ctx * 4 * layer + 2 * batch * table) / 1e12
    )
    att = 4 * max(batch * ctx * 64 / 1e9, 4 * batch * ctx * (ctx + 1) / 2 * 64 / 1e12)
    assert e.prefill_s == pytest.approx(lin + att)


def test_tensor_and_layer_times_by_hand(make_spec) -> None:
    spec = make_spec(TINY)
    one = estimate(spec, 1, 1, HW, 1, 10, 16)
    # tensor, T=2: half the weights per rank (memory-bound at batch 1) plus 2 all-reduces per
    # layer of hidden*2 bytes, ring cost 2(T-1)/T * bytes / link + latency
    t2 = estimate(spec, 1, 2, HW, 1, 10, 16)
    table = 1000 * 64
    lin = (4 * 34816 / 2 + table) * 2 / 1e9
    att = 4 * 10 * 32 / 1e9
    comm = 4 * 2 * (2 * 1 / 2 * 64 * 2 / 1e8 + 1e-5)
    assert t2.decode_s == pytest.approx(lin + att + comm)
    assert t2.devices == "0&1" and t2.layout == "tensor"
    # layer, P=2, batch 1: one micro-batch, the stages run one after the other, plus one send
    p2 = estimate(spec, 2, 1, HW, 1, 10, 16)
    send = 64 * 2 / 1e8 + 1e-5
    assert p2.decode_s == pytest.approx(one.decode_s + send)
    assert p2.devices == "0;1" and p2.layout == "layer"
    # memory: the fuller stage holds 2 layers and one table (embedding or head)
    assert p2.weights_per_device == (2 * 34816 + table) * 2


def test_pipeline_micro_batches(make_spec) -> None:
    spec = make_spec(TINY)
    # P=2, batch 2: two micro-batches of 1 in flight; memory-bound on HW
    e = estimate(spec, 2, 1, HW, 2, 10, 16)
    att = 2 * 10 * 64 / 1e9  # 2 layers, 10 KV tokens of 64 bytes
    first = 2 * 34816 * 2 / 1e9 + att + (64 * 2 / 1e8 + 1e-5)  # + the send to stage 2
    last = (2 * 34816 + 1000 * 64) * 2 / 1e9 + att  # + the head
    assert last > first
    # a stage serves one micro-batch at a time: a round takes 2 * the slowest stage
    cycle = max(first + last, 2 * max(first, last))
    assert e.decode_s == pytest.approx(cycle)
    assert e.decode_tokens_per_s == pytest.approx(2 / cycle)


def test_memory_shrinks_with_devices(make_spec) -> None:
    spec = make_spec(BIG)
    one = estimate(spec, 1, 1, Hardware(), 4, 1024, 16)
    for n in (2, 4, 8):
        for e in plan(spec, n, Hardware(), 4, 1024, 16):
            if n == 2 and e.layout == "hybrid":
                assert e.note == "2 devices have no split P x T with P, T > 1"
                continue
            assert e.valid, e.note
            # layers split N ways; the replicated embedding / head keeps it a little above 1/N
            assert (
                one.memory_per_device / n <= e.memory_per_device < 1.25 * one.memory_per_device / n
            )
            assert e.kv_per_device == pytest.approx(one.kv_per_device / n)


def test_kv_heads_replicated_when_fewer_than_ranks(make_spec) -> None:
    spec = make_spec(TINY)  # 2 KV heads
    kv = {t: estimate(spec, 1, t, HW, 1, 100, 16).kv_per_device for t in (1, 2, 4, 8)}
    assert kv[2] == kv[1] / 2
    assert kv[4] == kv[8] == kv[2]  # one KV head per rank, not a half or a quarter


def test_invalid_layouts_shown_not_raised(make_spec) -> None:
    """The planner applies the partition rules (inferflow.parallel.layout) and shows a layout
    they refuse with the reason."""
    spec = make_spec(TINY)
    assert "5 layer groups, but the model has only 4 layers" in split_problem(spec, 5, 1)
    assert "3 tensor-parallel devices cannot split 8 attention heads" in split_problem(spec, 1, 3)
    gqa = make_spec({**TINY, "n_heads": 24, "n_kv_heads": 8, "hidden": 192, "ffn_hidden": 192}, name="g.yaml")  # fmt: skip
    assert "cannot split 8 KV heads" in split_problem(gqa, 1, 3)  # 8 KV heads over 3 ranks
    e = estimate(spec, 1, 16, HW, 1, 10, 16)
    assert not e.valid and not e.fits and math.isnan(e.decode_s)
    assert "16 tensor-parallel devices cannot split 8 attention heads" in e.note
    rel = make_spec(TINY, name="rel.yaml", network="{position: {type: relative}}")
    assert "does not split the relative position bias" in estimate(rel, 1, 2, HW, 1, 10, 16).note
    assert estimate(rel, 2, 1, HW, 1, 10, 16).valid  # every stage holds the bias table
    layouts = plan(spec, 8, HW, 1, 10, 16)  # layer 8x1 > 4 layers; tensor 1x8 fine; 2x4, 4x2
    assert [(e.stages, e.tensor_parallel, e.valid) for e in layouts] == [
        (8, 1, False), (1, 8, True), (2, 4, True), (4, 2, True),
    ]  # fmt: skip
    three = plan(spec, 3, HW, 1, 10, 16)
    assert three[-1].layout == "hybrid" and "no split" in three[-1].note
    assert [e.layout for e in plan(spec, 1, HW, 1, 10, 16)] == ["single"]


def test_bad_values_raise(make_spec) -> None:
    spec = make_spec(TINY)
    with pytest.raises(RequestError, match="devices: must be an integer >= 1, got 0"):
        plan(spec, 0, HW, 1, 10, 16)
    with pytest.raises(RequestError, match="batch"):
        estimate(spec, 1, 1, HW, 0, 10, 16)
    with pytest.raises(RequestError, match="weight_bits"):
        estimate(spec, 1, 1, HW, 1, 10, 0)
    with pytest.raises(RequestError, match="bandwidth"):
        Hardware(bandwidth=-1)
    with pytest.raises(RequestError, match="objective"):
        recommend([], "speed")
    bert = make_spec({"vocab_size": 100, "hidden": 64, "n_layers": 2, "n_heads": 4}, "arch/bert", "b.yaml")  # fmt: skip
    with pytest.raises(SpecError, match="decoder-only"):
        plan(bert, 2, HW, 1, 10, 16)


def test_weight_bits_from_format_names() -> None:
    assert parse_weight_bits("16") == 16
    assert parse_weight_bits("4.5") == 4.5
    assert parse_weight_bits("q8_0") == 8.5
    assert parse_weight_bits("Q4_K") == 4.5
    with pytest.raises(RequestError, match="'fp7' is neither a number nor a quant format"):
        parse_weight_bits("fp7")


def test_recommendation(make_spec) -> None:
    spec = make_spec(BIG)
    # batch 1: latency and throughput agree, tensor parallel wins on fast links
    ests = plan(spec, 4, Hardware(), 1, 128, 16)
    for objective in ("latency", "throughput"):
        best, why = recommend(ests, objective)
        assert best is not None and best.layout == "tensor", why
    assert "lowest per-token latency" in recommend(ests, "latency")[1]
    # many requests over slow links with high latency: the pipeline wins on throughput
    slow = Hardware(link=25e9, link_latency=30e-6)
    best, why = recommend(plan(spec, 4, slow, 256, 128, 16), "throughput")
    assert best is not None and best.layout == "layer", why
    assert "highest decode throughput" in why
    # memory-bound: tensor parallel replicates the embedding and head on every rank, so with
    # memory between the two only layer and hybrid fit
    layer, tensor, hybrid = ests
    mem = (layer.memory_per_device + tensor.memory_per_device) / 2
    ests = plan(spec, 4, Hardware(memory_bytes=mem), 1, 128, 16)
    assert [e.fits for e in ests] == [True, False, True]
    best, why = recommend(ests, "latency")
    assert best is not None and best.layout == "hybrid", why
    assert "do not fit: tensor (0&1&2&3)" in why
    # nothing fits: say how much is missing
    best, why = recommend(plan(spec, 4, Hardware(memory_bytes=GiB), 1, 128, 16))
    assert best is None
    need = layer.memory_per_device / GiB
    assert f"needs {need:.2f} GiB, {need - 1:.2f} GiB missing" in why


def test_cli_table(make_spec, capsys: pytest.CaptureFixture[str]) -> None:
    spec = make_spec(BIG)
    assert main(["plan", str(spec.path), "--devices", "4", "--weight-bits", "q4_0"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "4.5 bits/weight" in lines[0]
    for layout, devices in (("layer", "0;1;2;3"), ("tensor", "0&1&2&3"), ("hybrid", "0&1;2&3")):
        assert any(line.split()[:2] == [layout, devices] for line in lines), out
    assert any(line.startswith("recommend: tensor (0&1&2&3)") for line in lines), out


def test_cli_nothing_fits(make_spec, capsys: pytest.CaptureFixture[str]) -> None:
    spec = make_spec(BIG)
    assert main(["plan", str(spec.path), "--devices", "2", "--device-memory", "1"]) == 1
    out = capsys.readouterr().out
    assert "no recommendation: no layout fits in 1.00 GiB per device" in out
    assert "GiB missing" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--devices", "0"], "devices: must be an integer >= 1, got 0"),
        (["--devices", "2", "--batch", "0"], "batch: must be an integer >= 1, got 0"),
        (["--devices", "2", "--context", "0"], "context: must be an integer >= 1, got 0"),
        # hardware flags are named as typed, in their own units
        (
            ["--devices", "2", "--bandwidth", "-5"],
            "--bandwidth: must be a positive number, got -5.0",
        ),
        (["--devices", "2", "--device-memory", "0"], "--device-memory: must be a positive number"),
        (["--devices", "2", "--flops", "nan"], "--flops: must be a positive number, got nan"),
        (
            ["--devices", "2", "--link-latency-us", "-1"],
            "--link-latency-us: must be >= 0, got -1.0",
        ),
        (["--devices", "2", "--weight-bits", "99"], "weight_bits: must be in (0, 64], got 99"),
        (["--devices", "2", "--act-bytes", "9"], "act_bytes: must be in (0, 8], got 9"),
        (["--devices", "2", "--weight-bits", "bogus"], "neither a number nor a quant format"),
    ],
)
def test_cli_bad_options(make_spec, capsys, flags: list[str], message: str) -> None:
    spec = make_spec(TINY)
    assert main(["plan", str(spec.path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
