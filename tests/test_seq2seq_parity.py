"""Encoder-only and encoder-decoder networks from spec files alone, against transformers in fp32:
hidden states (encoder-only) and decoder logits given an encoder input (encoder-decoder) within
1e-4 relative, from safetensors and from pickle checkpoints (zip and legacy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inferflow.model.batch import ContiguousKVCache, FlatBatch, packed
from inferflow.model.build import load_model
from inferflow.model.cross import CrossBank
from inferflow.spec import load_spec
from tests.conftest import CHECKPOINTS, save_models, spec_doc

tf = pytest.importorskip("transformers")

VOCAB = 128
ENC_DEC = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=96,
    decoder_ffn_dim=96,
    max_position_embeddings=64,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
)

ENC = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=64,
)

# the same sizes under DistilBERT's config keys
DISTILBERT = dict(
    vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_position_embeddings=64
)

# architecture template -> builder of a random transformers model (one row per architecture)
CASES = {
    "bert": lambda: tf.BertModel(tf.BertConfig(**ENC)),
    # learned positions from offset 2 counted in the table's rows, one token type
    "roberta": lambda: tf.RobertaModel(tf.RobertaConfig(**ENC, type_vocab_size=1)),
    "xlm-roberta": lambda: tf.XLMRobertaModel(tf.XLMRobertaConfig(**ENC)),
    # own names and config keys, no token types
    "distilbert": lambda: tf.DistilBertModel(tf.DistilBertConfig(**DISTILBERT)),
    # a factorised embedding: width 32, projected to 64
    "electra": lambda: tf.ElectraModel(tf.ElectraConfig(**ENC, embedding_size=32)),
    # one set of layer weights shared by every layer, factorised embedding, tanh GELU
    "albert": lambda: tf.AlbertModel(
        tf.AlbertConfig(**{**ENC, "num_hidden_layers": 3}, embedding_size=32)
    ),
    # learned absolute positions and a shared relative attention bias at once
    "mpnet": lambda: tf.MPNetModel(tf.MPNetConfig(**ENC)),
    "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(**ENC_DEC)),
    "m2m100": lambda: tf.M2M100ForConditionalGeneration(tf.M2M100Config(**ENC_DEC)),
    "marian": lambda: tf.MarianMTModel(
        tf.MarianConfig(**ENC_DEC, scale_embedding=True, activation_function="swish")
    ),
    # per-stack numbers: the encoder's vocabulary (160), heads (8) and FFN width (112) differ
    # from the decoder's (128, 4, 96), 3 encoder layers against 2
    "fsmt": lambda: tf.FSMTForConditionalGeneration(
        tf.FSMTConfig(
            **{k: v for k, v in ENC_DEC.items() if k != "vocab_size"}
            | dict(
                langs=["en", "de"],
                src_vocab_size=160,
                tgt_vocab_size=VOCAB,
                encoder_layers=3,
                encoder_attention_heads=8,
                encoder_ffn_dim=112,
            )
        )
    ),
    "t5": lambda: tf.T5ForConditionalGeneration(
        tf.T5Config(
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=96,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,  # distances past it share the last bucket
        )
    ),
}


ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "albert", "mpnet")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    return save_models(CASES, tmp_path_factory)


def ids(n: int, seed: int) -> torch.Tensor:
    # ids 3.. avoid the special tokens (M2M100 counts positions past padding)
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def decoder_logits(model: torch.nn.Module, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    h = model.spec.hparams
    memory = model.cross_memory(model.encode([src.tolist()])[0])
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, 64, torch.float32)
    batch = FlatBatch.single(tgt, 0, cache)
    batch.cross = CrossBank.of([memory]).rows([0], [tgt.numel()])
    batch.logits_rows = torch.arange(tgt.numel())
    return model(batch)


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
@pytest.mark.parametrize("arch", list(CASES))
def test_outputs_match_transformers(arch: str, ckpt: str, hf_models, write_spec) -> None:
    ref_model, d = hf_models[arch]
    model = load_model(load_spec(write_spec(spec_doc(arch, d, ckpt))))
    src, tgt = ids(23, 1), ids(11, 2)
    with torch.no_grad():
        if arch in ENCODERS:
            ref = ref_model(src[None]).last_hidden_state[0]
            ours = model(packed([src.tolist()]))
        else:
            # (no cache: FSMT's decoder drops its causal mask when it fills one)
            kw = {"use_cache": False}
            ref = ref_model(input_ids=src[None], decoder_input_ids=tgt[None], **kw).logits[0]
            ours = decoder_logits(model, src, tgt)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-4, f"{arch}/{ckpt}: max relative difference {rel:.2e}"


@pytest.mark.parametrize("arch", [a for a in CASES if a not in ENCODERS])
def test_incremental_decode_matches_full_forward(arch: str, hf_models, write_spec) -> None:
    """The decoder fed in chunks, then one token per step, gives the full pass's logits."""
    _, d = hf_models[arch]
    model = load_model(load_spec(write_spec(spec_doc(arch, d, "safetensors"))))
    src, tgt = ids(17, 3), ids(12, 4)
    with torch.no_grad():
        full = decoder_logits(model, src, tgt)
        memory = model.cross_memory(model.encode([src.tolist()])[0])
        h = model.spec.hparams
        cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, 64, torch.float32)
        for a, b in [(0, 5)] + [(t, t + 1) for t in range(5, 12)]:
            batch = FlatBatch.single(tgt[a:b], a, cache)
            batch.cross = CrossBank.of([memory]).rows([0], [b - a])
            torch.testing.assert_close(model(batch)[0], full[b - 1], rtol=1e-5, atol=1e-5)


def test_packed_encoder_equals_one_at_a_time(hf_models, write_spec) -> None:
    """Sources of different lengths packed into one pass (no padding) encode as alone."""
    _, d = hf_models["bart"]
    model = load_model(load_spec(write_spec(spec_doc("bart", d, "safetensors"))))
    sources = [ids(n, 10 + n).tolist() for n in (5, 17, 1, 9)]
    with torch.no_grad():
        together = model.encode(sources)
        for s, t in zip(sources, together, strict=True):
            torch.testing.assert_close(t, model.encode([s])[0], rtol=1e-5, atol=1e-6)


def test_encoder_decoder_spec_on_a_decoder_only_checkpoint(tmp_path, write_spec) -> None:
    """A spec that declares encoder_decoder for a checkpoint without encoder tensors says so."""
    from inferflow.errors import WeightBindingError

    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            vocab_size=VOCAB,
            num_hidden_layers=2,
        )
    )
    model.save_pretrained(tmp_path)
    doc = {
        "name": "wrong",
        "base": "arch/llama",
        "source": {"format": "hf", "files": [str(tmp_path)]},
        "network": {"type": "encoder_decoder"},
    }
    with pytest.raises(WeightBindingError) as e:
        load_model(load_spec(write_spec(doc)))
    assert "no checkpoint tensor maps to the encoder (enc.*)" in str(e.value)
    assert "network.type" in str(e.value)


@pytest.mark.parametrize(
    ("arch", "extra", "expected"),
    [
        (
            "electra",
            {"network": {"embedding": {"projection": False}}},
            "embed_dim 32 differs from hidden 64, but network.embedding.projection is false",
        ),
        (
            "mpnet",
            {"network": {"position": [{"type": "relative"}, {"type": "relative"}]}},
            "network.position: 'relative' is listed twice",
        ),
        (
            "mpnet",
            {"network": {"position": [{"type": "learned", "offset": 64, "offset_in_table": True}]}},
            "offset 64 leaves no position in a table of 64 rows",
        ),
        # one table for two vocabularies cannot be
        (
            "fsmt",
            {"network": {"embedding": {"shared": True}}},
            "the encoder's table (160 x 64) differs from the decoder's (128 x 64)",
        ),
        # the spec's encoder numbers win over the checkpoint's, and binding checks them
        (
            "fsmt",
            {"hparams": {"encoder": {"ffn_hidden": 100}}},
            "model.encoder.layers.0.fc1.weight: shape [112, 64] does not fit "
            "enc.0.feed_forward.w1.weight of shape [100, 64]",
        ),
        (
            "fsmt",
            {"hparams": {"encoder": {"heads": 4}}},
            "hparams.encoder: unknown key 'heads'",
        ),
    ],
)
def test_composition_errors_name_the_option(arch, extra, expected, hf_models, write_spec) -> None:  # noqa: ANN001
    from inferflow.errors import InferflowError

    doc = {**spec_doc(arch, hf_models[arch][1], "safetensors"), **extra}
    with pytest.raises(InferflowError) as e:
        load_model(load_spec(write_spec(doc)))
    assert expected in str(e.value)
