"""Tokenizers from files (``tokenizer.json``, ``vocab.txt``, GGUF) and the ``load_tokenizer`` entry
point a model spec uses: ``kind`` names an entry of ``TOKENIZER_KINDS``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inferflow.errors import TokenizerError
from inferflow.paths import read_json
from inferflow.registry import Registry, RegistryError
from inferflow.tokenizer.base import EOG_TOKEN_TEXTS, Tokenizer

logger = logging.getLogger(__name__)

# (files, metadata) -> Tokenizer; metadata is the GGUF key/values for 'gguf', optional settings
# (``do_lower_case``) for 'vocab_txt'.
TokenizerLoader = Callable[[Sequence[Path], dict[str, Any] | None], Tokenizer]
TOKENIZER_KINDS: Registry[TokenizerLoader] = Registry("tokenizer kind")

# override key -> what it sets (checked strictly: the spec's YAML is the user interface)
OVERRIDE_KEYS = {
    "chat_template": "jinja2 chat template source",
    "add_bos": "prepend bos when encoding with special tokens",
    "add_eos": "append eos when encoding with special tokens",
    "bos": "bos token text",
    "eos": "eos token text, or a list of texts (the first is the eos appended by add_eos)",
}

# BERT's special tokens in the order transformers' BertTokenizer names them
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


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


def _piece_style(backend: BackendTokenizer) -> str:
    """Which spelling the vocabulary uses, read off the decoder the json configures."""
    if backend.decoder is None:
        return "plain"
    state = json.loads(backend.decoder.__getstate__())
    kinds = {state["type"], *(d.get("type") for d in state.get("decoders", []))}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    if "WordPiece" in kinds:
        return "wordpiece"
    return "plain"


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
        probe = list(backend.encode("", add_special_tokens=True).ids)
        add_bos = bos_id is not None and probe[:1] == [bos_id]
        add_eos = eos_id is not None and len(probe) > int(add_bos) and probe[-1] == eos_id
    return Tokenizer(
        backend,
        bos_id=bos_id,
        eos_ids=[i for i in eos_ids if i is not None],
        pad_id=token_id("pad_token"),
        unk_id=token_id("unk_token"),
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=template,
        piece_style=_piece_style(backend),
        keep_post_processor=not explicit,
    )


def tokenizer_from_vocab_txt(path: str | Path, lowercase: bool = True) -> Tokenizer:
    """BERT WordPiece from a ``vocab.txt`` (one token a line, id = line number):
    ``[CLS] text [SEP]``, the pipeline transformers' ``BertTokenizer`` builds."""
    path = _existing(path, "vocab.txt")
    # read as transformers' ``load_vocab`` does: universal newlines, a repeated token keeps its
    # last line number
    with path.open(encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]") if t not in vocab]
    if missing:
        raise TokenizerError(f"{path} lacks the BERT special tokens {missing}")
    backend = BackendTokenizer(
        models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100)
    )
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in _BERT_SPECIALS if t in vocab]
    )
    # [CLS] and [SEP] play the parts of bos and eos in the template
    return Tokenizer(
        backend,
        bos_id=vocab["[CLS]"],
        eos_ids=[vocab["[SEP]"]],
        pad_id=vocab.get("[PAD]"),
        unk_id=vocab["[UNK]"],
        add_bos=True,
        add_eos=True,
        piece_style="wordpiece",
    )


@TOKENIZER_KINDS.register("gguf")
def _load_gguf(files: Sequence[Path], metadata: dict[str, Any] | None) -> Tokenizer:
    if metadata is None:
        if not files:
            raise TokenizerError("tokenizer kind 'gguf' needs the GGUF file or its metadata")
        path = _existing(files[0], "GGUF file")
        try:
            from inferflow.loaders.gguf import read_gguf_metadata
        except ImportError as e:
            raise TokenizerError(f"no GGUF reader available to read {path}: {e}") from e
        metadata = read_gguf_metadata(path)
    return Tokenizer.from_gguf_metadata(metadata)


@TOKENIZER_KINDS.register("tokenizer_json")
def _load_tokenizer_json(files: Sequence[Path], metadata: dict[str, Any] | None) -> Tokenizer:
    by_name = {Path(f).name: Path(f) for f in files}
    config_path = by_name.pop("tokenizer_config.json", None)
    main = by_name.get("tokenizer.json") or next(iter(by_name.values()), None)
    if main is None:
        raise TokenizerError("tokenizer kind 'tokenizer_json' needs a tokenizer.json in its files")
    config = None
    if config_path is not None:
        config = _read_config(_existing(config_path, "tokenizer_config.json"))
    return tokenizer_from_json(main, config)


@TOKENIZER_KINDS.register("vocab_txt")
def _load_vocab_txt(files: Sequence[Path], metadata: dict[str, Any] | None) -> Tokenizer:
    if not files:
        raise TokenizerError("tokenizer kind 'vocab_txt' needs a vocab.txt in its files")
    lowercase = bool((metadata or {}).get("do_lower_case", True))
    return tokenizer_from_vocab_txt(files[0], lowercase=lowercase)


def apply_overrides(tok: Tokenizer, overrides: dict[str, Any]) -> Tokenizer:
    """Set what a spec overrides on a freshly built tokenizer (in place; returned for chaining)."""
    unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
    if unknown:
        raise TokenizerError(
            f"unknown tokenizer override(s) {unknown}; allowed: {', '.join(OVERRIDE_KEYS)}"
        )

    def lookup(key: str, text: Any) -> int:
        tid = tok.backend.token_to_id(str(text))
        if tid is None:
            raise TokenizerError(
                f"tokenizer override {key}={text!r} is not a token of this vocabulary"
            )
        return int(tid)

    if "chat_template" in overrides:
        tok.chat_template = overrides["chat_template"]
    if "bos" in overrides:
        tok.bos_id = lookup("bos", overrides["bos"])
    if "eos" in overrides:
        texts = overrides["eos"]
        texts = [texts] if isinstance(texts, str) else list(texts)
        tok.eos_ids = [lookup("eos", t) for t in texts]
    # setting either flag rebuilds the post-processor with the (possibly new) bos/eos
    if "bos" in overrides or "eos" in overrides or "add_bos" in overrides or "add_eos" in overrides:
        tok.add_eos = bool(overrides.get("add_eos", tok.add_eos))
        tok.add_bos = bool(overrides.get("add_bos", tok.add_bos))
    return tok


def load_tokenizer(
    kind: str,
    files: Sequence[str | Path],
    metadata: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Tokenizer:
    """Build the tokenizer a spec names: ``kind`` is one of ``TOKENIZER_KINDS``."""
    try:
        loader = TOKENIZER_KINDS.get(kind)
    except RegistryError as e:
        raise TokenizerError(str(e)) from None
    paths = [Path(f) for f in files]
    for p in paths:
        _existing(p, "tokenizer file")
    tok = loader(paths, metadata)
    return apply_overrides(tok, overrides) if overrides else tok


def _read_config(path: Path) -> Any:
    """A tokenizer_config.json (size-capped, parsed)."""
    try:
        return read_json(path)
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
