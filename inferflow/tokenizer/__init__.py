"""Tokenizers: text <-> token ids, streaming detokenization and chat templates.

``load_tokenizer(kind, files, metadata, overrides)`` builds one for a model spec; ``kind`` is
``'gguf'`` (vocabulary in the GGUF metadata), ``'tokenizer_json'`` (HF ``tokenizer.json``),
``'vocab_txt'`` (BERT WordPiece) or ``'pickle_vocab'`` (a pickled token list / dict, text split by
a regex: SMILES and character-level models).
"""

from __future__ import annotations

from inferflow.tokenizer.base import IncrementalDecoder, Tokenizer
from inferflow.tokenizer.chat import render_chat_template
from inferflow.tokenizer.files import (
    OVERRIDE_KEYS,
    TOKENIZER_KINDS,
    apply_overrides,
    load_tokenizer,
    tokenizer_from_json,
    tokenizer_from_vocab_txt,
)
from inferflow.tokenizer.gguf_vocab import (
    BPE_PRE_TOKENIZER_SPLITS,
    GGUF_TOKENIZER_MODELS,
    tokenizer_from_gguf_metadata,
)
from inferflow.tokenizer.pickle_vocab import read_pickle_vocab, tokenizer_from_pickle_vocab

__all__ = [
    "BPE_PRE_TOKENIZER_SPLITS",
    "GGUF_TOKENIZER_MODELS",
    "OVERRIDE_KEYS",
    "TOKENIZER_KINDS",
    "IncrementalDecoder",
    "Tokenizer",
    "apply_overrides",
    "load_tokenizer",
    "read_pickle_vocab",
    "render_chat_template",
    "tokenizer_from_gguf_metadata",
    "tokenizer_from_json",
    "tokenizer_from_pickle_vocab",
    "tokenizer_from_vocab_txt",
]
