"""The ``pickle_vocab`` tokenizer kind: a pickled token list / dict read by our own pickle
interpreter, text cut by the spec's regex, unknown pieces to unk; clear errors for malformed
vocabularies; the spec keys that configure it. (The real model using it: tests/test_annalog.py.)"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

import pytest

from inferflow.errors import SpecError, TokenizerError
from inferflow.runtime import tokenizer_for
from inferflow.spec import load_spec
from inferflow.tokenizer import (
    PipelineSpec,
    Specials,
    load_tokenizer,
    read_pickle_vocab,
    tokenizer_from_pickle_vocab,
)

ITOS = ["<unk>", "<pad>", "<sos>", "<eos>", "c", "C", "1", "Cl", "[nH]", "%10", "\n"]
PATTERN = r"\[[^\]]*\]|%\d{2}|Br|Cl|[\s\S]"


def dump(tmp_path: Path, obj: object, name: str = "vocab.pkl") -> Path:
    p = tmp_path / name
    p.write_bytes(pickle.dumps(obj, protocol=4))
    return p


@pytest.mark.parametrize(
    "content",
    [
        ITOS,
        {t: i for i, t in enumerate(ITOS)},
        {"itos": ITOS},
        {"stoi": {t: i for i, t in reversed(list(enumerate(ITOS)))}},  # any order
        {"itos": ITOS, "stoi": {t: i for i, t in enumerate(ITOS)}, "freqs": {"C": 3}},
    ],
    ids=["list", "stoi", "itos_only", "stoi_only", "itos_stoi_freqs"],
)
def test_vocab_shapes(tmp_path: Path, content: object) -> None:
    assert read_pickle_vocab(dump(tmp_path, content)) == ITOS


def test_encode_decode(tmp_path: Path) -> None:
    tok = tokenizer_from_pickle_vocab(dump(tmp_path, ITOS), PATTERN)
    assert (tok.unk_id, tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, 2, [3])
    assert not tok.add_bos and not tok.add_eos
    assert tok.encode("Clc1[nH]%10") == [7, 4, 6, 8, 9]
    assert tok.encode("CBrX\n\n") == [5, 0, 0, 10, 10]  # Br and X are unknown: unk each
    assert tok.decode([2, 7, 4, 0, 6, 3, 1]) == "Clc1"  # no separator, specials dropped
    assert tok.decode([7, 9], skip_special_tokens=False) == "Cl%10"
    # without a pattern every character is a token
    assert tokenizer_from_pickle_vocab(dump(tmp_path, ITOS)).encode("Clc") == [5, 0, 4]


def test_wrapping_and_specials_from_settings(tmp_path: Path) -> None:
    itos = ["[UNK]", "[BOS]", "[EOS]", "a", "b"]
    path = dump(tmp_path, itos)
    tok = load_tokenizer(
        "pickle_vocab",
        [path],
        overrides={"add_bos": True, "add_eos": True},
        pipeline=PipelineSpec(specials=Specials(unk="[UNK]", bos="[BOS]", eos=("[EOS]",))),
    )
    assert tok.encode("abz") == [1, 3, 4, 0, 2]
    assert tok.encode("ab", add_special_tokens=False) == [3, 4]
    assert tok.decode(tok.encode("ab")) == "ab"
    assert tok.pad_id is None


@pytest.mark.parametrize(
    "content, message",
    [
        (collections.defaultdict(int, {"a": 0}), "not a pickle of plain lists"),
        ("abc", "got str"),
        (["a", 1], "must hold token strings only"),
        (["<unk>", "a", "a"], "token 'a' is listed twice (ids 1, 2)"),
        ({"<unk>": 0, "a": 2}, "ids must be 0..1"),
        ({"<unk>": 0, "a": True}, "must map token strings to ids"),
        (
            {"itos": ["<unk>", "a"], "stoi": {"<unk>": 1, "a": 0}},
            "itos and stoi disagree on ['<unk>', 'a']",
        ),
        ([], "the vocabulary is empty"),
    ],
)
def test_malformed_vocab(tmp_path: Path, content: object, message: str) -> None:
    path = dump(tmp_path, content)
    with pytest.raises(TokenizerError, match="vocab.pkl") as e:
        tokenizer_from_pickle_vocab(path)
    assert message in str(e.value)


def test_vocab_without_unk_names_the_keys(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer.model.unk: the vocabulary has no <unk>"):
        tokenizer_from_pickle_vocab(dump(tmp_path, ["a", "b"]))
    tok = tokenizer_from_pickle_vocab(dump(tmp_path, ["a", "b"]), specials={"unk": "b"})
    assert tok.encode("az") == [0, 1]


def test_truncated_and_bad_settings(tmp_path: Path) -> None:
    path = dump(tmp_path, ITOS)
    cut = tmp_path / "cut.pkl"
    cut.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(TokenizerError, match="cut.pkl.*: not a pickle.*truncated"):
        tokenizer_from_pickle_vocab(cut)
    with pytest.raises(TokenizerError, match="not a valid regex"):
        tokenizer_from_pickle_vocab(path, "(")
    with pytest.raises(TokenizerError, match=r"unk: '<mask>' is not a token of the vocabulary"):
        tokenizer_from_pickle_vocab(path, specials={"unk": "<mask>"})
    with pytest.raises(TokenizerError, match="unknown special token role"):
        tokenizer_from_pickle_vocab(path, specials={"cls": "<sos>"})
    with pytest.raises(TokenizerError, match="takes one vocabulary file"):
        load_tokenizer("pickle_vocab", [path, path])


def _doc(tmp_path: Path, tokenizer: dict) -> dict:
    (tmp_path / "w.pt").write_bytes(b"")
    return {
        "name": "tiny",
        "source": {"format": "pickle", "files": [str(tmp_path / "w.pt")]},
        "tokenizer": tokenizer,
        "hparams": {"vocab_size": len(ITOS), "hidden": 8, "n_layers": 1, "n_heads": 2},
        "network": {
            "type": "decoder_only",
            "norm": "layer",
            "activation": "relu",
            "ffn": "plain",
            "residual": "pre_norm",
            "position": {"type": "learned"},
            "tensors": {},
        },
    }


def test_spec_keys(tmp_path: Path, write_spec) -> None:
    vocab = str(dump(tmp_path, ITOS))
    tok_doc = {
        "from": "pickle_vocab",
        "files": [vocab],
        "pattern": PATTERN,
        "specials": {"bos": "<sos>"},
        "add_bos": True,
        "add_eos": True,
    }
    spec = load_spec(write_spec(_doc(tmp_path, tok_doc)))
    assert spec.tokenizer.pattern == PATTERN
    assert spec.tokenizer.pipeline.specials == Specials(bos="<sos>")
    tok = tokenizer_for(spec)
    assert tok is not None and tok.encode("Cl1") == [2, 7, 6, 3]

    bad = _doc(tmp_path, {"from": "pickle_vocab", "files": [vocab], "specials": {"sep": "x"}})
    with pytest.raises(SpecError, match="tokenizer.specials: unknown key 'sep'"):
        load_spec(write_spec(bad))
    other = _doc(tmp_path, {"from": "vocab_txt", "files": [vocab], "pattern": "."})
    with pytest.raises(
        SpecError, match="pattern is read by from: pickle_vocab / tiktoken, not 'vocab_txt'"
    ):
        load_spec(write_spec(other))
