"""Learned scalars on the residual stream (``network.gates``, nanochat / modded-nanogpt style):
each branch's output times a gate, and each layer's input mixed with the embedding output.
transformers has no such model: the reference is a forward written here over the tiny Llama's
own transformers modules, with the gates applied by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferflow.model.build import load_model
from inferflow.spec import load_spec
from tests.conftest import all_logits
from tests.test_tensor_map import LAYERS, _llama, _write

GATES = {"branches": True, "embedding_skip": True}


def _gates() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for i in range(LAYERS):
        out[f"gates.{i}.mix"] = torch.tensor([0.8, 0.3]) + 0.1 * torch.randn(2, generator=g)
        out[f"gates.{i}.attn"] = 0.5 + torch.rand((), generator=g)  # stored as 0-d scalars
        out[f"gates.{i}.ffn"] = 0.5 + torch.rand((), generator=g)
    return out


def _reference(model: Any, ids: torch.Tensor, gates: dict[str, torch.Tensor]) -> torch.Tensor:
    m, n = model.model, ids.numel()
    x = x0 = m.embed_tokens(ids[None])
    cos_sin = m.rotary_emb(x, torch.arange(n)[None])
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    for i, layer in enumerate(m.layers):
        a, b = gates[f"gates.{i}.mix"]
        x = a * x + b * x0
        h = layer.self_attn(
            layer.input_layernorm(x), position_embeddings=cos_sin, attention_mask=causal
        )[0]
        x = x + gates[f"gates.{i}.attn"] * h
        x = x + gates[f"gates.{i}.ffn"] * layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(m.norm(x))[0]


def _spec(tmp: Path, model: Any, gates: dict[str, Any]) -> Path:
    tensors = {**model.state_dict(), **_gates()}
    network = {
        "gates": gates,
        "tensors": {
            "preset": "hf_llama",
            "map": {
                "gates.{i}.mix": "dec.{i}.mix",
                "gates.{i}.attn": "dec.{i}.attn_gate",
                "gates.{i}.ffn": "dec.{i}.ffn_gate",
            },
        },
    }
    return _write(tmp, model, tensors, network)


def test_gates_match_a_reference_forward(tmp_path: Path) -> None:
    model = _llama()
    model.config._attn_implementation = "eager"
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    with torch.no_grad():
        want = _reference(model, ids, _gates())
        plain = model(ids[None]).logits[0]
    assert (want - plain).abs().max() > 1e-2  # the gates change the output
    ours = load_model(load_spec(_spec(tmp_path, model, GATES)))
    got = all_logits(ours, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    # one token a step (x0: each new token's own embedding) gives the same logits
    from inferflow.model.batch import ContiguousKVCache, FlatBatch

    h = ours.spec.hparams
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, 64, torch.float32)
    with torch.no_grad():
        for t in range(ids.numel()):
            step = ours(FlatBatch.single(ids[t : t + 1], t, cache))[0]
            torch.testing.assert_close(step, got[t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gates", [{"branches": True}, {"embedding_skip": True}])
def test_each_gate_needs_its_tensors(tmp_path: Path, gates: dict[str, bool]) -> None:
    """With one kind of gate on, the other kind's tensors are unused: binding names them."""
    from inferflow.errors import WeightBindingError

    with pytest.raises(WeightBindingError, match="gates.0.(attn|mix)"):
        load_model(load_spec(_spec(tmp_path, _llama(), gates)))


def test_per_layer_vectors_give_each_layer_its_element(tmp_path: Path) -> None:
    """Per-layer scalars stored as one [n_layers] vector (and the mixes as [n_layers, 2]):
    ``per_layer: true`` gives layer i element i, the same logits as one tensor per layer; a
    vector of the wrong length is an error naming both lengths."""
    from inferflow.errors import WeightBindingError

    model = _llama()
    model.config._attn_implementation = "eager"
    per = _gates()
    stacked = {
        f"gates.{k}": torch.stack([per[f"gates.{i}.{k}"] for i in range(LAYERS)])
        for k in ("mix", "attn", "ffn")
    }
    network = {
        "gates": GATES,
        "tensors": {
            "preset": "hf_llama",
            "map": {
                "gates.mix": {"to": "dec.{i}.mix", "per_layer": True},
                "gates.attn": {"to": "dec.{i}.attn_gate", "per_layer": True},
                "gates.ffn": {"to": "dec.{i}.ffn_gate", "per_layer": True},
            },
        },
    }
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        want = _reference(model, ids, per)
    ours = load_model(
        load_spec(_write(tmp_path, model, {**model.state_dict(), **stacked}, network))
    )
    got = all_logits(ours, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    short = {**stacked, "gates.attn": stacked["gates.attn"][:1]}
    with pytest.raises(
        WeightBindingError, match=r"shape \[1\] gives one value per layer .* 2 layers"
    ):
        load_model(load_spec(_write(tmp_path, model, {**model.state_dict(), **short}, network)))
