"""Tiny random transformers models run from spec files alone, logits within 1e-4 relative of
transformers in fp32, from safetensors and from pickle checkpoints (zip and legacy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inferflow.model.batch import ContiguousKVCache, FlatBatch
from inferflow.model.build import load_model
from inferflow.spec import load_spec
from tests.conftest import CHECKPOINTS, all_logits, save_models, spec_doc

tf = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64)


def _llama_like(cls_cfg, cls_model, **kw):
    def make():
        cfg = cls_cfg(hidden_size=64, intermediate_size=96, num_attention_heads=4, **SMALL, **kw)
        return cls_model(cfg)

    return make


# architecture template -> builder of a random transformers model (one row per architecture)
CASES = {
    "llama": _llama_like(tf.LlamaConfig, tf.LlamaForCausalLM, num_key_value_heads=2),  # GQA
    "mistral": _llama_like(
        tf.MistralConfig, tf.MistralForCausalLM, num_key_value_heads=2, sliding_window=7
    ),
    "qwen2": _llama_like(tf.Qwen2Config, tf.Qwen2ForCausalLM, num_key_value_heads=2),
    "gpt2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=128,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),
    "gpt-neox": _llama_like(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),  # rotary_pct 0.25, parallel
    "phi": _llama_like(tf.PhiConfig, tf.PhiForCausalLM),  # partial 0.5, shared-norm parallel
    # GQA, (1 + w) norms, GeGLU, scaled embeddings, tied head
    "gemma": _llama_like(tf.GemmaConfig, tf.GemmaForCausalLM, num_key_value_heads=2, head_dim=16),
    # LayerNorms without weight or bias (non-parametric), GQA
    "olmo": _llama_like(tf.OlmoConfig, tf.OlmoForCausalLM, num_key_value_heads=2, eos_token_id=0),
    # mixture of experts: 4 experts, top 2, renormalised; safetensors store the experts one by
    # one (block_sparse_moe.experts.{e}.w1), pickles stacked (mlp.experts.gate_up_proj)
    "mixtral": _llama_like(
        tf.MixtralConfig,
        tf.MixtralForCausalLM,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # experts of their own width, a sigmoid-gated shared expert, top 2 not renormalised
    "qwen2-moe": _llama_like(
        tf.Qwen2MoeConfig,
        tf.Qwen2MoeForCausalLM,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # multi_query (one KV head), parallel attention with one norm, tied head
    "falcon": lambda: tf.FalconForCausalLM(
        tf.FalconConfig(hidden_size=64, num_attention_heads=4, **SMALL)
    ),
    # ALiBi, embedding LayerNorm, per-head fused qkv, tied head
    "bloom": lambda: tf.BloomForCausalLM(
        tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=128)
    ),
    # learned positions with offset 2, ReLU, tied head
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(
            hidden_size=64, ffn_dim=96, num_attention_heads=4, word_embed_proj_dim=64, **SMALL
        )
    ),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    return save_models(CASES, tmp_path_factory)


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
@pytest.mark.parametrize("arch", list(CASES))
def test_logits_match_transformers(arch: str, ckpt: str, hf_models, write_spec) -> None:
    ref_model, d = hf_models[arch]
    spec = load_spec(write_spec(spec_doc(arch, d, ckpt)))
    model = load_model(spec)
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    ours = all_logits(model, ids)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-4, f"{arch}/{ckpt}: max relative difference {rel:.2e}"


@pytest.mark.parametrize("arch", list(CASES))
def test_incremental_decode_matches_full_forward(arch: str, hf_models, write_spec) -> None:
    """Prefill in chunks then one token per step: the same logits as one full forward."""
    _, d = hf_models[arch]
    model = load_model(load_spec(write_spec(spec_doc(arch, d, "safetensors"))))
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2))
    full = all_logits(model, ids)
    h = model.spec.hparams
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, 64, torch.float32)
    steps = [(0, 9), (9, 13)] + [(t, t + 1) for t in range(13, 20)]
    with torch.no_grad():
        for a, b in steps:
            last = model(FlatBatch.single(ids[a:b], a, cache))[0]
            torch.testing.assert_close(last, full[b - 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", list(CASES))
def test_engine_batch_matches_transformers_greedy(arch: str, hf_models, write_spec) -> None:
    """Several prompts at once through the engine (grouped decode steps, ALiBi and windows
    included) give transformers' greedy tokens for each prompt on its own."""
    from inferflow.engine.engine import Engine, EngineConfig
    from inferflow.engine.sampling import SamplingParams

    ref, d = hf_models[arch]
    model = load_model(load_spec(write_spec(spec_doc(arch, d, "safetensors"))))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    got = Engine(model, None, EngineConfig(kv_cache_bytes=1 << 20)).generate(prompts, params)
    for p, r in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8
            )[0, len(p) :]
        assert r.output_ids == want.tolist(), arch


@pytest.mark.parametrize(
    "network, hparams, message",
    [
        # a llama checkpoint has no q/k/v biases
        (
            {"attention": {"bias": "qkv"}},
            {},
            "lacks 2 tensor(s) the network needs: dec.0.self_attn.wqkv.bias (shards k, q, v)",
        ),
        # tied head: lm_head.weight is left over (named with the rule that mapped it)
        (
            {"output": {"tied": True}},
            {},
            "does not use: lm_head.weight (as dec.output.weight, by network.tensors.preset "
            "hf_llama: 'lm_head.weight')",
        ),
        # a map that leaves tensors unmatched names them
        (
            {"tensors": {"preset": "gguf"}},
            {},
            "does not use: lm_head.weight, model.embed_tokens.weight",
        ),
        # wrong numbers: shapes name both sides
        (
            {},
            {"ffn_hidden": 80},
            "model.layers.0.mlp.up_proj.weight: shape [96, 64] does not fit dec.0.feed_forward.w3.weight of shape [80, 64] (mapped by network.tensors.preset hf_llama: 'model.layers.{i}.mlp.up_proj.weight')",
        ),
        # a spec's own map entry is named by its YAML path
        (
            {
                "tensors": {
                    "preset": "hf_llama",
                    "map": {"model.norm.weight": "dec.0.ffn_norm.bias"},
                }
            },
            {},
            "does not use: model.norm.weight (as dec.0.ffn_norm.bias, by "
            "network.tensors.map['model.norm.weight'])",
        ),
    ],
)
def test_binding_is_strict(
    network: dict, hparams: dict, message: str, hf_models, write_spec
) -> None:
    from inferflow.errors import WeightBindingError

    _, d = hf_models["llama"]
    doc = spec_doc("llama", d, "safetensors") | {"network": network, "hparams": hparams}
    with pytest.raises(WeightBindingError) as e:
        load_model(load_spec(write_spec(doc)))
    assert message in str(e.value)


def test_moe_experts_are_runtime_quantized(hf_models, write_spec) -> None:
    """``quant: {weights: Q8}`` quantizes every expert's linear layers (each expert on its own);
    the logits stay within Q8's rounding of transformers'."""
    from inferflow.quant.linear import QuantLinear

    ref_model, d = hf_models["mixtral"]
    doc = spec_doc("mixtral", d, "safetensors") | {"quant": {"weights": "Q8"}}
    model = load_model(load_spec(write_spec(doc)))
    for layer in model.dec.layers():
        experts = layer.feed_forward.experts
        assert len(experts) == 4
        assert all(
            isinstance(e.w13, QuantLinear) and isinstance(e.w2, QuantLinear) for e in experts
        )
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    ours = all_logits(model, ids)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert 0 < rel <= 2e-2, f"max relative difference {rel:.2e}"


@pytest.mark.parametrize(
    ("arch", "ckpt", "doc", "message"),
    [
        # per-expert tensors past the network's experts are left over, named
        (
            "mixtral",
            "safetensors",
            {"hparams": {"n_experts": 3}},
            "does not use: model.layers.0.block_sparse_moe.experts.3.w1.weight",
        ),
        # a stacked tensor must hold exactly the network's experts
        (
            "mixtral",
            "pickle_zip",
            {"hparams": {"n_experts": 3}},
            "model.layers.0.mlp.experts.gate_up_proj: a tensor of shape [4, 192, 64] stacks its "
            "experts along the first axis, but dec.0.feed_forward.experts holds 3 experts "
            "(mapped by network.tensors.map['model.layers.{i}.mlp.experts.gate_up_proj'])",
        ),
        (
            "mixtral",
            "safetensors",
            {"hparams": {"n_experts_used": 5}},
            "1 <= n_experts_used <= n_experts; got n_experts 4, n_experts_used 5",
        ),
        (
            "qwen2-moe",
            "safetensors",
            {"network": {"tensors": {"map": {"x.{e}.w": "dec.0.feed_forward.router.weight"}}}},
            "the source has {e} but the target 'dec.0.feed_forward.router.weight' does not",
        ),
        (
            "mixtral",
            "safetensors",
            {"network": {"ffn": {"type": "moe", "routing": "top1"}}},
            "network.ffn.routing: 'top1' is not one of: softmax_topk, topk_softmax",
        ),
    ],
)
def test_moe_errors_name_the_problem(arch, ckpt, doc, message, hf_models, write_spec) -> None:  # noqa: ANN001
    from inferflow.errors import InferflowError

    _, d = hf_models[arch]
    with pytest.raises(InferflowError) as e:
        load_model(load_spec(write_spec(spec_doc(arch, d, ckpt) | doc)))
    assert message in str(e.value)
