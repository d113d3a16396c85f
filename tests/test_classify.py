"""Classification heads (``network.head: {type: classify}``) against transformers'
``*ForSequenceClassification`` in fp32: logits of tiny random BERT / RoBERTa / XLM-R / DistilBERT
/ ELECTRA classifiers from their templates; a BERT cross-encoder scoring text pairs (token types
1 for the second text) from a real WordPiece vocabulary; a packed batch equals each input alone;
clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inferflow.engine.classify import classify_batch, probabilities, token_classify_batch
from inferflow.errors import RequestError, SpecError
from inferflow.model.build import load_model
from inferflow.spec import load_spec
from tests.conftest import CHECKPOINTS, randomize, save_models, spec_doc
from tests.test_seq2seq_parity import DISTILBERT, VOCAB
from tests.test_seq2seq_parity import ENC as ENCODER

tf = pytest.importorskip("transformers")

ENC = {**ENCODER, "num_labels": 3, "id2label": {0: "neg", 1: "neutral", 2: "pos"}}

# classifier template -> builder of a random transformers classifier
CASES = {
    "bert-classifier": lambda: tf.BertForSequenceClassification(tf.BertConfig(**ENC)),
    "roberta-classifier": lambda: tf.RobertaForSequenceClassification(
        tf.RobertaConfig(**ENC, type_vocab_size=1)
    ),
    "xlm-roberta-classifier": lambda: tf.XLMRobertaForSequenceClassification(
        tf.XLMRobertaConfig(**ENC)
    ),
    "distilbert-classifier": lambda: tf.DistilBertForSequenceClassification(
        tf.DistilBertConfig(**DISTILBERT, num_labels=3, id2label=ENC["id2label"])
    ),
    "electra-classifier": lambda: tf.ElectraForSequenceClassification(
        tf.ElectraConfig(**ENC, embedding_size=32)
    ),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    return save_models(CASES, tmp_path_factory)


def ids(n: int, seed: int) -> list[int]:
    # ids 3.. avoid the special tokens (RoBERTa's padding id 1 would restart its positions)
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
@pytest.mark.parametrize("arch", list(CASES))
def test_logits_match_transformers(arch: str, ckpt: str, hf_models, write_spec) -> None:  # noqa: ANN001
    ref_model, d = hf_models[arch]
    model = load_model(load_spec(write_spec(spec_doc(arch, d, ckpt))))
    assert model.head.labels == ("neg", "neutral", "pos")
    inputs = [ids(n, n) for n in (23, 5, 1, 40)]
    got = classify_batch(model, inputs)
    with torch.no_grad():
        want = torch.cat([ref_model(torch.tensor([x])).logits for x in inputs])
    rel = (got - want).abs().max() / want.abs().max()
    assert rel <= 1e-4, f"{arch}/{ckpt}: max relative difference {rel:.2e}"
    # several passes (a token budget below the batch) give each input's own logits
    torch.testing.assert_close(classify_batch(model, inputs, max_batch_tokens=30), got)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A one-label BERT cross-encoder on all-MiniLM-L6-v2's WordPiece vocabulary: (transformers
    model, transformers tokenizer, ours, our spec's path)."""
    from tests.test_embed import minilm_dir

    vocab = minilm_dir()
    cfg = tf.BertConfig(**{**ENC, "vocab_size": 30522, "num_labels": 1, "id2label": {0: "score"}})
    torch.manual_seed(0)
    ref = tf.BertForSequenceClassification(cfg).eval()
    from tests.conftest import randomize, save_reference

    randomize(ref)
    d = tmp_path_factory.mktemp("cross-encoder")
    save_reference(ref, d)
    spec = d / "spec.yaml"
    spec.write_text(
        f"name: tiny-cross-encoder\nbase: arch/bert-classifier\n"
        f"source: {{format: hf, files: ['{d}']}}\n"
        f"tokenizer: {{from: tokenizer_json, files: ['{vocab / 'tokenizer.json'}']}}\n"
    )
    from inferflow.runtime import load

    return ref, tf.AutoTokenizer.from_pretrained(vocab), load(str(spec)), spec


PAIRS = [
    ("how many people live in berlin?", "Berlin has a population of about 3.7 million."),
    ("how many people live in berlin?", "New York City is famous for its museums."),
    ("what is a transformer?", "A transformer maps token sequences with attention layers."),
]


def test_cross_encoder_scores_pairs_like_transformers(cross_encoder) -> None:  # noqa: ANN001
    ref, ref_tok, lm, _ = cross_encoder
    enc = [lm.tokenizer.encode_pair(q, doc) for q, doc in PAIRS]
    for (q, doc), (i, t) in zip(PAIRS, enc, strict=True):
        want = ref_tok(q, doc)
        assert (i, t) == (want["input_ids"], want["token_type_ids"])
        assert 1 in t  # the document's tokens are type 1
    got = lm.classify(PAIRS)
    with torch.no_grad():
        b = ref_tok([q for q, _ in PAIRS], [d for _, d in PAIRS], padding=True, return_tensors="pt")
        want = torch.sigmoid(ref(**b).logits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the token types matter: scored as if every token were type 0, the scores move
    plain = probabilities(classify_batch(lm.model, [i for i, _ in enc]))
    assert (plain - want).abs().max() > 1e-3


def test_errors_name_the_problem(cross_encoder, hf_models, write_spec) -> None:  # noqa: ANN001
    _, _, lm, _ = cross_encoder
    with pytest.raises(RequestError, match="no inputs"):
        classify_batch(lm.model, [])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        classify_batch(lm.model, [[1, 99999]])
    with pytest.raises(RequestError, match="token types below 2"):
        classify_batch(lm.model, [[101, 102]], [[0, 2]])
    # RoBERTa has one token type: a pair whose second text is type 1 cannot be told apart
    model = load_model(
        load_spec(
            write_spec(
                spec_doc("roberta-classifier", hf_models["roberta-classifier"][1], "safetensors")
            )
        )
    )
    with pytest.raises(RequestError, match="token types below 1"):
        classify_batch(model, [[5, 6]], [[0, 1]])
    # a model without a head says what it lacks
    bert = spec_doc("bert", hf_models["bert-classifier"][1], "safetensors")
    bert["network"] = {
        "tensors": {
            "prefix": "bert.",
            "ignore": [
                "classifier.weight",
                "classifier.bias",
                "pooler.dense.weight",
                "pooler.dense.bias",
            ],
        }
    }
    with pytest.raises(RequestError, match="has no classification head"):
        classify_batch(load_model(load_spec(write_spec(bert))), [[5, 6]])


def _reference_scores(cross_encoder, query: str, docs: list[str]) -> list[float]:  # noqa: ANN001
    ref, ref_tok = cross_encoder[:2]
    with torch.no_grad():
        b = ref_tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        return torch.sigmoid(ref(**b).logits)[:, 0].tolist()


def test_rerank_and_classify_routes(cross_encoder, tmp_path) -> None:  # noqa: ANN001
    """``/v1/rerank`` (Cohere / vLLM shape) orders the documents by transformers' scores;
    ``/v1/classify`` (vLLM shape) gives each input's label probabilities; bad requests are 400s
    naming the problem."""
    import httpx

    from tests.serving import run_server

    query = PAIRS[0][0]
    docs = [d for _, d in PAIRS] + ["Berlin is the capital of Germany."]
    want = _reference_scores(cross_encoder, query, docs)
    with run_server(tmp_path, spec=str(cross_encoder[3])) as (url, _):
        r = httpx.post(
            f"{url}/v1/rerank",
            json={"query": query, "documents": [docs[0], {"text": docs[1]}, *docs[2:]], "top_n": 3},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        order = sorted(range(len(docs)), key=lambda i: -want[i])[:3]
        assert [x["index"] for x in body["results"]] == order
        for x in body["results"]:
            assert x["relevance_score"] == pytest.approx(want[x["index"]], rel=1e-4, abs=1e-6)
            assert x["document"] == {"text": docs[x["index"]]}
        assert body["usage"]["total_tokens"] > 0 and body["id"].startswith("rerank-")
        bare = httpx.post(
            f"{url}/v1/rerank", json={"query": query, "documents": docs, "return_documents": False}
        ).json()
        assert len(bare["results"]) == len(docs) and "document" not in bare["results"][0]

        r = httpx.post(f"{url}/v1/classify", json={"input": docs[:2]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        ref, ref_tok = cross_encoder[:2]
        with torch.no_grad():
            single = torch.sigmoid(
                ref(**ref_tok(docs[:2], padding=True, return_tensors="pt")).logits
            )
        assert [d["index"] for d in data] == [0, 1]
        for d, p in zip(data, single.tolist(), strict=True):
            assert d["label"] == "score" and d["num_classes"] == 1
            assert d["probs"] == pytest.approx(p, rel=1e-4)

        for bad, message in [
            ({"query": query, "documents": []}, "documents"),
            ({"query": query, "documents": docs, "top_n": 0}, "top_n"),
            ({"query": "", "documents": docs}, "query"),
            ({"query": query, "documents": docs, "rank": 1}, "rank"),
        ]:
            r = httpx.post(f"{url}/v1/rerank", json=bad)
            assert r.status_code == 400 and message in r.text, (bad, r.text)
        r = httpx.post(f"{url}/v1/rerank", json={"query": query * 200, "documents": docs})
        assert r.status_code == 400 and "at most 64" in r.text, r.text


def test_cli_classify(cross_encoder, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    import json

    from inferflow.cli.main import main

    spec = str(cross_encoder[3])
    query, docs = PAIRS[0][0], [d for _, d in PAIRS]
    assert main(["classify", spec, "--query", query, *[a for d in docs for a in ("--doc", d)]]) == 0
    got = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
    assert got == pytest.approx(_reference_scores(cross_encoder, query, docs), rel=1e-4)
    assert main(["classify", spec, "--text", docs[0]]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["label"] == "score" and set(line["probs"]) == {"score"}
    assert main(["classify", spec, "--doc", docs[0]]) == 2
    assert "--doc needs --query" in capsys.readouterr().err
    assert main(["classify", "all-minilm-l6-v2", "--text", "x"]) == 2
    assert "declares no classification head" in capsys.readouterr().err


def test_inspect_shows_where_the_spec_puts_each_tensor(cross_encoder, capsys) -> None:  # noqa: ANN001
    import json

    from inferflow.cli.main import main

    spec = cross_encoder[3]
    assert main(["inspect", str(spec.parent), "--spec", str(spec), "--json"]) == 0
    to = {t["name"]: t["to"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert to["classifier.weight"] == "head.out.weight"
    assert to["bert.pooler.dense.bias"] == "head.dense.bias"
    assert to["bert.encoder.layer.1.output.dense.weight"] == "enc.1.feed_forward.w2.weight"
    plain = spec.with_name("plain.yaml")  # BERT's own template: it ignores the pooler
    plain.write_text(
        spec.read_text().replace("arch/bert-classifier", "arch/bert")
        + "network: {tensors: {prefix: 'bert.'}}\n"
    )
    assert main(["inspect", str(spec.parent), "--spec", str(plain), "--json"]) == 0
    to = {t["name"]: t["to"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert to["bert.pooler.dense.weight"] == "(ignored)"
    assert to["classifier.weight"] == "(unmapped)"


def test_pooler_head_gives_berts_pooler_output(hf_models, write_spec) -> None:  # noqa: ANN001
    """``network.head: {type: pooler}`` (dense + tanh on the [CLS] state): the embeddings are
    transformers' ``pooler_output``."""
    from inferflow.engine.embed import embed_batch

    ref_model, d = hf_models["bert-classifier"]
    doc = spec_doc("bert", d, "safetensors")
    doc["network"] = {
        "head": {"type": "pooler"},
        "tensors": {
            "prefix": "bert.",
            "map": {
                "pooler.dense.weight": "head.dense.weight",
                "pooler.dense.bias": "head.dense.bias",
            },
            "ignore": ["classifier.weight", "classifier.bias"],
        },
    }
    model = load_model(load_spec(write_spec(doc)))
    inputs = [ids(n, n) for n in (23, 5, 1)]
    got = embed_batch(model, inputs, "mean", normalize=False)
    with torch.no_grad():
        want = torch.cat([ref_model.bert(torch.tensor([x])).pooler_output for x in inputs])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # not a classifier: classify says so
    with pytest.raises(RequestError, match="has no classification head"):
        classify_batch(model, inputs)


def test_head_norm_and_label_groups_match_plain_torch(tmp_path: Path, write_spec) -> None:  # noqa: ANN001
    """A head that normalises the mean-pooled vector (``LayerNorm(mean(h))``, nanochat / SetFit
    style) before an output of two independent choices (``groups: [3, 2]``), against the same
    written with plain torch modules on transformers' BertModel; the groups' sizes must add up
    to the labels."""
    from safetensors.torch import save_file

    labels = {0: "a", 1: "b", 2: "c", 3: "yes", 4: "no"}
    torch.manual_seed(1)
    body = tf.BertModel(
        tf.BertConfig(**{**ENC, "num_labels": 5, "id2label": labels}), add_pooling_layer=False
    ).eval()
    randomize(body)
    norm, out = (
        torch.nn.LayerNorm(ENC["hidden_size"], eps=1e-6),
        torch.nn.Linear(ENC["hidden_size"], 5),
    )
    randomize(norm)
    body.config.save_pretrained(tmp_path)
    tensors = {f"body.{k}": v for k, v in body.state_dict().items()}
    tensors |= {f"norm.{k}": v for k, v in norm.state_dict().items()}
    tensors |= {f"out.{k}": v for k, v in out.state_dict().items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    doc = {
        "name": "normed-groups",
        "base": "arch/bert",
        "source": {"format": "hf", "files": [str(tmp_path)]},
        "network": {
            "head": {
                "type": "classify",
                "pooling": "mean",
                "norm": "layer",
                "norm_eps": 1e-6,
                "groups": [3, 2],
            },
            "tensors": {
                "prefix": "body.",
                "map": {
                    "norm.weight": "head.norm.weight",
                    "norm.bias": "head.norm.bias",
                    "out.weight": "head.out.weight",
                    "out.bias": "head.out.bias",
                },
                "ignore": ["embeddings.position_ids"],
            },
        },
    }
    model = load_model(load_spec(write_spec(doc)))
    inputs = [ids(n, n) for n in (9, 2, 17)]
    got = classify_batch(model, inputs)
    with torch.no_grad():
        want = torch.stack(
            [out(norm(body(torch.tensor([x])).last_hidden_state[0].mean(0))) for x in inputs]
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    probs = probabilities(got, model.head.spans())
    torch.testing.assert_close(probs[:, :3], torch.softmax(want[:, :3], -1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(probs[:, 3:], torch.softmax(want[:, 3:], -1), rtol=1e-4, atol=1e-6)
    doc["network"]["head"]["groups"] = [3, 3]
    with pytest.raises(
        SpecError, match=r"head.groups: \[3, 3\] add up to 6 outputs, but there are 5 labels"
    ):
        load_model(load_spec(write_spec(doc)))


TAGS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC"}


@pytest.fixture(scope="module")
def token_classifier(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A tiny random BertForTokenClassification and a spec of it whose tokenizer is an inline
    word-level vocabulary: (transformers model, spec path, vocabulary)."""
    torch.manual_seed(2)
    ref = tf.BertForTokenClassification(
        tf.BertConfig(**{**ENC, "num_labels": 4, "id2label": TAGS})
    ).eval()
    randomize(ref)
    d = tmp_path_factory.mktemp("token-classifier")
    ref.save_pretrained(d)
    words = ["[UNK]", "[CLS]", "[SEP]", "alice", "lives", "in", "paris", "bob", "smith", "."]
    spec = d / "spec.yaml"
    spec.write_text(
        "name: tiny-tagger\nbase: arch/bert\n"
        f"source: {{format: hf, files: ['{d}']}}\n"
        "tokenizer:\n"
        "  normalizer: {type: lowercase}\n"
        "  pre_tokenizer: {type: whitespace}\n"
        f"  model: {{type: wordlevel, vocab: {{list: {words}}}, unk: '[UNK]'}}\n"
        "  specials: {bos: '[CLS]', eos: '[SEP]'}\n"
        "  template: '[CLS] $A [SEP]'\n"
        "network:\n"
        "  head: {type: token_classify}\n"
        "  tensors:\n"
        "    prefix: bert.\n"
        "    map: {classifier.weight: head.out.weight, classifier.bias: head.out.bias}\n"
    )
    return ref, spec, {w: i for i, w in enumerate(words)}


def test_token_classify_matches_transformers(token_classifier) -> None:  # noqa: ANN001
    """``token_classify``: logits for every token equal BertForTokenClassification's, packed
    batches equal each input alone; a whole-input call says what the head does."""
    ref, spec, _ = token_classifier
    model = load_model(load_spec(spec))
    inputs = [ids(n, n) for n in (7, 1, 30)]
    got = token_classify_batch(model, inputs)
    for x, g in zip(inputs, got, strict=True):
        with torch.no_grad():
            want = ref(torch.tensor([x])).logits[0]
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(token_classify_batch(model, inputs, max_batch_tokens=8), got, strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(RequestError, match="labels every token"):
        classify_batch(model, inputs)


def test_token_classify_served(token_classifier, tmp_path: Path) -> None:  # noqa: ANN001
    """``/v1/classify`` of a token_classify model: each token's label and probabilities."""
    import httpx

    from tests.serving import run_server

    ref, spec, vocab = token_classifier
    texts = ["Alice lives in Paris .", "bob smith lives in paris"]
    with run_server(tmp_path, spec=str(spec)) as (url, _):
        r = httpx.post(f"{url}/v1/classify", json={"input": texts})
    assert r.status_code == 200, r.text
    for text, d in zip(texts, r.json()["data"], strict=True):
        x = [1, *(vocab.get(w.lower(), 0) for w in text.split()), 2]
        with torch.no_grad():
            want = torch.softmax(ref(torch.tensor([x])).logits[0], -1)
        assert d["token_ids"] == x
        assert d["labels"] == [TAGS[int(i)] for i in want.argmax(-1)]
        torch.testing.assert_close(torch.tensor(d["probs"]), want, rtol=1e-4, atol=1e-6)


def test_decoder_score_head_matches_transformers(tmp_path: Path, write_spec) -> None:  # noqa: ANN001
    """A decoder's sequence classifier (LlamaForSequenceClassification: ``score`` on the last
    token's state, no bias) as a classify head with pooling last."""
    torch.manual_seed(3)
    cfg = tf.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, num_labels=3,
        id2label={0: "neg", 1: "neutral", 2: "pos"}, pad_token_id=None,
    )  # fmt: skip
    ref = tf.LlamaForSequenceClassification(cfg).eval()
    randomize(ref)
    ref.save_pretrained(tmp_path)
    doc = {
        "name": "tiny-llama-classifier",
        "base": "arch/llama",
        "source": {"format": "hf", "files": [str(tmp_path)]},
        "network": {
            "head": {"type": "classify", "pooling": "last", "bias": False},
            "output": {"tied": True},  # (no lm_head: the logits are the score's)
            "tensors": {"map": {"score.weight": "head.out.weight"}},
        },
    }
    model = load_model(load_spec(write_spec(doc)))
    inputs = [ids(n, n) for n in (11, 3, 25)]
    got = classify_batch(model, inputs)
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([x])).logits for x in inputs])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
