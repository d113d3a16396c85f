"""tiktoken's encodings as a tokenizer kind: ``from: tiktoken`` with a ``.tiktoken`` rank file (and
``pattern:``, the encoding's ``pat_str``) or a pickled ``tiktoken.Encoding`` (pattern, ranks and
special tokens inside; read by our own pickle machine as data, never instantiated).

The ranks become a byte-level BPE whose merges are ordered by the merged token's rank, with
whole pieces found in the ranks taken as one token first, which is how tiktoken encodes; the
special tokens keep their own ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from inferflow.errors import TokenizerError
from inferflow.tokenizer.base import EOG_TOKEN_TEXTS, Tokenizer
from inferflow.tokenizer.components import ranks_to_bpe, regex
from inferflow.tokenizer.kinds import KindSettings, register_kind
from inferflow.tokenizer.sources import VocabSource, as_ranks, read_source

ENCODING_KEYS = ("pat_str", "mergeable_ranks", "special_tokens")


@register_kind("tiktoken", takes_pattern=True)
def _tiktoken(files: Sequence[Path], settings: KindSettings) -> Tokenizer:
    if len(files) != 1:
        raise TokenizerError(f"tokenizer kind 'tiktoken' takes one file, got {len(files)}")
    path = files[0]
    where = "tokenizer.files[0]"
    if path.suffix == ".tiktoken":
        ranks = as_ranks(
            read_source(VocabSource("tiktoken", path, where=where), settings.sources), where
        )
        pattern, specials = settings.pattern, {}
        if pattern is None:
            raise TokenizerError(
                f"tokenizer.pattern: {path.name} holds ranks only; give the encoding's pat_str"
            )
    else:
        state = read_source(VocabSource("pickle", path, where=where), settings.sources)
        if isinstance(state, str):
            raise TokenizerError(
                f"{path}: a tiktoken encoding pickled by its registered name {state!r} only; "
                "its ranks are not in the file"
            )
        if not isinstance(state, dict) or any(k not in state for k in ENCODING_KEYS):
            raise TokenizerError(
                f"{path}: expected a pickled tiktoken.Encoding (with {', '.join(ENCODING_KEYS)})"
            )
        ranks = as_ranks(state["mergeable_ranks"], f"{path}: mergeable_ranks")
        pattern = settings.pattern or state["pat_str"]
        specials = state["special_tokens"]
        if not isinstance(specials, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in specials.items()
        ):
            raise TokenizerError(f"{path}: special_tokens must map texts to ids")
    vocab, merges = ranks_to_bpe(ranks)
    taken = {v: k for k, v in vocab.items()}
    for text, tid in specials.items():
        if tid in taken:
            raise TokenizerError(
                f"{path}: special token {text!r} reuses id {tid} of {taken[tid]!r}"
            )
        vocab[text] = tid
    backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(regex(str(pattern), "tokenizer.pattern"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tok = Tokenizer(backend, piece_style="byte_level", keep_post_processor=True)
    eos = [specials[t] for t in EOG_TOKEN_TEXTS if t in specials]
    tok.set_specials(list(specials), bos_id=None, eos_ids=eos, pad_id=None, unk_id=None)
    tok.set_template("$A", "$A $B:1", [])
    return tok
