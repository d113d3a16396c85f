"""A word-level vocabulary from a pickled token list / dict (torchtext-style ``itos`` / ``stoi``),
with text split into tokens by one regular expression: the preset ``pickle_vocab`` (a word-level
model, a split pre-tokenizer, a joining decoder; a spec may replace any of these parts).

Small seq2seq checkpoints (SMILES, character-level models) ship their vocabulary this way. The
file goes through our own pickle interpreter with no globals allowed (``loads_records``), never
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

from inferflow.blocks.options import NoOptions
from inferflow.errors import TokenizerError
from inferflow.tokenizer.base import Tokenizer
from inferflow.tokenizer.components import SplitOptions, WordLevelOptions
from inferflow.tokenizer.kinds import KindSettings, load_tokenizer, register_kind
from inferflow.tokenizer.pipeline import SPECIAL_ROLES, PipelineSpec, Specials, Step
from inferflow.tokenizer.sources import SourceContext, VocabSource, as_token_ids, read_source

# every character its own token (newlines too, which '.' would not match)
DEFAULT_PATTERN = r"[\s\S]"


def read_pickle_vocab(path: str | Path) -> list[str]:
    """The id -> token list of a pickled vocabulary file (see the module docstring)."""
    path = Path(path)
    where = str(path)
    src = VocabSource("pickle", path, where=where)
    vocab = as_token_ids(read_source(src, SourceContext()), where)
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise TokenizerError(f"{path}: ids must be 0..{len(vocab) - 1}, each once")
    return sorted(vocab, key=vocab.__getitem__)


@register_kind("pickle_vocab", preset=True, takes_pattern=True)
def _pickle_vocab(files: Sequence[Path], settings: KindSettings) -> PipelineSpec:
    if len(files) != 1:
        raise TokenizerError(
            f"tokenizer kind 'pickle_vocab' takes one vocabulary file, got {len(files)}"
        )
    itos = read_pickle_vocab(files[0])  # checked here: the preset says ids are 0..n-1
    if not itos:
        raise TokenizerError(f"{files[0]}: the vocabulary is empty")
    return PipelineSpec(
        normalizers=(),
        pre_tokenizers=(Step("split", SplitOptions(pattern=settings.pattern or DEFAULT_PATTERN)),),
        model=Step(
            "wordlevel", WordLevelOptions(vocab=VocabSource("list", itos, where=str(files[0])))
        ),
        decoders=(Step("fuse", NoOptions()),),  # no separator between tokens
    )


def tokenizer_from_pickle_vocab(
    path: str | Path, pattern: str | None = None, specials: Mapping[str, Any] | None = None
) -> Tokenizer:
    """A word-level tokenizer over a pickled vocabulary; ``specials`` maps roles (bos, eos, pad,
    unk) to token texts, otherwise the usual spellings (``<sos>``, ``<eos>``...) are looked up."""
    unknown = sorted(set(specials or {}) - set(SPECIAL_ROLES))
    if unknown:
        raise TokenizerError(
            f"unknown special token role(s) {unknown}; allowed: {', '.join(SPECIAL_ROLES)}"
        )
    given = dict(specials or {})
    if isinstance(given.get("eos"), str):
        given["eos"] = (given["eos"],)
    parts = PipelineSpec(specials=Specials(**given)) if given else None
    return load_tokenizer("pickle_vocab", [path], pattern=pattern, pipeline=parts)
