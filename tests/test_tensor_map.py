"""The tensor-mapping algebra of ``network.tensors.map`` (issue 25): a checkpoint whose tensors
are stored fused, transposed, scaled, with extra unit axes, shared across layers or used by two
slots is served by a spec alone. Each case rewrites a tiny random transformers Llama's state
dict with plain torch code, maps it back with the algebra, and compares the logits with
transformers on the original model (fp32); errors name the YAML path and the shapes before
any weight is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from inferflow.errors import SpecError, WeightBindingError
from inferflow.model.build import check_binding, load_model
from inferflow.spec import load_spec
from tests.conftest import all_logits, randomize

tf = pytest.importorskip("transformers")

H, F, HEADS, KV, LAYERS, VOCAB = 64, 96, 4, 2, 2, 128
Q, KVR = H, H // HEADS * KV  # q rows, k (and v) rows
L = "model.layers"


def _llama(tied: bool = False) -> Any:
    cfg = tf.LlamaConfig(
        hidden_size=H,
        intermediate_size=F,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    randomize(model)
    return model


def _write(tmp: Path, model: Any, tensors: dict[str, torch.Tensor], network: dict) -> Path:
    """The rewritten checkpoint (safetensors + the model's config.json) and a spec mapping it."""
    model.config.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors")
    doc = {
        "name": "rewritten",
        "base": "arch/llama",
        "source": {
            "format": "safetensors",
            "files": ["model.safetensors"],
            "config": "config.json",
        },
        "network": network,
    }
    import yaml

    (tmp / "spec.yaml").write_text(yaml.safe_dump(doc))
    return tmp / "spec.yaml"


def _same_as_transformers(spec: Path, ref: Any) -> None:
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = all_logits(load_model(load_spec(spec)), ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def _rewritten(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain torch: q/k/v in one fused tensor, gate/up in another, o_proj stored transposed,
    down_proj stored times 2, norms with a unit axis in front."""
    out = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"][None, :],
        "head": sd["lm_head.weight"],
    }
    for i in range(LAYERS):
        p = f"{L}.{i}."
        out[f"l{i}.qkv"] = torch.cat(
            [sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        )  # (Q + 2 KVR, H)
        out[f"l{i}.o_t"] = sd[p + "self_attn.o_proj.weight"].t()
        out[f"l{i}.gate_up"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )
        out[f"l{i}.down_x2"] = 2 * sd[p + "mlp.down_proj.weight"]
        out[f"l{i}.norm1"] = sd[p + "input_layernorm.weight"][None, :]
        out[f"l{i}.norm2"] = sd[p + "post_attention_layernorm.weight"][None, None, :]
    return out


ALGEBRA = {
    "embed": "dec.tok_embed.weight",
    "final_norm": {"to": "dec.output_norm.weight", "reshape": [-1]},
    "head": "dec.output.weight",
    "l{i}.qkv": [
        {"to": "dec.{i}.self_attn.wq.weight", "slice": {"stop": Q}},
        {"to": "dec.{i}.self_attn.wk.weight", "slice": {"start": Q, "stop": Q + KVR}},
        {"to": "dec.{i}.self_attn.wv.weight", "slice": {"start": Q + KVR, "stop": Q + 2 * KVR}},
    ],
    "l{i}.o_t": {"to": "dec.{i}.self_attn.wo.weight", "transpose": True},
    "l{i}.gate_up": [
        {"to": "dec.{i}.feed_forward.w1.weight", "chunk": {"parts": 2, "index": 0}},
        {"to": "dec.{i}.feed_forward.w3.weight", "chunk": {"parts": 2, "index": 1}},
    ],
    "l{i}.down_x2": {"to": "dec.{i}.feed_forward.w2.weight", "scale": 0.5},
    "l{i}.norm1": {"to": "dec.{i}.attn_norm.weight", "reshape": [H]},
    "l{i}.norm2": {"to": "dec.{i}.ffn_norm.weight", "reshape": [-1]},
}


def test_every_step_of_the_algebra(tmp_path: Path) -> None:
    """slice (q / k / v of one fused tensor), chunk (gate / up), transpose, scale, reshape."""
    ref = _llama()
    tensors = _rewritten(ref.state_dict())
    spec = _write(tmp_path, ref, tensors, {"tensors": {"map": ALGEBRA}})
    _same_as_transformers(spec, ref)


def test_each_step_matters(tmp_path: Path) -> None:
    """Dropping a step gives other numbers (the test above cannot pass without it)."""
    ref = _llama()
    tensors = _rewritten(ref.state_dict())
    ids = torch.tensor([3, 1, 4, 1, 5])
    good = all_logits(
        load_model(load_spec(_write(tmp_path, ref, tensors, {"tensors": {"map": ALGEBRA}}))), ids
    )
    for key, changed in (
        ("l{i}.down_x2", {"to": "dec.{i}.feed_forward.w2.weight"}),  # no scale
        ("l{i}.o_t", "dec.{i}.self_attn.wo.weight"),  # no transpose (square: it fits)
        (
            "l{i}.gate_up",
            [
                {"to": "dec.{i}.feed_forward.w1.weight", "chunk": {"parts": 2, "index": 1}},
                {"to": "dec.{i}.feed_forward.w3.weight", "chunk": {"parts": 2, "index": 0}},
            ],
        ),
    ):
        d = tmp_path / key.replace("{i}", "i")
        d.mkdir()
        spec = _write(d, ref, tensors, {"tensors": {"map": {**ALGEBRA, key: changed}}})
        assert not torch.allclose(all_logits(load_model(load_spec(spec)), ids), good), key


def test_one_tensor_feeds_two_slots(tmp_path: Path) -> None:
    """A checkpoint storing the embedding once, used by the table and by an untied head slot."""
    ref = _llama(tied=True)  # transformers' reference: the head is the embedding
    sd = ref.state_dict()
    tensors = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    network = {
        "output": {"tied": False},
        "tensors": {
            "preset": "hf_llama",
            "map": {"model.embed_tokens.weight": ["dec.tok_embed.weight", "dec.output.weight"]},
        },
    }
    _same_as_transformers(_write(tmp_path, ref, tensors, network), ref)


def test_pad_rounds_a_vocabulary_up(tmp_path: Path) -> None:
    """A network whose vocabulary is rounded up (192) over a checkpoint of 128 rows: the table
    and the head padded with zero rows; the real tokens' logits equal transformers', the
    padding's are 0."""
    ref = _llama()
    sd = ref.state_dict()
    network = {
        "tensors": {
            "preset": "hf_llama",
            "map": {
                "model.embed_tokens.weight": {"to": "dec.tok_embed.weight", "pad": {"size": 192}},
                "lm_head.weight": {"to": "dec.output.weight", "pad": {"axis": 0, "size": 192}},
            },
        }
    }
    spec = _write(tmp_path, ref, dict(sd), network)
    text = spec.read_text() + "hparams: {vocab_size: 192}\n"
    spec.write_text(text)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = all_logits(load_model(load_spec(spec)), ids)
    assert got.shape == (8, 192) and not got[:, 128:].any()
    assert (got[:, :128] - want).abs().max() <= 1e-4 * want.abs().max()


def test_layer_shared_weights(tmp_path: Path) -> None:
    """One stored set of layer weights (no {i} in the source) feeds every layer, as ALBERT's
    shared layers: against transformers with the same weights copied into each layer."""
    ref = _llama()
    sd = ref.state_dict()
    with torch.no_grad():  # the reference: layer 0's weights in every layer
        for name, p in ref.named_parameters():
            if name.startswith(f"{L}.") and not name.startswith(f"{L}.0."):
                p.copy_(sd[f"{L}.0." + name.split(".", 3)[3]])
    shared = {k.replace(f"{L}.0.", "shared."): v for k, v in sd.items() if k.startswith(f"{L}.0.")}
    rest = {k: v for k, v in sd.items() if not k.startswith(f"{L}.")}
    network = {
        "tensors": {
            "preset": "hf_llama",
            "map": {
                "shared.input_layernorm.weight": "dec.{i}.attn_norm.weight",
                "shared.self_attn.q_proj.weight": "dec.{i}.self_attn.wq.weight",
                "shared.self_attn.k_proj.weight": "dec.{i}.self_attn.wk.weight",
                "shared.self_attn.v_proj.weight": "dec.{i}.self_attn.wv.weight",
                "shared.self_attn.o_proj.weight": "dec.{i}.self_attn.wo.weight",
                "shared.post_attention_layernorm.weight": "dec.{i}.ffn_norm.weight",
                "shared.mlp.gate_proj.weight": "dec.{i}.feed_forward.w1.weight",
                "shared.mlp.up_proj.weight": "dec.{i}.feed_forward.w3.weight",
                "shared.mlp.down_proj.weight": "dec.{i}.feed_forward.w2.weight",
            },
        }
    }
    assert len(shared) == 9
    _same_as_transformers(_write(tmp_path, ref, {**shared, **rest}, network), ref)


def test_multihead_attention_in_proj_for_cross_attention() -> None:
    """torch.nn.MultiheadAttention's in_proj_weight [3E, E] used for cross-attention: q from
    the decoder, k and v from the encoder, cut by chunk into the three canonical slots (the
    cut checked against the module's own q / k / v projection)."""
    from inferflow.model.binding import Bound, _steps
    from inferflow.spec.types import MapEntry

    mha = torch.nn.MultiheadAttention(H, HEADS, batch_first=True)
    w, x = mha.in_proj_weight.detach(), torch.randn(5, H)
    for index, ref in enumerate(torch.nn.functional._in_projection_packed(x, x, x, w)):
        e = MapEntry(
            "layers.{i}.attn.in_proj_weight", "dec.{i}.cross_attn.wq.weight", chunk=(0, 3, index)
        )
        cut = _steps(Bound("in_proj_weight", e.target, e, None, False), w)  # type: ignore[arg-type]
        torch.testing.assert_close(x @ cut.t(), ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "value, message",
    [
        (
            {"to": "dec.{i}.self_attn.wq.weight", "slice": {"start": 0, "stop": 500}},
            r"l0\.qkv: slice 0:500 of axis 0 is out of range for shape \[128, 64\] "
            r"\(mapped by network\.tensors\.map\['l\{i\}\.qkv'\]\)",
        ),
        (
            {"to": "dec.{i}.self_attn.wq.weight", "chunk": {"parts": 3, "index": 0}},
            r"does not split into 3 equal parts",
        ),
        (
            {"to": "dec.{i}.self_attn.wq.weight", "reshape": [7, -1]},
            r"shape \[128, 64\] cannot be reshaped to \[7, -1\]",
        ),
        (
            {"to": "dec.{i}.self_attn.wq.weight", "pad": {"axis": 0, "size": 100}},
            r"l0\.qkv: pad axis 0 to 100: the tensor of shape \[128, 64\] has no such axis or "
            r"is already longer",
        ),
        (
            {"to": "dec.{i}.self_attn.wq.weight", "rope_rows": {"heads": 3}},
            r"l0\.qkv: rope_rows: 128 rows do not split into 3 heads of an even size",
        ),
        (
            "dec.{i}.self_attn.wq.weight",
            r"shape \[128, 64\] does not fit dec.0.self_attn.wq.weight of shape \[64, 64\] "
            r"\(mapped by network.tensors.map\['l\{i\}.qkv'\]\)",
        ),
    ],
)
def test_errors_name_the_rule_and_shapes_before_reading(
    tmp_path: Path, value: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _llama()
    tensors = _rewritten(ref.state_dict())
    spec = load_spec(
        _write(tmp_path, ref, tensors, {"tensors": {"map": {**ALGEBRA, "l{i}.qkv": value}}})
    )
    from inferflow.loaders.safetensors import SafetensorsSource

    def no_reads(*_: object) -> None:
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(SafetensorsSource, "get", no_reads)
    with pytest.raises(WeightBindingError, match=message):
        check_binding(spec)


def test_spec_errors_for_the_algebra(tmp_path: Path) -> None:
    """An unknown step, an index outside the parts, two sources for one target, a shared
    source feeding a per-layer slot of another shape: each named, before any weight is read."""
    ref = _llama()
    tensors = _rewritten(ref.state_dict())

    def spec_with(map_: dict) -> Path:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        return _write(d, ref, tensors, {"tensors": {"map": {**ALGEBRA, **map_}}})

    with pytest.raises(
        SpecError,
        match=r"unknown key 'rotate'; allowed: chunk, pad, per_layer, reshape, rope_rows, rows, scale, slice, to, transpose",
    ):
        load_spec(spec_with({"embed": {"to": "dec.tok_embed.weight", "rotate": 90}}))
    with pytest.raises(SpecError, match=r"chunk index 2 is not in 0..1"):
        load_spec(spec_with({"l{i}.gate_up": {"to": "x", "chunk": {"parts": 2, "index": 2}}}))
    twice = load_spec(spec_with({"head": ["dec.output.weight", "dec.tok_embed.weight"]}))
    with pytest.raises(
        WeightBindingError,
        match=r"dec.tok_embed.weight is given twice \(by network.tensors.map\['head'\]\[1\]\)",
    ):
        check_binding(twice)
    shared = load_spec(spec_with({"final_norm": "dec.{i}.self_attn.wo.weight"}))
    with pytest.raises(
        WeightBindingError,
        match=r"final_norm: shape \[1, 64\] does not fit dec.0.self_attn.wo.weight of shape \[64, 64\]",
    ):
        check_binding(shared)


def _pickle_spec(
    tmp: Path, model: Any, obj: Any, source: dict, network: dict | None = None
) -> Path:
    """``obj`` saved with torch.save (zip), the model's config.json and a llama spec over it."""
    import yaml

    model.config.save_pretrained(tmp)
    torch.save(obj, tmp / "ckpt.pt")
    doc = {
        "name": "keys",
        "base": "arch/llama",
        "source": {"format": "pickle", "files": ["ckpt.pt"], "config": "config.json", **source},
        **({"network": network} if network else {}),
    }
    (tmp / "spec.yaml").write_text(yaml.safe_dump(doc))
    return tmp / "spec.yaml"


def test_source_keys_choose_the_state_dicts_to_read(tmp_path: Path) -> None:
    """A training checkpoint with two dicts of tensors ({"model": ..., "ema": ...}, beside an
    epoch count) needs ``source.keys``: one key reads that dict as the state dict; several read
    each, their tensors named "key.name"."""
    model, other = _llama(), _llama()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)  # a different set of weights: the EMA
    sd, ema = model.state_dict(), other.state_dict()
    ckpt = {"model": sd, "ema": ema, "epoch": 3}
    spec = _pickle_spec(tmp_path, model, ckpt, {})
    with pytest.raises(
        Exception, match=r"found 2 dicts of tensors.*choose with the spec's source.keys"
    ):
        load_model(load_spec(spec))
    _same_as_transformers(_pickle_spec(tmp_path, model, ckpt, {"keys": ["ema"]}), other)
    _same_as_transformers(_pickle_spec(tmp_path, model, ckpt, {"keys": ["model"]}), model)
    # the body and the embeddings stored apart: both read, names prefixed by their key
    split = {
        "embeddings": {k: v for k, v in sd.items() if "embed_tokens" in k},
        "body": {k: v for k, v in sd.items() if "embed_tokens" not in k},
        "step": 1000,
    }
    network = {
        "tensors": {
            "preset": None,
            "map": {
                "embeddings.model.embed_tokens.weight": "dec.tok_embed.weight",
                "body.model.norm.weight": "dec.output_norm.weight",
                "body.lm_head.weight": "dec.output.weight",
                **{
                    f"body.{k}": v
                    for k, v in {
                        f"{L}.{{i}}.input_layernorm.weight": "dec.{i}.attn_norm.weight",
                        f"{L}.{{i}}.post_attention_layernorm.weight": "dec.{i}.ffn_norm.weight",
                        **{
                            f"{L}.{{i}}.self_attn.{p}_proj.weight": f"dec.{{i}}.self_attn.w{p}.weight"
                            for p in "qkvo"
                        },
                        f"{L}.{{i}}.mlp.gate_proj.weight": "dec.{i}.feed_forward.w1.weight",
                        f"{L}.{{i}}.mlp.up_proj.weight": "dec.{i}.feed_forward.w3.weight",
                        f"{L}.{{i}}.mlp.down_proj.weight": "dec.{i}.feed_forward.w2.weight",
                    }.items()
                },
            },
        }
    }
    spec = _pickle_spec(tmp_path, model, split, {"keys": ["embeddings", "body"]}, network)
    _same_as_transformers(spec, model)
    with pytest.raises(
        Exception,
        match=r"source.keys: 'emb' is not a top-level dict of tensors; the checkpoint has: 'embeddings', 'body'",
    ):
        load_model(load_spec(_pickle_spec(tmp_path, model, split, {"keys": ["emb"]}, network)))


def _sharded(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain torch: the embedding table and the head stored as two vocabulary shards each, every
    down projection as two shards of its output rows (a tensor-parallel checkpoint's layout)."""
    out = {k: v for k, v in sd.items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    for name, key in (("embed", "model.embed_tokens.weight"), ("head", "lm_head.weight")):
        out[f"{name}.0"], out[f"{name}.1"] = sd[key][:50], sd[key][50:]
    for i in range(LAYERS):
        w = out.pop(f"{L}.{i}.mlp.down_proj.weight")
        out[f"down.{i}.a"], out[f"down.{i}.b"] = w[: H // 2], w[H // 2 :]
    return out


def _shard_map(head_second: tuple[int, int] = (50, VOCAB)) -> dict:
    return {
        "embed.0": {"to": "dec.tok_embed.weight", "rows": {"stop": 50}},
        "embed.1": {"to": "dec.tok_embed.weight", "rows": {"start": 50, "stop": VOCAB}},
        "head.0": {"to": "dec.output.weight", "rows": {"stop": 50}},
        "head.1": {
            "to": "dec.output.weight",
            "rows": {"start": head_second[0], "stop": head_second[1]},
        },
        "down.{i}.a": {"to": "dec.{i}.feed_forward.w2.weight", "rows": {"stop": H // 2}},
        "down.{i}.b": {
            "to": "dec.{i}.feed_forward.w2.weight",
            "rows": {"start": H // 2, "stop": H},
        },
    }


def test_rows_concatenate_shards(tmp_path: Path) -> None:
    ref = _llama()
    network = {"tensors": {"preset": "hf_llama", "map": _shard_map()}}
    _same_as_transformers(_write(tmp_path, ref, _sharded(ref.state_dict()), network), ref)


@pytest.mark.parametrize(
    ("head_second", "message"),
    [
        ((40, VOCAB - 10), "head.1: rows 40:118 of dec.output.weight are given twice"),
        ((60, VOCAB), "lacks 1 tensor(s) the network needs: dec.output.weight (rows 50:60 of 128)"),
        ((50, VOCAB + 2), "head.1: rows 50:130 lie past the 128 rows of dec.output.weight"),
    ],
)
def test_rows_errors(tmp_path: Path, head_second: tuple[int, int], message: str) -> None:
    """Overlapping, missing and out-of-range rows are named before any weight is read (the
    shapes then need not fit: an error about the rows comes first or with them)."""
    ref = _llama()
    tensors = _sharded(ref.state_dict())
    a, b = head_second
    tensors["head.1"] = torch.zeros(b - a, H)
    network = {"tensors": {"preset": "hf_llama", "map": _shard_map(head_second)}}
    with pytest.raises(WeightBindingError) as e:
        check_binding(load_spec(_write(tmp_path, ref, tensors, network)))
    assert message in str(e.value)


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of q / k rows (HF halves -> adjacent pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_rope_rows_undo_the_gguf_permutation(tmp_path: Path) -> None:
    """q / k rows stored as llama.cpp writes them (each head's pairs adjacent): ``rope_rows``
    with the stack's head counts brings them back to HF's layout; and the other way, HF's rows
    turned adjacent run under ``pairing: adjacent``. Both against transformers."""
    ref = _llama()
    sd = ref.state_dict()
    permuted = dict(sd)
    for i in range(LAYERS):
        for p, n in (("q", HEADS), ("k", KV)):
            key = f"{L}.{i}.self_attn.{p}_proj.weight"
            permuted[key] = _llama_cpp_permute(sd[key], n)
    back = {
        f"{L}.{{i}}.self_attn.{p}_proj.weight": {
            "to": f"dec.{{i}}.self_attn.w{p}.weight",
            "rope_rows": {"heads": heads, "to": "half"},
        }
        for p, heads in (("q", "n_heads"), ("k", "n_kv_heads"))
    }
    network = {"tensors": {"preset": "hf_llama", "map": back}}
    _same_as_transformers(_write(tmp_path, ref, permuted, network), ref)
    # a wrong head count scrambles the rows across heads: the logits move
    wrong = {k: {**v, "rope_rows": {"heads": 1, "to": "half"}} for k, v in back.items()}
    spec = _write(tmp_path, ref, permuted, {"tensors": {"preset": "hf_llama", "map": wrong}})
    with pytest.raises(AssertionError):
        _same_as_transformers(spec, ref)
    forward = {
        k: {**v, "rope_rows": {"heads": v["rope_rows"]["heads"], "to": "adjacent"}}
        for k, v in back.items()
    }
    network = {
        "position": {"type": "rope", "pairing": "adjacent"},
        "tensors": {"preset": "hf_llama", "map": forward},
    }
    _same_as_transformers(_write(tmp_path, ref, dict(sd), network), ref)
