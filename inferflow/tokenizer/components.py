"""A tokenizer's components as spec data: normalizers, pre-tokenizers, models and decoders, each a
registered name with a typed options class, built from the ``tokenizers`` library's own parts.

    @NORMALIZERS.register("lowercase")  ->  Component(NoOptions, lambda o: normalizers.Lowercase())

The spec's schema, parsing and errors come from these registries (``inferflow.tokenizer.pipeline``
puts the parts together).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from inferflow.blocks.options import NoOptions, Options
from inferflow.errors import TokenizerError
from inferflow.registry import Registry
from inferflow.tokenizer.base import BYTE_ENCODER
from inferflow.tokenizer.sources import (
    SourceContext,
    VocabSource,
    as_merges,
    as_pieces,
    as_ranks,
    as_token_ids,
    read_source,
    source_schema,
)

B = TypeVar("B")


@dataclass(frozen=True)
class Component(Generic[B]):
    """A registered component: its options class and how to build it from them."""

    options: type[Options]
    build: Callable[..., B]


NORMALIZERS: Registry[Component[Any]] = Registry("tokenizer normalizer")
PRE_TOKENIZERS: Registry[Component[Any]] = Registry("tokenizer pre-tokenizer")
MODELS: Registry[Component[Any]] = Registry("tokenizer model")
DECODERS: Registry[Component[Any]] = Registry("tokenizer decoder")


def _register(registry: Registry[Component[Any]], name: str, options: type[Options]) -> Any:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        registry.add(name, Component(options, fn))
        return fn

    return deco


def regex(pattern: str, where: str) -> Regex:
    try:
        return Regex(pattern)
    except Exception as e:  # tokenizers raises a bare Exception on a bad pattern
        raise TokenizerError(f"{where}: {pattern!r} is not a valid regex: {e}") from None


def _doc(text: str, **more: Any) -> dict[str, Any]:
    return {"doc": text, **more}


Behavior = Literal["isolated", "removed", "merged_with_previous", "merged_with_next", "contiguous"]
PrependScheme = Literal["always", "first", "never"]

# -- normalizers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnicodeOptions(Options):
    form: Literal["NFC", "NFD", "NFKC", "NFKD"] = field(
        default="NFC", metadata=_doc("Unicode normalization form")
    )


@dataclass(frozen=True)
class ReplaceOptions(Options):
    pattern: str = field(default="", metadata=_doc("text (or regex, with regex: true) to replace"))
    content: str = field(default="", metadata=_doc("what replaces it"))
    regex: bool = field(default=False, metadata=_doc("pattern is an Oniguruma regex"))


@dataclass(frozen=True)
class BertNormOptions(Options):
    lowercase: bool = field(default=True, metadata=_doc("lower-case the text"))
    strip_accents: bool | None = field(
        default=None, metadata=_doc("drop accents; null: when lower-casing (BERT's rule)")
    )
    clean_text: bool = field(default=True, metadata=_doc("drop control characters"))
    chinese_chars: bool = field(default=True, metadata=_doc("space out CJK characters"))


@dataclass(frozen=True)
class StripOptions(Options):
    left: bool = field(default=True, metadata=_doc("strip leading whitespace"))
    right: bool = field(default=True, metadata=_doc("strip trailing whitespace"))


@dataclass(frozen=True)
class PrependOptions(Options):
    text: str = field(default="▁", metadata=_doc("text put before the input"))


@_register(NORMALIZERS, "lowercase", NoOptions)
def _lowercase(o: NoOptions, where: str) -> Any:
    return normalizers.Lowercase()


@_register(NORMALIZERS, "unicode", UnicodeOptions)
def _unicode(o: UnicodeOptions, where: str) -> Any:
    return getattr(normalizers, o.form)()


@_register(NORMALIZERS, "strip_accents", NoOptions)
def _strip_accents(o: NoOptions, where: str) -> Any:
    # accents are combining marks only after NFD, as BERT's normalizer does it
    return normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])


@_register(NORMALIZERS, "replace", ReplaceOptions)
def _replace(o: ReplaceOptions, where: str) -> Any:
    return normalizers.Replace(regex(o.pattern, where) if o.regex else o.pattern, o.content)


@_register(NORMALIZERS, "bert", BertNormOptions)
def _bert_norm(o: BertNormOptions, where: str) -> Any:
    return normalizers.BertNormalizer(
        clean_text=o.clean_text,
        handle_chinese_chars=o.chinese_chars,
        strip_accents=o.strip_accents,
        lowercase=o.lowercase,
    )


@_register(NORMALIZERS, "strip", StripOptions)
def _strip(o: StripOptions, where: str) -> Any:
    return normalizers.Strip(left=o.left, right=o.right)


@_register(NORMALIZERS, "prepend", PrependOptions)
def _prepend(o: PrependOptions, where: str) -> Any:
    return normalizers.Prepend(o.text)


# -- pre-tokenizers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitOptions(Options):
    pattern: str = field(default="", metadata=_doc("Oniguruma regex (tokenizer.json's dialect)"))
    behavior: Behavior = field(
        default="isolated", metadata=_doc("what becomes of each match (tokenizers' SplitBehavior)")
    )
    invert: bool = field(default=False, metadata=_doc("split on what does not match"))


@dataclass(frozen=True)
class ByteLevelOptions(Options):
    add_prefix_space: bool = field(default=False, metadata=_doc("a space before the first word"))
    use_regex: bool = field(default=True, metadata=_doc("GPT-2's word-splitting regex first"))


@dataclass(frozen=True)
class MetaspaceOptions(Options):
    replacement: str = field(default="▁", metadata=_doc("the character that stands for a space"))
    prepend_scheme: PrependScheme = field(
        default="always", metadata=_doc("when the first word gets one")
    )
    split: bool = field(default=True, metadata=_doc("split on the replacement"))


@dataclass(frozen=True)
class DigitsOptions(Options):
    individual: bool = field(default=False, metadata=_doc("each digit its own piece"))


@dataclass(frozen=True)
class PunctuationOptions(Options):
    behavior: Behavior = field(default="isolated", metadata=_doc("what becomes of punctuation"))


@_register(PRE_TOKENIZERS, "split", SplitOptions)
def _split(o: SplitOptions, where: str) -> Any:
    if not o.pattern:
        raise TokenizerError(f"{where}.pattern: a split needs a pattern")
    return pre_tokenizers.Split(regex(o.pattern, where + ".pattern"), o.behavior, invert=o.invert)


@_register(PRE_TOKENIZERS, "chars", NoOptions)
def _chars(o: NoOptions, where: str) -> Any:
    # every character a piece, newlines included (which '.' would not match)
    return pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")


@_register(PRE_TOKENIZERS, "whitespace", NoOptions)
def _whitespace(o: NoOptions, where: str) -> Any:
    return pre_tokenizers.Whitespace()  # \w+|[^\w\s]+


@_register(PRE_TOKENIZERS, "whitespace_split", NoOptions)
def _whitespace_split(o: NoOptions, where: str) -> Any:
    return pre_tokenizers.WhitespaceSplit()


@_register(PRE_TOKENIZERS, "bert", NoOptions)
def _bert_pre(o: NoOptions, where: str) -> Any:
    return pre_tokenizers.BertPreTokenizer()


@_register(PRE_TOKENIZERS, "byte_level", ByteLevelOptions)
def _byte_level(o: ByteLevelOptions, where: str) -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=o.add_prefix_space, use_regex=o.use_regex)


@_register(PRE_TOKENIZERS, "metaspace", MetaspaceOptions)
def _metaspace(o: MetaspaceOptions, where: str) -> Any:
    return pre_tokenizers.Metaspace(o.replacement, o.prepend_scheme, o.split)


@_register(PRE_TOKENIZERS, "digits", DigitsOptions)
def _digits(o: DigitsOptions, where: str) -> Any:
    return pre_tokenizers.Digits(individual_digits=o.individual)


@_register(PRE_TOKENIZERS, "punctuation", PunctuationOptions)
def _punctuation(o: PunctuationOptions, where: str) -> Any:
    return pre_tokenizers.Punctuation(o.behavior)


# -- decoders ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WordPieceDecOptions(Options):
    prefix: str = field(default="##", metadata=_doc("the continuation prefix to drop"))
    cleanup: bool = field(default=True, metadata=_doc("no space before punctuation"))


@dataclass(frozen=True)
class BpeDecOptions(Options):
    suffix: str = field(default="</w>", metadata=_doc("the end-of-word suffix"))


@dataclass(frozen=True)
class StripDecOptions(Options):
    content: str = field(default=" ", metadata=_doc("the character to strip"))
    left: int = field(default=0, metadata=_doc("how many to strip at the start"))
    right: int = field(default=0, metadata=_doc("how many to strip at the end"))


@dataclass(frozen=True)
class ReplaceDecOptions(Options):
    pattern: str = field(default="", metadata=_doc("text to replace"))
    content: str = field(default="", metadata=_doc("what replaces it"))


@_register(DECODERS, "wordpiece", WordPieceDecOptions)
def _wordpiece_dec(o: WordPieceDecOptions, where: str) -> Any:
    return decoders.WordPiece(prefix=o.prefix, cleanup=o.cleanup)


@_register(DECODERS, "byte_level", NoOptions)
def _byte_level_dec(o: NoOptions, where: str) -> Any:
    return decoders.ByteLevel()


@_register(DECODERS, "metaspace", MetaspaceOptions)
def _metaspace_dec(o: MetaspaceOptions, where: str) -> Any:
    return decoders.Metaspace(o.replacement, o.prepend_scheme, o.split)


@_register(DECODERS, "fuse", NoOptions)
def _fuse(o: NoOptions, where: str) -> Any:
    return decoders.Fuse()  # tokens joined with no separator


@_register(DECODERS, "bpe", BpeDecOptions)
def _bpe_dec(o: BpeDecOptions, where: str) -> Any:
    return decoders.BPEDecoder(suffix=o.suffix)


@_register(DECODERS, "byte_fallback", NoOptions)
def _byte_fallback(o: NoOptions, where: str) -> Any:
    return decoders.ByteFallback()


@_register(DECODERS, "strip", StripDecOptions)
def _strip_dec(o: StripDecOptions, where: str) -> Any:
    return decoders.Strip(o.content, o.left, o.right)


@_register(DECODERS, "replace", ReplaceDecOptions)
def _replace_dec(o: ReplaceDecOptions, where: str) -> Any:
    return decoders.Replace(o.pattern, o.content)


# -- models -----------------------------------------------------------------------------------


def _source(doc: str) -> dict[str, Any]:
    return {"doc": doc, "schema": source_schema}


@dataclass(frozen=True)
class WordLevelOptions(Options):
    vocab: Any = field(default=None, metadata=_source("the vocabulary (tokens or token -> id)"))
    unk: str | None = field(
        default=None, metadata=_doc("the token for text outside the vocabulary")
    )


@dataclass(frozen=True)
class WordPieceOptions(Options):
    vocab: Any = field(default=None, metadata=_source("the vocabulary (tokens or token -> id)"))
    unk: str = field(default="[UNK]", metadata=_doc("the token for a word it cannot spell"))
    prefix: str = field(default="##", metadata=_doc("the prefix of a word's continuation pieces"))
    max_chars: int = field(default=100, metadata=_doc("longer words are unk"))


@dataclass(frozen=True)
class BpeOptions(Options):
    vocab: Any = field(default=None, metadata=_source("token -> id (with merges)"))
    merges: Any = field(default=None, metadata=_source("the merges, highest priority first"))
    ranks: Any = field(
        default=None, metadata=_source("tiktoken's byte ranks, instead of vocab and merges")
    )
    unk: str | None = field(default=None, metadata=_doc("the token for unknown characters"))
    byte_fallback: bool = field(default=False, metadata=_doc("unknown bytes as <0xNN> tokens"))
    continuing_prefix: str | None = field(default=None, metadata=_doc("prefix of inner pieces"))
    end_of_word_suffix: str | None = field(default=None, metadata=_doc("suffix of final pieces"))
    ignore_merges: bool | None = field(
        default=None, metadata=_doc("a word in the vocabulary is one token; null: with ranks")
    )


@dataclass(frozen=True)
class UnigramOptions(Options):
    vocab: Any = field(default=None, metadata=_source("[piece, log-probability] pairs"))
    unk: str | None = field(default=None, metadata=_doc("the unknown piece"))
    byte_fallback: bool = field(default=False, metadata=_doc("unknown bytes as <0xNN> pieces"))


# which options fields of a model hold vocabulary sources
SOURCE_FIELDS = ("vocab", "merges", "ranks")


@dataclass(frozen=True)
class BuiltModel:
    model: Any  # a tokenizers.models.Model
    vocab: dict[str, int]  # token text -> id


def _need(src: VocabSource | None, where: str) -> VocabSource:
    if src is None:
        raise TokenizerError(f"{where}: missing (a vocabulary source)")
    return src


def _unk(vocab: dict[str, int], unk: str | None, where: str, required: bool) -> str | None:
    if unk is None:
        unk = next((t for t in ("<unk>", "[UNK]", "<UNK>") if t in vocab), None)
        if unk is None and required:
            raise TokenizerError(
                f"{where}.unk: the vocabulary has no <unk> / [UNK]; name the token that stands "
                "for text outside it"
            )
    elif unk not in vocab:
        raise TokenizerError(f"{where}.unk: {unk!r} is not a token of the vocabulary")
    return unk


@_register(MODELS, "wordlevel", WordLevelOptions)
def _wordlevel(o: WordLevelOptions, where: str, ctx: SourceContext) -> BuiltModel:
    vocab = as_token_ids(read_source(_need(o.vocab, where + ".vocab"), ctx), where + ".vocab")
    unk = _unk(vocab, o.unk, where, required=True)
    return BuiltModel(models.WordLevel(vocab, unk_token=unk), vocab)


@_register(MODELS, "wordpiece", WordPieceOptions)
def _wordpiece(o: WordPieceOptions, where: str, ctx: SourceContext) -> BuiltModel:
    # a repeated token keeps its last id, as transformers' ``load_vocab`` reads vocab.txt
    raw = read_source(_need(o.vocab, where + ".vocab"), ctx)
    vocab = as_token_ids(raw, where + ".vocab", last_wins=True)
    unk = _unk(vocab, o.unk, where, required=True)
    model = models.WordPiece(
        vocab,
        unk_token=unk,
        continuing_subword_prefix=o.prefix,
        max_input_chars_per_word=o.max_chars,
    )
    return BuiltModel(model, vocab)


def ranks_to_bpe(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken's byte ranks as a byte-level BPE: tokens spelled with GPT-2's byte alphabet, and
    a merge for each way a token splits into two tokens, ordered by the merged token's rank (the
    pair tiktoken merges first is the one whose merged token has the lowest rank)."""

    def spell(b: bytes) -> str:
        return "".join(BYTE_ENCODER[x] for x in b)

    vocab = {spell(b): r for b, r in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for b, r in ranks.items():
        for cut in range(1, len(b)):
            left, right = ranks.get(b[:cut]), ranks.get(b[cut:])
            if left is not None and right is not None:
                merges.append((r, left, right, spell(b[:cut]), spell(b[cut:])))
    merges.sort()
    return vocab, [(a, b) for *_, a, b in merges]


@_register(MODELS, "bpe", BpeOptions)
def _bpe(o: BpeOptions, where: str, ctx: SourceContext) -> BuiltModel:
    if o.ranks is not None:
        if o.vocab is not None or o.merges is not None:
            raise TokenizerError(f"{where}: give ranks, or vocab with merges; not both")
        vocab, merges = ranks_to_bpe(as_ranks(read_source(o.ranks, ctx), where + ".ranks"))
    else:
        vocab = as_token_ids(read_source(_need(o.vocab, where + ".vocab"), ctx), where + ".vocab")
        merges = as_merges(read_source(_need(o.merges, where + ".merges"), ctx), where + ".merges")
        for i, (a, b) in enumerate(merges):
            if a not in vocab or b not in vocab or a + b not in vocab:
                raise TokenizerError(
                    f"{where}.merges[{i}]: {a!r} {b!r} merges tokens outside the vocabulary"
                )
    unk = _unk(vocab, o.unk, where, required=False) if o.unk is not None else None
    affixes = {
        k: v
        for k, v in (
            ("continuing_subword_prefix", o.continuing_prefix),
            ("end_of_word_suffix", o.end_of_word_suffix),
        )
        if v is not None
    }
    # tiktoken takes a piece found whole in its ranks as one token before any merge
    ignore = o.ranks is not None if o.ignore_merges is None else o.ignore_merges
    model = models.BPE(
        vocab,
        merges,
        unk_token=unk,
        byte_fallback=o.byte_fallback,
        ignore_merges=ignore,
        **affixes,
    )
    return BuiltModel(model, vocab)


@_register(MODELS, "unigram", UnigramOptions)
def _unigram(o: UnigramOptions, where: str, ctx: SourceContext) -> BuiltModel:
    pieces = as_pieces(read_source(_need(o.vocab, where + ".vocab"), ctx), where + ".vocab")
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    unk = _unk(vocab, o.unk, where, required=False)
    model = models.Unigram(
        pieces, unk_id=None if unk is None else vocab[unk], byte_fallback=o.byte_fallback
    )
    return BuiltModel(model, vocab)
