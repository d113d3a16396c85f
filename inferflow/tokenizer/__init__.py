"""Tokenizers: text <-> token ids, streaming detokenization and chat templates.

A spec's ``tokenizer`` section is a pipeline of components held as data
(``inferflow.tokenizer.pipeline``: normalizer, pre-tokenizer, model, template, decoder, special
tokens; vocabularies from ``inferflow.tokenizer.sources``). ``from:`` names a file kind whose file
holds the whole pipeline (``gguf``, ``tokenizer_json``, ``tiktoken``) or a preset over a
vocabulary file (``vocab_txt``: BERT WordPiece; ``pickle_vocab``: a pickled token list split by a
regex); ``load_tokenizer`` builds it.
"""

from __future__ import annotations

# importing the kinds' modules registers them
from inferflow.tokenizer import files as _files  # noqa: F401
from inferflow.tokenizer import pickle_vocab as _pickle_vocab  # noqa: F401
from inferflow.tokenizer import tiktoken_file as _tiktoken_file  # noqa: F401
from inferflow.tokenizer.base import IncrementalDecoder, Tokenizer
from inferflow.tokenizer.chat import render_chat_template
from inferflow.tokenizer.files import tokenizer_from_json
from inferflow.tokenizer.gguf_vocab import (
    BPE_PRE_TOKENIZER_SPLITS,
    GGUF_TOKENIZER_MODELS,
    tokenizer_from_gguf_metadata,
)
from inferflow.tokenizer.kinds import (
    OVERRIDE_KEYS,
    TOKENIZER_KINDS,
    apply_overrides,
    load_tokenizer,
)
from inferflow.tokenizer.pickle_vocab import read_pickle_vocab, tokenizer_from_pickle_vocab
from inferflow.tokenizer.pipeline import PipelineSpec, Specials, Template, parse_pipeline

__all__ = [
    "BPE_PRE_TOKENIZER_SPLITS",
    "GGUF_TOKENIZER_MODELS",
    "OVERRIDE_KEYS",
    "TOKENIZER_KINDS",
    "IncrementalDecoder",
    "PipelineSpec",
    "Specials",
    "Template",
    "Tokenizer",
    "apply_overrides",
    "load_tokenizer",
    "parse_pipeline",
    "read_pickle_vocab",
    "render_chat_template",
    "tokenizer_from_gguf_metadata",
    "tokenizer_from_json",
    "tokenizer_from_pickle_vocab",
]
