"""Tokenizers described as data (spec language 3): each model kind, component and vocabulary
source against an independent reference — the ``tokenizers`` library built by hand here, or
``tiktoken`` itself — on texts with case, accents, punctuation, digits, whitespace runs, emoji and
characters outside the vocabulary; decode round trips.
"""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import yaml
from tiktoken._educational import bpe_train
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from inferflow.errors import SpecError, TokenizerError
from inferflow.runtime import tokenizer_for
from inferflow.spec import load_spec
from inferflow.tokenizer import Tokenizer

TEXTS = [
    "Hello World, THE quick brown fox!",
    "Café naïve résumé — Ünïcode Straße",
    "digits 12345 and 3.14159, x=42",
    "spaces   and\ttabs\n\nnewlines  ",
    "emoji 🙂🚀 and 日本語 text",
    "unknown ☃ ⅶ 𝔘 characters",
    "",
]
CORPUS = "\n".join(TEXTS[:-1] * 3) + "\nthe cat sat on the mat. The dog ate 7 bones! Hello again."


def _spec(tmp_path: Path, tokenizer: dict[str, Any], config: dict[str, Any] | None = None) -> Path:
    (tmp_path / "w.pt").write_bytes(b"")
    source: dict[str, Any] = {"format": "pickle", "files": ["w.pt"]}
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        source["config"] = "config.json"
    doc = {
        "name": "tiny",
        "source": source,
        "tokenizer": tokenizer,
        "hparams": {"vocab_size": 8, "hidden": 8, "n_layers": 1, "n_heads": 2},
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
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    return path


def _ours(
    tmp_path: Path, tokenizer: dict[str, Any], config: dict[str, Any] | None = None
) -> Tokenizer:
    tok = tokenizer_for(load_spec(_spec(tmp_path, tokenizer, config)))
    assert tok is not None
    return tok


def _same(ours: Tokenizer, ref: Backend, texts: list[str] = TEXTS, round_trip: bool = True) -> None:
    for text in texts:
        want = ref.encode(text).ids
        assert ours.encode(text) == want, text
        assert ours.decode(want) == ref.decode(want), text
        if round_trip:
            assert ours.decode(ours.encode(text)) == ref.decode(want)
        dec = ours.incremental_decoder()
        assert "".join(dec.push(i) for i in want) + dec.flush() == ours.decode(want)


def _trained(model: Any, trainer: Any, pre: Any, norm: Any = None) -> Backend:
    ref = Backend(model)
    ref.normalizer = norm
    ref.pre_tokenizer = pre
    ref.train_from_iterator([CORPUS], trainer)
    return ref


def test_wordpiece_cased_regex_split(tmp_path: Path) -> None:
    """A case-kept WordPiece pre-split by a regex (a SMILES-style vocabulary) vs the library."""
    pattern = r"\[[^\]]+]|Br?|Cl?|\d|\s+|\w+|[^\w\s]"
    ref = _trained(
        models.WordPiece(unk_token="[UNK]"),
        trainers.WordPieceTrainer(
            vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
        ),
        pre_tokenizers.Split(Regex(pattern), "isolated"),
    )
    ref.decoder = decoders.WordPiece()
    vocab = sorted(ref.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    # a JSON list: whitespace runs are tokens here, which vocab.txt lines cannot hold
    (tmp_path / "vocab.json").write_text(json.dumps([t for t, _ in vocab]))
    ref.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    ours = _ours(
        tmp_path,
        {
            "pre_tokenizer": {"type": "split", "pattern": pattern},
            "model": {"type": "wordpiece", "vocab": {"file": "vocab.json"}},
            "specials": {"bos": "[CLS]", "eos": "[SEP]", "pad": "[PAD]"},
            "template": "[CLS] $A [SEP]",
            "decoder": {"type": "wordpiece"},
        },
    )
    _same(ours, ref, TEXTS + ["CCBr[NH4+]Cl.c1ccccc1", "HELLO hello"], round_trip=False)
    assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.add_bos, ours.add_eos) == (
        2,
        [3],
        0,
        True,
        True,
    )


def test_vocab_txt_preset_with_its_normalizer_replaced(tmp_path: Path) -> None:
    """from: vocab_txt is a preset: a spec's normalizer replaces the lower-casing one."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Hello", "hello", "World", "##s", "!"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    cased = _ours(
        tmp_path,
        {
            "from": "vocab_txt",
            "files": ["vocab.txt"],
            "normalizer": {"type": "bert", "lowercase": False},
        },
    )
    assert cased.encode("Hello Worlds!") == [2, 5, 7, 8, 9, 3]
    uncased = _ours(tmp_path, {"from": "vocab_txt", "files": ["vocab.txt"]})
    assert uncased.encode("Hello Worlds!") == [2, 6, 1, 9, 3]


def test_bpe_byte_level_from_json_and_merges(tmp_path: Path) -> None:
    ref = _trained(
        models.BPE(),
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    )
    ref.decoder = decoders.ByteLevel()
    state = json.loads(ref.to_str())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(state["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in state["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    ours = _ours(
        tmp_path,
        {
            "pre_tokenizer": {"type": "byte_level"},
            "model": {
                "type": "bpe",
                "vocab": {"file": "vocab.json"},
                "merges": {"file": "merges.txt"},
            },
            "specials": {"eos": "<|endoftext|>"},
            "decoder": {"type": "byte_level"},
        },
    )
    _same(ours, ref)
    assert ours.piece_style == "byte_level" and ours.eos_ids == [0]


def test_unigram_metaspace_from_pairs(tmp_path: Path) -> None:
    norm = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    ref = _trained(
        models.Unigram(),
        trainers.UnigramTrainer(
            vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"
        ),
        pre_tokenizers.Metaspace(),
        norm,
    )
    ref.decoder = decoders.Metaspace()
    pieces = json.loads(ref.to_str())["model"]["vocab"]
    (tmp_path / "pieces.json").write_text(json.dumps(pieces))
    ours = _ours(
        tmp_path,
        {
            "normalizer": [{"type": "unicode", "form": "NFKC"}, {"type": "lowercase"}],
            "pre_tokenizer": {"type": "metaspace"},
            "model": {"type": "unigram", "vocab": {"file": "pieces.json"}, "unk": "<unk>"},
            "decoder": {"type": "metaspace"},
        },
    )
    _same(ours, ref, round_trip=False)  # lower-casing is not undone
    assert (ours.unk_id, ours.bos_id, ours.eos_ids) == (0, 1, [2])


def test_wordlevel_per_character_from_config_python_and_pickle(tmp_path: Path) -> None:
    """A character vocabulary from config.json, a .py literal or a pickle, per-character split,
    tokens joined without a separator."""
    chars = ["<pad>", "<unk>", "<bos>", "<eos>", " ", *"abcdefghijklmnopqrstuvwxyz.,!"]
    ref = Backend(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    ref.normalizer = normalizers.Lowercase()
    ref.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    ref.decoder = decoders.Fuse()
    ref.add_special_tokens(["<pad>", "<unk>", "<bos>", "<eos>"])
    ref.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 3)]
    )
    (tmp_path / "vocab_module.py").write_text(
        "import os\nOTHER = os.getcwd()\nVOCAB: list = " + repr(chars) + "\n", encoding="utf-8"
    )
    (tmp_path / "vocab.pkl").write_bytes(pickle.dumps({"itos": chars, "freqs": {"a": 3}}))
    common = {
        "normalizer": {"type": "lowercase"},
        "pre_tokenizer": {"type": "chars"},
        "template": "<bos> $A <eos>",
        "decoder": {"type": "fuse"},
    }
    texts = ["Hello, World!", "a  b", "ünknown ☃", ""]
    sources = [
        ({"config": "vocab"}, {"vocab": chars}),
        ({"python": "vocab_module.py", "name": "VOCAB"}, None),
        ({"pickle": "vocab.pkl"}, None),
        ({"list": chars}, None),
    ]
    for source, config in sources:
        model = {"type": "wordlevel", "vocab": source, "unk": "<unk>"}
        ours = _ours(tmp_path, {**common, "model": model}, config)
        _same(ours, ref, texts, round_trip=False)
        assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.unk_id) == (2, [3], 0, 1), source
    # a config value that is one string: each character a token
    string = {"model": {"type": "wordlevel", "vocab": {"config": "chars"}, "unk": "?"}}
    ours = _ours(tmp_path, {**string, "pre_tokenizer": {"type": "chars"}}, {"chars": "?ab c"})
    assert ours.encode("ab cz") == [1, 2, 3, 4, 0]


def _encoding() -> tiktoken.Encoding:
    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ranks = bpe_train(CORPUS * 2, 320, pat, visualise=None)
    return tiktoken.Encoding(
        "tiny", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 320}
    )


def test_tiktoken_encoding_pickle_and_rank_file(tmp_path: Path) -> None:
    enc = _encoding()
    (tmp_path / "enc.pkl").write_bytes(pickle.dumps(enc))
    lines = [base64.b64encode(t).decode() + f" {r}" for t, r in enc._mergeable_ranks.items()]
    (tmp_path / "tiny.tiktoken").write_text("\n".join(lines) + "\n")
    # words that are not whole tokens: their pieces depend on the order of the merges
    words = CORPUS.split()
    scrambled = [
        " ".join(w[::-1] + words[(7 * i) % len(words)] for w in words[i : i + 8])
        for i in range(0, 120, 8)
    ]
    texts = TEXTS + scrambled + ["the cat's 1234567 mats'll", "  leading\n\n\n  trailing   "]
    from_pickle = _ours(tmp_path, {"from": "tiktoken", "files": ["enc.pkl"]})
    from_ranks = _ours(
        tmp_path, {"from": "tiktoken", "files": ["tiny.tiktoken"], "pattern": enc._pat_str}
    )
    for text in texts:
        want = enc.encode_ordinary(text)
        assert from_pickle.encode(text) == want, text
        assert from_ranks.encode(text) == want, text
        assert from_pickle.decode(want) == enc.decode(want) == text
    assert from_pickle.encode("a<|endoftext|>") == enc.encode(
        "a<|endoftext|>", allowed_special="all"
    )
    assert from_pickle.eos_ids == [320] and from_ranks.eos_ids == []
    with pytest.raises(TokenizerError, match="holds ranks only; give the encoding.s pat_str"):
        tokenizer_for(load_spec(_spec(tmp_path, {"from": "tiktoken", "files": ["tiny.tiktoken"]})))


def test_tokenizer_json_given_its_specials_and_template(tmp_path: Path) -> None:
    """A tokenizer.json without tokenizer_config.json: the spec names its bos/eos and wrapping."""
    ref = _trained(
        models.BPE(unk_token="<unk>"),
        trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]),
        pre_tokenizers.Whitespace(),
    )
    ref.save(str(tmp_path / "tokenizer.json"))
    ours = _ours(
        tmp_path,
        {
            "from": "tokenizer_json",
            "files": ["tokenizer.json"],
            "specials": {"bos": "<s>", "eos": "</s>"},
            "template": {"single": "<s> $A </s>", "pair": "<s> $A </s> $B:1 </s>:1"},
        },
    )
    assert ours.encode("the cat") == [1, *ref.encode("the cat").ids, 2]
    the, cat = len(ref.encode("the").ids), len(ref.encode("cat").ids)
    assert ours.encode_pair("the", "cat")[1] == [0] * (the + 2) + [1] * (cat + 1)
    assert (ours.bos_id, ours.eos_ids, ours.add_bos, ours.add_eos) == (1, [2], True, True)
    (tmp_path / "other").mkdir()
    ref.save(str(tmp_path / "other" / "tokenizer.json"))
    two = {"from": "tokenizer_json", "files": ["tokenizer.json", "other/tokenizer.json"]}
    with pytest.raises(TokenizerError, match="takes one tokenizer.json .* tokenizer: {source"):
        tokenizer_for(load_spec(_spec(tmp_path, two)))


@pytest.mark.parametrize(
    "tokenizer, message",
    [
        ({"files": ["v.txt"]}, r"tokenizer: give from: \(one of gguf, .*\) or model:"),
        (
            {
                "model": {"type": "wordlevel", "vocab": {"file": "v.txt"}},
                "normalizer": {"type": "upper"},
            },
            r"tokenizer.normalizer.*lowercase",
        ),
        (
            {"model": {"type": "sentencepiece", "vocab": {"file": "v.txt"}}},
            r"tokenizer.model.*wordlevel",
        ),
        (
            {"model": {"type": "wordlevel", "vocab": {"file": "nope.txt"}}},
            r"'nope.txt' resolves to .*does not exist",
        ),
        (
            {"model": {"type": "wordlevel", "vocab": {"file": "v.txt", "list": ["a"]}}},
            r"tokenizer.model.vocab: give exactly one source kind of config, file, list, pickle, python, tiktoken",
        ),
        (
            {"model": {"type": "wordlevel", "vocab": {"python": "v.py"}}},
            r"python source needs name",
        ),
        (
            {
                "from": "vocab_txt",
                "files": ["v.txt"],
                "model": {"type": "wordlevel", "vocab": {"file": "v.txt"}},
            },
            r"tokenizer.model: from: vocab_txt gives the model",
        ),
        (
            {"from": "vocab_txt", "files": ["v.txt"], "template": "[CLS] $A", "add_bos": True},
            r"template and add_bos / add_eos",
        ),
        ({"from": "none", "files": ["v.txt"]}, r"from: none takes no other keys; got \['files'\]"),
        (
            {"model": {"type": "wordlevel", "vocab": {"file": "v.txt"}}, "pattern": "."},
            r"tokenizer.pattern: without from:",
        ),
        (
            {"source": {"from": "none"}, "target": {"from": "none"}},
            r"tokenizer.source / tokenizer.target are an encoder_decoder's two sides; "
            r"network.type is 'decoder_only'",
        ),
    ],
)
def test_spec_refusals_name_the_key(
    tmp_path: Path, tokenizer: dict[str, Any], message: str
) -> None:
    (tmp_path / "v.txt").write_text("<unk>\na\n")
    (tmp_path / "v.py").write_text("V = ['a']\n")
    with pytest.raises(SpecError, match=message):
        load_spec(_spec(tmp_path, tokenizer))


@pytest.mark.parametrize(
    "tokenizer, message",
    [
        (
            {"model": {"type": "wordlevel", "vocab": {"python": "v.py", "name": "W"}}},
            r"tokenizer.model.vocab.*assigns no 'W' at its top level; it assigns \['V', 'X'\]",
        ),
        (
            {"model": {"type": "wordlevel", "vocab": {"python": "v.py", "name": "X"}}},
            r"X in .*v.py is not data",
        ),
        (
            {
                "model": {"type": "wordlevel", "vocab": {"file": "v.txt"}},
                "pre_tokenizer": {"type": "split", "pattern": "("},
            },
            r"tokenizer.pre_tokenizer\[0\].pattern: '\(' is not a valid regex",
        ),
        (
            {"model": {"type": "wordlevel", "vocab": {"file": "v.txt"}}, "template": "<s> $A"},
            r"tokenizer.template: '<s>' is not a token of the vocabulary",
        ),
        (
            {
                "model": {"type": "wordlevel", "vocab": {"file": "v.txt"}},
                "specials": {"eos": "</s>"},
            },
            r"tokenizer.specials.eos: '</s>' is not a token of the vocabulary",
        ),
        (
            {"model": {"type": "wordlevel", "vocab": {"config": "vocab"}}},
            r"config: needs source.config",
        ),
        (
            {"model": {"type": "wordlevel", "vocab": {"pickle": "evil.pkl"}}},
            r"evil.pkl.*not a pickle of plain .*refused global '\w+.system'",
        ),
        (
            {"model": {"type": "bpe", "vocab": {"file": "v.txt"}, "merges": {"list": ["a b"]}}},
            r"tokenizer.model.merges\[0\]: 'a' 'b' merges tokens outside the vocabulary",
        ),
    ],
)
def test_build_refusals_name_the_key(
    tmp_path: Path, tokenizer: dict[str, Any], message: str
) -> None:
    (tmp_path / "v.txt").write_text("<unk>\na\n")
    (tmp_path / "v.py").write_text("V = ['a']\nX = open('/etc/passwd').read()\n")

    class Evil:
        def __reduce__(self) -> Any:
            import os

            return (os.system, ("true",))

    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(Evil()))
    spec = load_spec(_spec(tmp_path, tokenizer))
    with pytest.raises(TokenizerError, match=message):
        tokenizer_for(spec)
