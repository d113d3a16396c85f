"""A tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries no ``tokenizer.json``: it stores tokens, scores, token types, merges and special ids
under llama.cpp's key names. We rebuild the ``tokenizers`` pipeline those describe, the same one
transformers builds for ``AutoTokenizer.from_pretrained(..., gguf_file=...)``, which our tests use
as the reference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inferflow.errors import TokenizerError
from inferflow.registry import Registry, RegistryError
from inferflow.tokenizer.base import BYTE_DECODER, BYTE_ENCODER, EOG_TOKEN_TEXTS, Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf-py ``TokenType``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> the regexes that split text before byte-level BPE, applied in order
# (llama.cpp llama-vocab.cpp ``regex_exprs``; each is a ``Split(..., "isolated")``).
BPE_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2_SPLIT,),
    # llama.cpp's 'default' is a catch-all for files converted without a known pre-tokenizer;
    # transformers treats it as GPT-2's, and so do we.
    "default": (_GPT2_SPLIT,),
    # starcoder family (SmolLM, StarCoder, Refact, CodeShell): digits one by one, then GPT-2
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "codeshell": (r"\p{N}", _GPT2_SPLIT),
    # llama 3 family
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "pixtral": (_LLAMA3_SPLIT,),
    # qwen 2 / 2.5 / 3 family
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "megrez": (_QWEN2_SPLIT,),
    # o200k family
    "gpt-4o": (_GPT4O_SPLIT,),
    "llama4": (_GPT4O_SPLIT,),
}


@dataclass(frozen=True)
class SentencePieceVariant:
    """How one architecture's sentencepiece-style GGUF vocabulary differs from Llama's."""

    # 'score': merges rank by the tokens' scores (Llama 2); 'position': by the tokens' order in the
    # file (Gemma, whose scores do not follow its merge order).
    merge_rank: str = "score"
    # Gemma stores tokens made only of spaces with real spaces ("  ") where the model looks them
    # up as "▁▁"; respell them so merges built from them match.
    respell_space_runs: bool = False


# ``general.architecture`` -> variant; anything else is plain Llama-style sentencepiece
# (as transformers' ``GGUF_SENTENCEPIECE_BUILDERS``).
SENTENCEPIECE_VARIANTS: dict[str, SentencePieceVariant] = {
    "gemma": SentencePieceVariant(merge_rank="position", respell_space_runs=True),
    "gemma2": SentencePieceVariant(merge_rank="position", respell_space_runs=True),
    "gemma3": SentencePieceVariant(merge_rank="position", respell_space_runs=True),
}


@dataclass(frozen=True)
class GgufVocab:
    """The ``tokenizer.ggml.*`` keys a builder needs, read and checked once."""

    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    metadata: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"tokenizer.ggml.{key}", default)

    def token_id(self, key: str) -> int | None:
        """A special id from the metadata, or None where absent or out of range (llama.cpp
        stores -1 / UINT32_MAX for 'none')."""
        value = self.get(key)
        if value is None:
            return None
        value = int(value)
        if not 0 <= value < len(self.tokens):
            logger.warning("tokenizer.ggml.%s = %d is outside the vocabulary; ignored", key, value)
            return None
        return value


@dataclass(frozen=True)
class GgufTokenizerModel:
    build: Callable[[GgufVocab], BackendTokenizer]
    add_bos_default: bool  # when the file has no tokenizer.ggml.add_bos_token
    piece_style: str


# ``tokenizer.ggml.model`` -> builder
GGUF_TOKENIZER_MODELS: Registry[GgufTokenizerModel] = Registry("GGUF tokenizer model")


def _byte_level_spelling(token: str) -> str:
    return "".join(BYTE_ENCODER[b] for b in token.encode("utf-8"))


def _add_special_tokens(backend: BackendTokenizer, vocab: GgufVocab, table: dict[str, int]) -> None:
    """Control and unknown tokens (``<|im_start|>``, ``<bos>``) become special added tokens and
    user-defined ones (``<think>``) plain added tokens, so text containing them maps to the one id
    instead of being cut into pieces (llama.cpp ``tokenizer_st_partition``; transformers does the
    same). Their text is matched as written, before normalization."""
    special, plain = [], []
    for i, (tok, ttype) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if ttype not in (CONTROL, UNKNOWN, USER_DEFINED) or table.get(tok) != i:
            continue  # a respelled token has no raw text to match
        if ttype == USER_DEFINED:
            plain.append(AddedToken(tok, special=False, normalized=False))
        else:
            special.append(AddedToken(tok, special=True, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _bpe(**kwargs: Any) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # tokenizers raises a bare Exception, e.g. a merge of unknown tokens
        raise TokenizerError(f"GGUF vocabulary does not form a BPE model: {e}") from e


def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        left, sep, right = str(m).partition(" ")
        if not sep:
            raise TokenizerError(f"malformed merge {m!r} in tokenizer.ggml.merges (expected 'a b')")
        out.append((left, right))
    return out


def build_byte_level_bpe(vocab: GgufVocab) -> BackendTokenizer:
    """GPT-2 style byte-level BPE: tokens are spelled in GPT-2's byte alphabet, merges given."""
    if vocab.merges is None:
        raise TokenizerError("GGUF tokenizer 'gpt2' needs tokenizer.ggml.merges, which is missing")
    pre = str(vocab.get("pre", "default"))
    if pre not in BPE_PRE_TOKENIZER_SPLITS:
        raise TokenizerError(
            f"unknown GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; "
            f"known: {', '.join(sorted(BPE_PRE_TOKENIZER_SPLITS))}"
        )
    table: dict[str, int] = {}
    for i, (tok, ttype) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        # Control and user-defined tokens keep their plain text (llama.cpp matches them as written);
        # a normal token outside the byte alphabet was stored decoded by the converter.
        if ttype not in (CONTROL, USER_DEFINED, UNKNOWN) and not all(
            c in BYTE_DECODER for c in tok
        ):
            tok = _byte_level_spelling(tok)
        table[tok] = i  # a repeated token keeps its last id, as transformers' dict does
    merges = _parse_merges(vocab.merges)
    backend = BackendTokenizer(
        _bpe(
            vocab=table,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    splits = [
        pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in BPE_PRE_TOKENIZER_SPLITS[pre]
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, vocab, table)
    return backend


def derive_merges(tokens: Sequence[str], rank: Sequence[float]) -> list[tuple[str, str]]:
    """Merges a sentencepiece BPE vocabulary implies: every split of a token into two tokens,
    best-ranked token first, then longer left part, then longer right part.

    This is the order transformers' ``generate_merges`` produces (ties keep file order), so the
    BPE we build picks the same pieces as the reference.
    """
    if len(rank) != len(tokens):
        raise TokenizerError(f"{len(rank)} merge ranks for {len(tokens)} tokens")
    index = set(tokens)
    # (token id, split point), best split of each token first; one comprehension, as this runs
    # ~2M membership tests for a 262k vocabulary
    found = [
        (i, k)
        for i, tok in enumerate(tokens)
        for k in range(len(tok) - 1, 0, -1)
        if tok[:k] in index and tok[k:] in index
    ]
    # Already in order when ranks strictly decrease (Gemma's positions); otherwise a stable sort,
    # where equal keys keep token order as in the reference.
    if any(a <= b for a, b in pairwise(rank)):
        found.sort(key=lambda e: (-rank[e[0]], -e[1], e[1] - len(tokens[e[0]])))
    return [(tokens[i][:k], tokens[i][k:]) for i, k in found]


def build_sentencepiece_bpe(vocab: GgufVocab) -> BackendTokenizer:
    """SentencePiece BPE (Llama, Gemma): '▁' for spaces, ``<0xXX>`` byte-fallback tokens."""
    arch = str(vocab.metadata.get("general.architecture", ""))
    variant = SENTENCEPIECE_VARIANTS.get(arch, SentencePieceVariant())
    tokens = vocab.tokens
    if variant.respell_space_runs:
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    if vocab.merges is not None:
        merges = _parse_merges(vocab.merges)
    elif variant.merge_rank == "position":
        merges = derive_merges(tokens, [-float(i) for i in range(len(tokens))])
    else:
        if vocab.scores is None:
            raise TokenizerError(
                "GGUF tokenizer 'llama' needs tokenizer.ggml.scores, which is missing"
            )
        merges = derive_merges(tokens, vocab.scores)
    unk_id = vocab.token_id("unknown_token_id")
    table = {tok: i for i, tok in enumerate(tokens)}
    backend = BackendTokenizer(
        _bpe(
            vocab=table,
            merges=merges,
            unk_token=None if unk_id is None else tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp's default. As llama.cpp (and Llama 2's own tokenizer.json) do, a '▁' goes before
    # every piece of text, the first and each after a special or user-defined token, also where
    # the text begins with a space (transformers' GGUF reader prepends once, and only where the
    # text does not begin with one).
    add_space_prefix = bool(vocab.get("add_space_prefix", True))
    space = normalizers.Replace(" ", "▁")
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), space]) if add_space_prefix else space
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_special_tokens(backend, vocab, table)
    return backend


GGUF_TOKENIZER_MODELS.add(
    "gpt2",
    GgufTokenizerModel(build=build_byte_level_bpe, add_bos_default=False, piece_style="byte_level"),
)
# llama.cpp and transformers both add BOS to a sentencepiece vocabulary that does not say
GGUF_TOKENIZER_MODELS.add(
    "llama",
    GgufTokenizerModel(
        build=build_sentencepiece_bpe, add_bos_default=True, piece_style="sentencepiece"
    ),
)


def _as_list(metadata: dict[str, Any], key: str) -> list[Any] | None:
    value = metadata.get(key)
    return None if value is None else list(value)


def read_gguf_vocab(metadata: dict[str, Any]) -> GgufVocab:
    tokens = _as_list(metadata, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(
            "GGUF metadata has no tokenizer.ggml.tokens: the file carries no vocabulary"
        )
    types = _as_list(metadata, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    scores = _as_list(metadata, "tokenizer.ggml.scores")
    for key, arr in (("token_type", types), ("scores", scores)):
        if arr is not None and len(arr) != len(tokens):
            raise TokenizerError(
                f"tokenizer.ggml.{key} has {len(arr)} entries for {len(tokens)} tokens"
            )
    return GgufVocab(
        tokens=[str(t) for t in tokens],
        token_types=[int(t) for t in types],
        scores=None if scores is None else [float(s) for s in scores],
        merges=_as_list(metadata, "tokenizer.ggml.merges"),
        metadata=metadata,
    )


def eog_ids(vocab: GgufVocab, backend: BackendTokenizer) -> list[int]:
    """eos, then eot/eom, then every token llama.cpp treats as end-of-generation by its text."""
    ids = [vocab.token_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    ids += [backend.token_to_id(text) for text in EOG_TOKEN_TEXTS]
    return [i for i in dict.fromkeys(ids) if i is not None]


def tokenizer_from_gguf_metadata(metadata: dict[str, Any]) -> Tokenizer:
    """Build the tokenizer a GGUF's metadata describes (``tokenizer.ggml.model`` picks the kind)."""
    start = time.perf_counter()
    model_name = metadata.get("tokenizer.ggml.model")
    if model_name is None:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.model")
    try:
        model = GGUF_TOKENIZER_MODELS.get(str(model_name))
    except RegistryError as e:
        raise TokenizerError(f"tokenizer.ggml.model: {e}") from None
    vocab = read_gguf_vocab(metadata)
    backend = model.build(vocab)
    template = metadata.get("tokenizer.chat_template")
    tok = Tokenizer(
        backend,
        bos_id=vocab.token_id("bos_token_id"),
        eos_ids=eog_ids(vocab, backend),
        pad_id=vocab.token_id("padding_token_id"),
        unk_id=vocab.token_id("unknown_token_id"),
        add_bos=bool(vocab.get("add_bos_token", model.add_bos_default)),
        add_eos=bool(vocab.get("add_eos_token", False)),
        chat_template=None if template is None else str(template),
        piece_style=model.piece_style,
    )
    logger.info(
        "GGUF tokenizer %r (%d tokens) built in %.2fs",
        model_name,
        len(vocab.tokens),
        time.perf_counter() - start,
    )
    return tok
