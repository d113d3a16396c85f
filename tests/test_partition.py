"""Partitioned models (inferflow.parallel) on 2 and 4 gloo CPU processes: logits of by-layer,
by-tensor and hybrid runs equal the single-process model (fp32, 1e-5 relative) for prefill and
decode steps, float and quantized, GQA and MQA; every rank holds only its share; bad layouts
fail before any weight is read."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml

from inferflow.blocks.position import POSITIONS, NoPosition, RelativeBias
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.kv_cache import PagedKVCache, SeqBlocks
from inferflow.engine.sampling import SamplingParams
from inferflow.errors import InferflowError, SpecError
from inferflow.model.batch import FlatBatch, NoCache, SeqSlice
from inferflow.model.binding import set_param
from inferflow.model.build import build_network, held_elsewhere, load_model
from inferflow.parallel.layout import Layout, parse_devices, resolve_layout
from inferflow.parallel.runtime import launch, stack_part, weight_bytes
from inferflow.spec import load_spec
from inferflow.spec.types import PartitionSpec, QuantSpec, Spec
from tests.conftest import save_models, spec_doc, tiny_llama

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21]]


@torch.inference_mode()
def drive(model: torch.nn.Module, decode_steps: int = 4) -> list[torch.Tensor]:
    """Engine-like steps over a paged cache: one prefill of every prompt (per-sequence views),
    then decode steps (one grouped view), with a forked sequence whose first write copies a
    shared block (copy-on-write). Returns each step's logits."""
    cache = PagedKVCache(*model.kv_geometry(), 4, 64, torch.float32)
    seqs = [SeqBlocks() for _ in PROMPTS]
    toks = [list(p) for p in PROMPTS]
    ids, pos, slices, views, row = [], [], [], [], 0
    for s, p in zip(seqs, PROMPTS, strict=True):
        cache.reserve(s, len(p))
        views.append(cache.view(s, 0, len(p)))
        ids += p
        pos.append(torch.arange(len(p)))
        slices.append(SeqSlice(row, len(p)))
        row += len(p)
    out = [model(FlatBatch(torch.tensor(ids), torch.cat(pos), slices, views))]
    for s, p in zip(seqs, PROMPTS, strict=True):
        s.num_computed = len(p)
    for t, tok in zip(toks, out[0].argmax(-1).tolist(), strict=True):
        t.append(tok)
    seqs.append(cache.fork(seqs[0]))  # shares seq 0's blocks until it writes
    toks.append(toks[0][:-1] + [(toks[0][-1] + 1) % 128])
    for _ in range(decode_steps):
        at = [len(t) - 1 for t in toks]
        for s, p in zip(seqs, at, strict=True):
            cache.reserve(s, p + 1)
        flat = FlatBatch(
            torch.tensor([t[-1] for t in toks]),
            torch.tensor(at),
            [SeqSlice(i, 1) for i in range(len(toks))],
            [],
        )
        flat.group = cache.group_view(seqs, at)
        out.append(model(flat))
        for s, p in zip(seqs, at, strict=True):
            s.num_computed = p + 1
        for t, tok in zip(toks, out[-1].argmax(-1).tolist(), strict=True):
            t.append(tok)
    return out


def _model_dir(tmp: Path, kv_heads: int) -> Spec:
    tiny_llama(tmp, num_hidden_layers=4, intermediate_size=128, num_key_value_heads=kv_heads)
    return load_spec(tmp / "spec.yaml")


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Spec]:
    return {
        "gqa": _model_dir(tmp_path_factory.mktemp("gqa"), 2),  # 4 heads over 2 KV heads
        "mqa": _model_dir(tmp_path_factory.mktemp("mqa"), 1),
    }


def _partitioned(spec: Spec, devices: str) -> Spec:
    return dataclasses.replace(spec, partition=PartitionSpec(devices=devices))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# the float32 kernel: int4pack rounds activations to bf16, so a different summation order
# (a row-parallel split) would move logits by bf16 steps, not float32 ones
Q8 = QuantSpec("Q8_0", kernel="dequant")
CASES = [
    ("gqa", "cpu;cpu", None),  # by layer
    ("gqa", "cpu&cpu", None),  # by tensor
    ("gqa", "cpu&cpu;cpu&cpu", None),  # hybrid 2 x 2
    ("gqa", "cpu&cpu&cpu&cpu", None),  # 4 ranks over 2 KV heads: each KV head on 2 ranks
    ("mqa", "cpu;cpu", None),
    ("mqa", "cpu&cpu", None),  # one KV head, replicated
    ("mqa", "cpu&cpu;cpu&cpu", None),
    ("gqa", "cpu;cpu", Q8),
    ("gqa", "cpu&cpu", Q8),  # slices cut on quantization-block boundaries
    ("gqa", "cpu&cpu;cpu&cpu", Q8),
    ("mqa", "cpu&cpu", Q8),
]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "devices", "quant"), CASES)
def test_partitioned_logits_equal_single_process(
    specs: dict[str, Spec], kind: str, devices: str, quant: QuantSpec | None
) -> None:
    spec = specs[kind]
    want = drive(load_model(spec, quant=quant))
    p = _partitioned(spec, devices)
    layout = resolve_layout(p.partition, p, quant)  # type: ignore[arg-type]
    model = launch(p, layout, quant=quant)
    try:
        got = drive(model)
        bytes_per_rank = model.rank_bytes
    finally:
        model.close()
    assert len(got) == len(want) == 5
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape
        assert _rel(g, w) <= 1e-5, (step, _rel(g, w))
    # each rank's resident weights are what its share builds, never the whole model
    whole = weight_bytes(load_model(spec, quant=quant))
    assert len(bytes_per_rank) == layout.world_size
    assert max(bytes_per_rank) < whole


def test_rank_shares_shrink_as_expected(specs: dict[str, Spec]) -> None:
    """Parameter bytes of each rank's share, built on the meta device (nothing allocated):
    layers split 1/(P*T) (KV projections replicated when KV heads < T), embeddings on the first
    stage, final norm and head on the last."""
    spec = specs["gqa"]
    h = spec.hparams
    whole = sum(p.numel() for p in build_network(spec).parameters())
    layer = sum(p.numel() for p in build_network(spec).dec.layers()[0].parameters())
    embed = h.vocab_size * h.hidden
    head = h.vocab_size * h.hidden + h.hidden  # untied head + final norm
    assert whole == 4 * layer + embed + head
    norms = 2 * h.hidden  # replicated on every tensor-parallel rank

    def share(devices: str) -> list[int]:
        p = _partitioned(spec, devices)
        layout = resolve_layout(p.partition, p)  # type: ignore[arg-type]
        with torch.device("meta"):
            parts = [build_network(spec, part=stack_part(layout, r)) for r in range(4)]
        return [sum(x.numel() for x in m.parameters()) for m in parts[: layout.world_size]]

    assert share("cpu;cpu;cpu;cpu") == [layer + embed, layer, layer, layer + head]
    tp_layer = (layer - norms) // 2 + norms
    assert share("cpu&cpu;cpu&cpu") == [2 * tp_layer + embed] * 2 + [2 * tp_layer + head] * 2
    # 4 ranks over 2 KV heads: each rank keeps 1 query head and 1 (replicated) KV head
    D = h.head_dim
    qkv_o = h.hidden * D * 3 + D * h.hidden  # q, k, v rows of one head + wo columns
    ffn = 3 * h.hidden * h.ffn_hidden // 4
    assert share("cpu&cpu&cpu&cpu") == [4 * (qkv_o + ffn + norms) + embed + head] * 4


@pytest.mark.slow
@pytest.mark.distributed
def test_engine_on_partitioned_model_gives_the_same_greedy_tokens(specs: dict[str, Spec]) -> None:
    spec = specs["gqa"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    cfg = EngineConfig(kv_cache_bytes=1 << 20)
    want = [r.output_ids for r in Engine(load_model(spec), None, cfg).generate(PROMPTS, params)]
    p = _partitioned(spec, "cpu&cpu;cpu&cpu")
    model = launch(p, resolve_layout(p.partition, p))  # type: ignore[arg-type]
    try:
        engine = Engine(model, None, cfg)
        got = [r.output_ids for r in engine.generate(PROMPTS, params)]
        beams = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, beam_width=3, n=2))
    finally:
        model.close()
    assert got == want
    single = Engine(load_model(spec), None, cfg)
    ref = single.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, beam_width=3, n=2))
    assert [b.output_ids for b in beams] == [b.output_ids for b in ref]


# --- layouts: parsing and errors before loading --------------------------------------------


def test_device_strings() -> None:
    assert parse_devices("0;1") == (("cuda:0",), ("cuda:1",))
    assert parse_devices("cpu&cpu:1 ; cpu&cpu") == (("cpu", "cpu"), ("cpu", "cpu"))
    lay = Layout(parse_devices("cpu&cpu;cpu&cpu"), ((0, 2), (2, 4)))
    assert (lay.strategy, lay.stages, lay.tensor_parallel, lay.world_size) == ("hybrid", 2, 2, 4)
    assert [lay.stage_of(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert lay.backend == "gloo"


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        (PartitionSpec(devices="cpu&cpu;cpu"), "groups of 1 and 2 devices"),
        (PartitionSpec(devices="cpu;;cpu"), "empty layer group"),
        (PartitionSpec(devices="gpu0"), "'gpu0' is not a device; use cpu, cuda:N or N"),
        (PartitionSpec(devices="cuda:0"), "device cuda:0 does not exist"),
        (PartitionSpec(devices="0&1"), "device cuda:0 does not exist"),
        (PartitionSpec(devices="cpu&cpu&cpu"), "3 tensor-parallel devices cannot split 4"),
        (PartitionSpec(devices=";".join(["cpu"] * 5)), "5 layer groups, but the model has only 4"),
        (PartitionSpec(devices="cpu;cpu", layers=(1, 2)), "adding up to the model's 4 layers"),
        # a group of no layers (the schema refuses 0; a PartitionSpec built in Python did not)
        (PartitionSpec(devices="cpu;cpu", layers=(0, 4)), "one count of at least 1 per layer"),
        (PartitionSpec(devices="cpu;cpu", cpu_layers=2), "give one of devices, strategy"),
        (PartitionSpec(strategy="hybrid", layer_groups=2), "strategy hybrid needs tensor_parallel"),
        (PartitionSpec(cpu_layers=4), "cpu_layers: 4 must be between 1 and 3"),
        (PartitionSpec(), "give devices"),
    ],
)
def test_bad_layouts_are_refused(specs: dict[str, Spec], partition: PartitionSpec, message: str):
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        resolve_layout(partition, specs["gqa"])


def test_layout_rules_against_the_model(specs: dict[str, Spec], tmp_path: Path) -> None:
    spec = specs["gqa"]
    lay = resolve_layout(PartitionSpec(devices="cpu;cpu;cpu"), spec)  # 4 layers over 3 groups
    assert lay.layers == ((0, 2), (2, 3), (3, 4))  # documented: the first groups take one more
    lay = resolve_layout(PartitionSpec(devices="cpu;cpu", layers=(1, 3)), spec)
    assert lay.layers == ((0, 1), (1, 4))
    lay = resolve_layout(PartitionSpec(strategy="hybrid", layer_groups=2, tensor_parallel=2), spec)
    assert lay.groups == (("cpu", "cpu"), ("cpu", "cpu"))
    # q4_k blocks are 256 wide: a 32-wide slice of the attention output cannot hold one
    with pytest.raises(SpecError, match="not a multiple of the quantization block"):
        resolve_layout(PartitionSpec(devices="cpu&cpu"), spec, QuantSpec("Q4_K"))
    # 6 heads over 2 KV heads cannot be split 3 ways (3 neither divides nor is a multiple of 2)
    d = tmp_path / "m"
    d.mkdir()
    odd = _model_dir(d, 2)
    odd = dataclasses.replace(
        odd, hparams=dataclasses.replace(odd.hparams, n_heads=6, head_dim=16, n_kv_heads=2)
    )
    with pytest.raises(SpecError, match="cannot split 2 KV heads"):
        resolve_layout(PartitionSpec(devices="cpu&cpu&cpu"), odd)


def test_bad_layout_fails_before_any_weight_is_read(
    specs: dict[str, Spec], monkeypatch: pytest.MonkeyPatch
) -> None:
    from inferflow import runtime

    def no_loading(*a: object, **k: object) -> None:
        raise AssertionError("weights were read")

    monkeypatch.setattr(runtime, "load_model", no_loading)
    monkeypatch.setattr("inferflow.parallel.runtime.launch", no_loading)
    bad = _partitioned(specs["gqa"], "cpu&cpu&cpu")
    with pytest.raises(SpecError, match="cannot split 4 attention heads"):
        runtime.load(bad)


def _with_quant(spec: Spec, tmp: Path, quant: str) -> Path:
    assert spec.path is not None
    path = tmp / "q.yaml"
    path.write_text(spec.path.read_text() + f"quant: {quant}\n")
    return path


def test_quant_flag_keeps_the_spec_quant_section(specs: dict[str, Spec], tmp_path: Path) -> None:
    """``--quant NAME`` (runtime.quant_for) replaces only the default format: the spec's
    overrides, kernel and dense_batch stay; ``none`` is float everywhere."""
    from inferflow.runtime import quant_for

    doc = "{weights: Q8_0, kernel: dequant, dense_batch: 16, overrides: {dec.output: Q4_K}}"
    spec = load_spec(_with_quant(specs["gqa"], tmp_path, doc))
    assert quant_for(spec, None) is None
    assert quant_for(spec, "Q4_0") == QuantSpec(
        "Q4_0", (("dec.output", "Q4_K"),), "keep", "dequant", 16
    )
    q = quant_for(spec, "none")
    assert q is not None and (q.weights, q.overrides, q.checkpoint) == (None, (), "dequantize")
    with pytest.raises(InferflowError, match="'Q9_9'"):
        quant_for(spec, "Q9_9")


@pytest.mark.parametrize(
    ("quant", "flag", "refused"),
    [
        ("{weights: Q4_K}", "none", None),  # float: the spec's 256-wide blocks do not apply
        ("{weights: Q4_K}", "Q8_0", None),
        ("{overrides: {dec.*.feed_forward.*: Q4_K}}", "Q8_0", "quantization block (256)"),
        ("{}", "Q4_K", "quantization block (256)"),
    ],
)
def test_serve_checks_the_layout_load_will_use(
    specs: dict[str, Spec],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    quant: str,
    flag: str,
    refused: str | None,
) -> None:
    """`inferflow serve --devices` refuses, before the port opens, exactly the layouts that
    ``load`` refuses with the same ``--quant`` (2 ranks: 32-wide attention output slices)."""
    from inferflow import runtime
    from inferflow.cli.main import main

    class Reached(Exception):
        pass

    def launched(*a: object, **k: object) -> None:
        raise Reached

    monkeypatch.setattr("inferflow.parallel.runtime.launch", launched)
    served: list[object] = []
    monkeypatch.setattr("inferflow.server.shutdown.serve", lambda app, *a: served.append(app))
    path = _with_quant(specs["gqa"], tmp_path, quant)
    rc = main(["serve", str(path), "--devices", "cpu&cpu", "--quant", flag])
    spec = dataclasses.replace(load_spec(path), partition=PartitionSpec(devices="cpu&cpu"))
    if refused is None:
        assert rc == 0 and len(served) == 1
        with pytest.raises(Reached):  # load's layout check passes too
            runtime.load(spec, quant=flag)
    else:
        assert rc == 2 and not served and refused in capsys.readouterr().err
        with pytest.raises(SpecError, match=re.escape(refused)):
            runtime.load(spec, quant=flag)


def test_relative_bias_on_every_stage(specs: dict[str, Spec]) -> None:
    """A position block with weights that biases attention (T5's relative bias) sits on every
    stage of a layer split, its table read there too; a learned input embedding only on the
    first stage. Stage after stage, the split model gives the whole model's logits."""
    spec = specs["gqa"]

    def with_position(kind: str) -> Spec:
        net = dataclasses.replace(spec.network, positions=((kind, POSITIONS.get(kind).Options()),))
        return dataclasses.replace(spec, network=net)

    rel = with_position("relative")
    layout = resolve_layout(PartitionSpec(devices="cpu;cpu"), rel)
    whole = build_network(rel)  # (parameters on the meta device: random values here)
    g = torch.Generator().manual_seed(0)
    for name, t in list(whole.named_parameters()):
        set_param(whole, name, torch.randn(t.shape, generator=g) * 0.2)
    state = whole.state_dict()
    parts = [build_network(rel, part=stack_part(layout, r)) for r in range(2)]
    for part in parts:
        part.load_state_dict({k: state[k] for k in part.state_dict()}, assign=True)
        assert isinstance(part.dec.pos_embed, RelativeBias)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    batch = FlatBatch(ids, torch.arange(len(ids)), [SeqSlice(0, len(ids))], [NoCache()])
    with torch.inference_mode():
        want = whole(batch)
        first, last = parts[0].dec, parts[1].dec
        h = last.final_norm(last.run_layers(first.run_layers(first.embed(batch), batch), batch))
        got = last.logits(h[batch.default_logits_rows()])
    torch.testing.assert_close(got, want)
    later = stack_part(layout, 1)
    assert not held_elsewhere(later, rel)("dec.pos_embed.weight")
    learned = with_position("learned")
    assert held_elsewhere(later, learned)("dec.pos_embed.weight")
    assert isinstance(build_network(learned, part=later).dec.pos_embed, NoPosition)


def test_spec_partition_section(tmp_path: Path, specs: dict[str, Spec]) -> None:
    base = specs["gqa"].path
    assert base is not None
    doc = base.read_text() + "partition: {devices: 'cpu&cpu;cpu&cpu', embeddings: host}\n"
    (tmp_path / "p.yaml").write_text(doc)
    spec = load_spec(tmp_path / "p.yaml")
    assert spec.partition == PartitionSpec(devices="cpu&cpu;cpu&cpu", embeddings="host")
    (tmp_path / "bad.yaml").write_text(base.read_text() + "partition: {strategy: diagonal}\n")
    with pytest.raises(SpecError, match="partition.strategy.*diagonal"):
        load_spec(tmp_path / "bad.yaml")


@pytest.mark.slow
@pytest.mark.distributed
def test_served_request_through_a_partitioned_engine(tmp_path: Path) -> None:
    """`inferflow serve --devices` (SmolLM2, 9 heads over 3 tensor-parallel ranks) answers a
    greedy completion with the tokens the unpartitioned engine gives."""
    httpx = pytest.importorskip("httpx")
    from inferflow.runtime import load
    from tests.serving import NAME, run_server

    lm = load("smollm2-135m-instruct")
    assert lm.tokenizer is not None
    ids = lm.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want = Engine(lm.model, lm.tokenizer).generate([ids], params)[0]
    body = {"model": NAME, "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with run_server(tmp_path, "--devices", "cpu&cpu&cpu") as (url, _):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == lm.tokenizer.decode(want.output_ids)
    assert r.json()["usage"]["completion_tokens"] == 16


@pytest.fixture(scope="module")
def other_archs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Spec]:
    from tests.test_hf_parity import CASES

    archs = ("gpt-neox", "bloom", "falcon")
    saved = save_models({a: CASES[a] for a in archs}, tmp_path_factory)
    out = {}
    for arch, (_, d) in saved.items():
        (d / "spec.yaml").write_text(yaml.safe_dump(spec_doc(arch, d, "safetensors")))
        out[arch] = load_spec(d / "spec.yaml")
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["gpt-neox", "bloom", "falcon"])
def test_hybrid_split_of_other_blocks(other_archs: dict[str, Spec], arch: str) -> None:
    """2 x 2 over parallel residuals (one all-reduce per layer), fused per-head / per-group qkv
    rows, biases (a row-parallel bias added once), ALiBi slopes per head (BLOOM), plain FFNs,
    a tied head on the last stage and one KV head replicated (Falcon)."""
    spec = other_archs[arch]
    want = drive(load_model(spec))
    p = _partitioned(spec, "cpu&cpu;cpu&cpu")
    model = launch(p, resolve_layout(p.partition, p))  # type: ignore[arg-type]
    try:
        got = drive(model)
    finally:
        model.close()
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert _rel(g, w) <= 1e-5, (step, _rel(g, w))


TORCHRUN_SCRIPT = """
import sys
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.sampling import SamplingParams
from inferflow.runtime import load
lm = load(sys.argv[1])  # the spec's partition section; ranks other than 0 end inside load
reqs = Engine(lm.model, None, EngineConfig(kv_cache_bytes=1 << 20)).generate(
    [[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(max_new_tokens=6, ignore_eos=True)
)
print("TOKENS", [r.output_ids for r in reqs])
lm.model.close()
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_launch(specs: dict[str, Spec], tmp_path: Path) -> None:
    """Under torchrun the ranks exist already: each runs the same program, rank 0 drives."""
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    spec = specs["gqa"]
    assert spec.path is not None
    doc = spec.path.read_text() + "partition: {devices: 'cpu&cpu'}\n"
    (tmp_path / "p.yaml").write_text(doc)
    (tmp_path / "run.py").write_text(TORCHRUN_SCRIPT)
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(tmp_path / "run.py")]
    out = subprocess.run(
        [*cmd, str(tmp_path / "p.yaml")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine(load_model(spec), None, EngineConfig(kv_cache_bytes=1 << 20))
    want = [r.output_ids for r in engine.generate([[1, 2, 3, 4, 5], [7, 8, 9]], params)]
    assert f"TOKENS {want}" in out.stdout
