"""A word-level vocabulary from a pickled token list / dict (torchtext-style ``itos`` / ``stoi``),
with text split into tokens by one regular expression: the kind ``pickle_vocab``.

Small seq2seq checkpoints (SMILES, character-level models) ship their vocabulary this way. The
file goes through our own pickle interpreter with no globals allowed (``loads_plain``), never
``pickle.load``. Accepted contents: a list of token strings (id = index); a dict token -> id; or a
dict with ``itos`` and/or ``stoi`` entries of those shapes (other entries, e.g. ``freqs``, are
ignored). Ids must be 0..n-1, each token once.

Encoding: the text is cut into the pattern's matches, left to right (the Oniguruma dialect of
``tokenizer.json``'s Split patterns); text between matches becomes one piece of its own, so end
the pattern with a catch-all such as ``[\\s\\S]`` to make every other character a token. A piece
that is not in the vocabulary is the unk token. Decoding concatenates the tokens with no separator,
dropping the special ones (bos, eos, pad, unk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inferflow.errors import CheckpointError, TokenizerError
from inferflow.loaders.pickle_vm import loads_plain
from inferflow.tokenizer.base import Tokenizer
from inferflow.tokenizer.files import TOKENIZER_KINDS

# every character its own token (newlines too, which '.' would not match)
DEFAULT_PATTERN = r"[\s\S]"

# role -> spellings looked for in the vocabulary when the spec names none (torchtext, fairseq, HF)
SPECIAL_ROLES: dict[str, tuple[str, ...]] = {
    "bos": ("<sos>", "<bos>", "<s>"),
    "eos": ("<eos>", "</s>"),
    "pad": ("<pad>",),
    "unk": ("<unk>",),
}

MAX_VOCAB_FILE_BYTES = 1 << 28  # a vocabulary is kilobytes to megabytes; refuse to read a bomb


def _token_list(obj: Any, path: Path, what: str) -> list[str]:
    if not isinstance(obj, list) or not all(isinstance(t, str) for t in obj):
        raise TokenizerError(f"{path}: {what} must be a list of token strings")
    seen: dict[str, int] = {}
    for i, t in enumerate(obj):
        if t in seen:
            raise TokenizerError(f"{path}: {what} lists token {t!r} twice (ids {seen[t]} and {i})")
        seen[t] = i
    return list(obj)


def _from_stoi(obj: Any, path: Path, what: str) -> list[str]:
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in obj.items()
    ):
        raise TokenizerError(f"{path}: {what} must map token strings to integer ids")
    itos: list[str | None] = [None] * len(obj)
    for tok, i in obj.items():
        if not 0 <= i < len(obj):
            raise TokenizerError(
                f"{path}: {what} gives {tok!r} id {i}; ids must be 0..{len(obj) - 1}"
            )
        if itos[i] is not None:
            raise TokenizerError(f"{path}: {what} gives id {i} to both {itos[i]!r} and {tok!r}")
        itos[i] = tok
    return [t for t in itos if t is not None]  # all filled: n distinct ids in 0..n-1


def read_pickle_vocab(path: str | Path) -> list[str]:
    """The id -> token list of a pickled vocabulary file (see the module docstring)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_VOCAB_FILE_BYTES:
            raise TokenizerError(f"{path}: {size} bytes is too large for a vocabulary file")
        obj = loads_plain(path.read_bytes())
    except OSError as e:
        raise TokenizerError(f"cannot read vocabulary {path}: {e.strerror}") from None
    except CheckpointError as e:  # malformed stream or a global (class instance) inside
        raise TokenizerError(
            f"{path}: not a pickle of plain lists / dicts / strings / ints: {e}"
        ) from None
    if isinstance(obj, list):
        return _token_list(obj, path, "the vocabulary")
    if isinstance(obj, dict) and ("itos" in obj or "stoi" in obj):
        itos = _token_list(obj["itos"], path, "itos") if "itos" in obj else None
        from_stoi = _from_stoi(obj["stoi"], path, "stoi") if "stoi" in obj else None
        if itos is not None and from_stoi is not None and itos != from_stoi:
            bad = next(
                (i for i, (a, b) in enumerate(zip(itos, from_stoi, strict=False)) if a != b),
                min(len(itos), len(from_stoi)),
            )
            raise TokenizerError(f"{path}: itos and stoi disagree from id {bad} on")
        return itos if itos is not None else from_stoi or []
    if isinstance(obj, dict):
        return _from_stoi(obj, path, "the vocabulary")
    raise TokenizerError(
        f"{path}: expected a token list, a token -> id dict or a dict with itos / stoi; "
        f"got {type(obj).__name__}"
    )


def _special_ids(
    vocab: dict[str, int], specials: Mapping[str, str], path: Path
) -> dict[str, int | None]:
    unknown = sorted(set(specials) - set(SPECIAL_ROLES))
    if unknown:
        raise TokenizerError(
            f"unknown special token role(s) {unknown}; allowed: {', '.join(SPECIAL_ROLES)}"
        )
    out: dict[str, int | None] = {}
    for role, spellings in SPECIAL_ROLES.items():
        if role in specials:
            text = specials[role]
            if text not in vocab:
                raise TokenizerError(f"tokenizer.specials.{role}: {text!r} is not in {path}")
            out[role] = vocab[text]
        else:
            out[role] = next((vocab[t] for t in spellings if t in vocab), None)
    return out


def tokenizer_from_pickle_vocab(
    path: str | Path, pattern: str | None = None, specials: Mapping[str, str] | None = None
) -> Tokenizer:
    """A word-level tokenizer over a pickled vocabulary; ``specials`` maps roles (bos, eos, pad,
    unk) to token texts, otherwise the usual spellings (``<sos>``, ``<eos>``...) are looked up."""
    path = Path(path)
    itos = read_pickle_vocab(path)
    if not itos:
        raise TokenizerError(f"{path}: the vocabulary is empty")
    vocab = {t: i for i, t in enumerate(itos)}
    ids = _special_ids(vocab, specials or {}, path)
    unk = ids["unk"]
    if unk is None:
        raise TokenizerError(
            f"{path}: no unk token ({', '.join(SPECIAL_ROLES['unk'])}) to stand for text outside "
            "the vocabulary; name one with tokenizer.specials.unk"
        )
    try:
        split = pre_tokenizers.Split(Regex(pattern or DEFAULT_PATTERN), behavior="isolated")
    except Exception as e:  # tokenizers raises a bare Exception on a bad regex
        raise TokenizerError(f"tokenizer.pattern {pattern!r} is not a valid regex: {e}") from None
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token=itos[unk]))
    backend.pre_tokenizer = split
    backend.decoder = decoders.Fuse()  # no separator between tokens
    special_texts = sorted({itos[i] for i in ids.values() if i is not None}, key=vocab.__getitem__)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_texts]
    )
    eos = ids["eos"]
    return Tokenizer(
        backend,
        bos_id=ids["bos"],
        eos_ids=[] if eos is None else [eos],
        pad_id=ids["pad"],
        unk_id=unk,
    )


@TOKENIZER_KINDS.register("pickle_vocab")
def _load_pickle_vocab(files: Sequence[Path], metadata: dict[str, Any] | None) -> Tokenizer:
    # metadata: the spec's tokenizer settings, ``pattern`` and ``specials``
    if len(files) != 1:
        raise TokenizerError(
            f"tokenizer kind 'pickle_vocab' takes one vocabulary file, got {len(files)}"
        )
    settings = metadata or {}
    return tokenizer_from_pickle_vocab(files[0], settings.get("pattern"), settings.get("specials"))
