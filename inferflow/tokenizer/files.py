"""The kinds ``tokenizer.from`` names for HF and GGUF files: ``tokenizer.json`` and GGUF metadata
(the file holds the pipeline), and the ``vocab_txt`` preset (BERT's WordPiece over a vocab.txt).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from inferflow.blocks.options import NoOptions
from inferflow.errors import TokenizerError
from inferflow.paths import read_json
from inferflow.tokenizer.base import EOG_TOKEN_TEXTS, Tokenizer, piece_style_of, wrapping_of
from inferflow.tokenizer.components import (
    BertNormOptions,
    WordPieceDecOptions,
    WordPieceOptions,
)
from inferflow.tokenizer.gguf_vocab import tokenizer_from_gguf_metadata
from inferflow.tokenizer.kinds import KindSettings, register_kind
from inferflow.tokenizer.pipeline import PipelineSpec, Specials, Step, Template
from inferflow.tokenizer.sources import VocabSource, read_source

logger = logging.getLogger(__name__)


def _existing(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"{what} not found: {p}")
    return p


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise TokenizerError(f"cannot read a special token from {value!r}")


def _pick_chat_template(value: Any) -> str | None:
    """A string, or transformers' list of named templates (the 'default' one is for chat)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return str(named["default"])
        raise TokenizerError(
            f"chat_template lists named templates {sorted(map(str, named))} but no 'default'"
        )
    raise TokenizerError(f"chat_template must be a string or a list, got {type(value).__name__}")


def tokenizer_from_json(
    path: str | Path, tokenizer_config: dict[str, Any] | None = None
) -> Tokenizer:
    """A HF ``tokenizer.json``, with bos/eos/chat template from ``tokenizer_config`` (read from
    ``tokenizer_config.json`` beside it when not given) and ``chat_template.jinja`` if present."""
    path = _existing(path, "tokenizer.json")
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed json
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if tokenizer_config is None:
        cfg_path = path.parent / "tokenizer_config.json"
        tokenizer_config = _read_config(cfg_path) if cfg_path.is_file() else {}
    cfg = tokenizer_config
    template = _pick_chat_template(cfg.get("chat_template"))
    jinja_path = path.parent / "chat_template.jinja"
    if template is None and jinja_path.is_file():
        template = jinja_path.read_text("utf-8")

    def token_id(key: str) -> int | None:
        text = _token_text(cfg.get(key))
        if text is None:
            return None
        tid = backend.token_to_id(text)
        if tid is None:
            logger.warning(
                "%s %r from tokenizer_config is not in the vocabulary; ignored", key, text
            )
        return tid

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    eos_ids = [eos_id] + [backend.token_to_id(t) for t in EOG_TOKEN_TEXTS if t in specials]
    explicit = "add_bos_token" in cfg or "add_eos_token" in cfg
    if explicit:  # transformers rebuilds the post-processor from these flags when they are given
        add_bos, add_eos = bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token"))
    else:  # the json's post-processor decides; read the flags off what it does to empty text
        add_bos, add_eos = wrapping_of(backend, bos_id, eos_id)
    return Tokenizer(
        backend,
        bos_id=bos_id,
        eos_ids=[i for i in eos_ids if i is not None],
        pad_id=token_id("pad_token"),
        unk_id=token_id("unk_token"),
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=template,
        piece_style=piece_style_of(backend),
        keep_post_processor=not explicit,
    )


@register_kind("gguf")
def _load_gguf(files: Sequence[Path], settings: KindSettings) -> Tokenizer:
    metadata = settings.metadata
    if metadata is None:
        if not files:
            raise TokenizerError("tokenizer kind 'gguf' needs the GGUF file or its metadata")
        path = _existing(files[0], "GGUF file")
        try:
            from inferflow.loaders.gguf import read_gguf_metadata
        except ImportError as e:
            raise TokenizerError(f"no GGUF reader available to read {path}: {e}") from e
        metadata = read_gguf_metadata(path)
    return tokenizer_from_gguf_metadata(metadata)


@register_kind("tokenizer_json")
def _load_tokenizer_json(files: Sequence[Path], settings: KindSettings) -> Tokenizer:
    configs = [Path(f) for f in files if Path(f).name == "tokenizer_config.json"]
    mains = [Path(f) for f in files if Path(f).name != "tokenizer_config.json"]
    if len(mains) != 1 or len(configs) > 1:
        raise TokenizerError(
            "tokenizer kind 'tokenizer_json' takes one tokenizer.json (and at most one "
            f"tokenizer_config.json), got {[str(f) for f in files]}; an encoder-decoder whose "
            "sides differ: tokenizer: {source: ..., target: ...}"
        )
    main, config_path = mains[0], (configs[0] if configs else None)
    config = None
    if config_path is not None:
        config = _read_config(_existing(config_path, "tokenizer_config.json"))
    return tokenizer_from_json(main, config)


@register_kind("vocab_txt", preset=True)
def _vocab_txt(files: Sequence[Path], settings: KindSettings) -> PipelineSpec:
    """BERT WordPiece over a ``vocab.txt`` (one token a line, id = line number): the pipeline
    transformers' ``BertTokenizer`` builds, ``[CLS] text [SEP]``; lower-cased unless a
    ``tokenizer_config.json`` beside it says ``do_lower_case: false`` (or the spec's normalizer
    says otherwise)."""
    if len(files) != 1:
        raise TokenizerError(f"tokenizer kind 'vocab_txt' takes one vocab.txt, got {len(files)}")
    path = files[0]
    cfg_path = path.parent / "tokenizer_config.json"
    cfg = _read_config(cfg_path) if cfg_path.is_file() else {}
    vocab = VocabSource("file", path, where="tokenizer.files[0]")
    have = set(read_source(vocab, settings.sources))
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]") if t not in have]
    if missing:
        raise TokenizerError(f"{path} lacks the BERT special tokens {missing}")
    return PipelineSpec(
        normalizers=(
            Step("bert", BertNormOptions(lowercase=bool(cfg.get("do_lower_case", True)))),
        ),
        pre_tokenizers=(Step("bert", NoOptions()),),
        model=Step("wordpiece", WordPieceOptions(vocab=vocab)),
        decoders=(Step("wordpiece", WordPieceDecOptions()),),
        # [CLS] and [SEP] play the parts of bos and eos in the template
        specials=Specials(
            bos="[CLS]",
            eos=("[SEP]",),
            pad="[PAD]" if "[PAD]" in have else None,
            unk="[UNK]",
            extra=tuple(t for t in ("[MASK]",) if t in have),
        ),
        template=Template("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    )


def _read_config(path: Path) -> Any:
    """A tokenizer_config.json (size-capped, parsed)."""
    try:
        return read_json(path)
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
