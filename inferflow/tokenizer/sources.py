"""Where a tokenizer's vocabulary (or merges, or ranks) comes from: one entry of ``VOCAB_SOURCES``.

A spec names a source as a one-key mapping, optionally with ``key`` (a dotted path into the
object read) or ``name`` (the variable of a ``.py`` file)::

    vocab: {file: vocab.txt}                     # lines (id = line number) or a .json list / dict
    vocab: {list: ["<pad>", "a", "b"]}           # inline
    vocab: {config: vocab}                       # a key of the checkpoint's config.json
    vocab: {python: tokens.py, name: VOCAB}      # a literal assigned in a .py file, never run
    vocab: {pickle: vocab.pkl, key: itos}        # through our own pickle machine
    ranks: {tiktoken: cl100k.tiktoken}           # tiktoken's base64-token rank lines

Readers return plain Python data; what shape a model needs (token -> id, pieces with scores,
byte ranks, merges) is checked by the ``as_*`` functions here, each error naming the spec path.
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferflow.errors import CheckpointError, TokenizerError
from inferflow.registry import Registry

MAX_SOURCE_BYTES = 1 << 28  # a vocabulary is kilobytes to megabytes; refuse to read a bomb


@dataclass(frozen=True)
class VocabSource:
    """One vocabulary source of a spec: ``kind`` names a ``VOCAB_SOURCES`` entry; ``ref`` is its
    value (a resolved path, a config key, an inline list)."""

    kind: str
    ref: Any
    key: str | None = None  # a dotted path into what was read
    name: str | None = None  # python: the variable assigned
    where: str = "tokenizer"  # the spec path, for errors


@dataclass(frozen=True)
class SourceContext:
    """What a source may read besides its own file: the checkpoint's config.json."""

    config: Path | None = None


Reader = Callable[[VocabSource, SourceContext], Any]
VOCAB_SOURCES: Registry[Reader] = Registry("vocabulary source")
PATH_KINDS = ("file", "python", "pickle", "tiktoken")  # sources whose value is a file path


def source_schema() -> dict[str, Any]:
    """JSON Schema of a source: one of the registered kinds, with ``key`` / ``name``."""
    kinds = VOCAB_SOURCES.names()
    return {
        "type": "object",
        "properties": {
            **{k: {"type": "array"} if k == "list" else {"type": "string"} for k in kinds},
            "key": {"type": "string"},
            "name": {"type": "string"},
        },
        "additionalProperties": False,
        "minProperties": 1,
    }


def parse_source(
    doc: Mapping[str, Any], where: str, resolve: Callable[[str], Path] | None = None
) -> VocabSource:
    """A schema-checked source mapping; ``resolve`` turns file references into paths."""
    kinds = [k for k in doc if k in VOCAB_SOURCES]
    if len(kinds) != 1:
        raise TokenizerError(
            f"{where}: give exactly one source kind of {', '.join(VOCAB_SOURCES.names())}; "
            f"got {kinds or 'none'}"
        )
    kind = kinds[0]
    ref = doc[kind]
    if kind == "python" and "name" not in doc:
        raise TokenizerError(f"{where}: a python source needs name: (the variable assigned)")
    if kind in PATH_KINDS and resolve is not None:
        ref = resolve(str(ref))
    return VocabSource(kind, ref, doc.get("key"), doc.get("name"), where)


def read_source(src: VocabSource, ctx: SourceContext) -> Any:
    obj = VOCAB_SOURCES.get(src.kind)(src, ctx)
    for part in src.key.split(".") if src.key else ():
        if not isinstance(obj, Mapping) or part not in obj:
            have = sorted(map(str, obj))[:20] if isinstance(obj, Mapping) else type(obj).__name__
            raise TokenizerError(f"{src.where}: key {src.key!r}: no {part!r} in {have}")
        obj = obj[part]
    return obj


def _at(src: VocabSource, path: Path) -> str:
    """The spec path of a source, naming its file unless the spec path already does."""
    return src.where if str(path) in src.where else f"{src.where} ({path})"


def _bytes(path: Path, where: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_SOURCE_BYTES:
            raise TokenizerError(f"{where}: {path} has {size} bytes, too large for a vocabulary")
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{where}: cannot read {path}: {e.strerror}") from None


def _text(path: Path, where: str) -> str:
    try:
        return _bytes(path, where).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{where}: {path} is not UTF-8 text: {e}") from None


@VOCAB_SOURCES.register("file")
def _file(src: VocabSource, ctx: SourceContext) -> Any:
    """A .json file (a list or a dict), else text lines (``\\n``-separated, as transformers'
    ``load_vocab`` reads vocab.txt)."""
    path = Path(src.ref)
    text = _text(path, src.where)
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except ValueError as e:
            raise TokenizerError(f"{src.where}: {path} is not valid JSON: {e}") from None
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


@VOCAB_SOURCES.register("list")
def _inline(src: VocabSource, ctx: SourceContext) -> Any:
    return list(src.ref)


@VOCAB_SOURCES.register("config")
def _config(src: VocabSource, ctx: SourceContext) -> Any:
    if ctx.config is None:
        raise TokenizerError(f"{src.where}: config: needs source.config (the model's config.json)")
    try:
        doc = json.loads(_text(ctx.config, src.where))
    except ValueError as e:
        raise TokenizerError(f"{src.where}: {ctx.config} is not valid JSON: {e}") from None
    out = doc
    for part in str(src.ref).split("."):
        if not isinstance(out, dict) or part not in out:
            raise TokenizerError(f"{src.where}: {ctx.config} has no key {src.ref!r}")
        out = out[part]
    # a character vocabulary spelled as one string: each character a token
    return list(out) if isinstance(out, str) else out


@VOCAB_SOURCES.register("python")
def _python(src: VocabSource, ctx: SourceContext) -> Any:
    """The value assigned to ``name`` at a module's top level. The file is parsed, never run:
    a value is a literal (``ast.literal_eval``), a name assigned such a value earlier, or a
    ``+`` of those (``tokens = specials + ['a', 'b']``)."""
    path = Path(src.ref)
    try:
        tree = ast.parse(_text(path, src.where), str(path))
    except SyntaxError as e:
        raise TokenizerError(f"{src.where}: {path} is not Python: {e}") from None
    known: dict[str, Any] = {}  # names bound to values read so far
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            names.append(t.id)
            folded = _fold(value, known)
            if folded is not _NOT_DATA:
                known[t.id] = folded
            elif t.id == src.name:
                raise TokenizerError(
                    f"{src.where}: {src.name} in {path} is not data (read: literals, names "
                    "assigned literals before, and + of them)"
                )
            else:
                known.pop(t.id, None)
    if src.name in known:
        return known[src.name]
    raise TokenizerError(
        f"{src.where}: {path} assigns no {src.name!r} at its top level; it assigns {names[:20]}"
    )


_NOT_DATA = object()


def _fold(node: ast.expr, known: dict[str, Any]) -> Any:
    """A literal, a known name, or a + of those; ``_NOT_DATA`` for anything else."""
    if isinstance(node, ast.Name):
        return known.get(node.id, _NOT_DATA)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _fold(node.left, known), _fold(node.right, known)
        if left is _NOT_DATA or right is _NOT_DATA:
            return _NOT_DATA
        same = type(left) is type(right) and isinstance(left, list | tuple | str)
        return left + right if same else _NOT_DATA
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_DATA


@VOCAB_SOURCES.register("pickle")
def _pickle(src: VocabSource, ctx: SourceContext) -> Any:
    """Plain lists / dicts / strings / numbers, or a ``tiktoken.Encoding`` (read as its state:
    name, pat_str, mergeable_ranks, special_tokens); nothing is imported or called."""
    from inferflow.loaders.pickle_vm import loads_records

    path = Path(src.ref)
    try:
        return loads_records(_bytes(path, src.where), RECORD_CLASSES)
    except CheckpointError as e:  # malformed, or a class outside RECORD_CLASSES
        raise TokenizerError(
            f"{_at(src, path)}: not a pickle of plain lists / dicts / strings / numbers: {e}"
        ) from None


# classes a vocabulary pickle may hold, read as their pickled state (never instantiated)
RECORD_CLASSES = frozenset({("tiktoken.core", "Encoding")})


@VOCAB_SOURCES.register("tiktoken")
def _tiktoken(src: VocabSource, ctx: SourceContext) -> Any:
    """tiktoken's BPE file: ``base64(token) rank`` per line."""
    path = Path(src.ref)
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(_text(path, src.where).splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected two fields")
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(
                f"{src.where}: {path} line {n} is not 'base64-token rank': {e}"
            ) from None
    return ranks


# -- shapes a model needs --------------------------------------------------------------------


def as_token_ids(obj: Any, where: str, last_wins: bool = False) -> dict[str, int]:
    """token -> id from a token list (id = index), a token -> id dict, or a dict with
    ``itos`` / ``stoi`` (torchtext); ids must be distinct, and a list names each token once
    unless ``last_wins`` (a repeated token keeps its last index)."""
    if isinstance(obj, Mapping) and ("itos" in obj or "stoi" in obj):
        itos = as_token_ids(obj["itos"], where + ".itos") if "itos" in obj else None
        stoi = as_token_ids(obj["stoi"], where + ".stoi") if "stoi" in obj else None
        if itos is not None and stoi is not None and itos != stoi:
            bad = sorted(t for t in set(itos) | set(stoi) if itos.get(t) != stoi.get(t))
            raise TokenizerError(f"{where}: itos and stoi disagree on {bad[:5]}")
        return itos if itos is not None else stoi or {}
    if isinstance(obj, list):
        if not all(isinstance(t, str) for t in obj):
            raise TokenizerError(f"{where}: a vocabulary list must hold token strings only")
        seen: dict[str, int] = {}
        for i, t in enumerate(obj):
            if t in seen and not last_wins:
                raise TokenizerError(f"{where}: token {t!r} is listed twice (ids {seen[t]}, {i})")
            seen[t] = i
        return seen
    if isinstance(obj, Mapping):
        if not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in obj.items()):
            raise TokenizerError(f"{where}: a vocabulary dict must map token strings to ids >= 0")
        by_id: dict[int, str] = {}
        for t, i in obj.items():
            if i in by_id:
                raise TokenizerError(f"{where}: id {i} is given to both {by_id[i]!r} and {t!r}")
            by_id[i] = t
        return dict(obj)
    raise TokenizerError(
        f"{where}: expected a token list or a token -> id dict, got {type(obj).__name__}"
    )


def as_pieces(obj: Any, where: str) -> list[tuple[str, float]]:
    """Unigram pieces with log-probabilities: ``[[piece, score], ...]`` or ``piece<TAB>score``
    lines (sentencepiece's .vocab)."""
    out: list[tuple[str, float]] = []
    for i, item in enumerate(obj if isinstance(obj, list) else ()):
        if isinstance(item, str) and "\t" in item:
            piece, _, score = item.rpartition("\t")
            item = [piece, score]
        try:
            piece, score = item
            out.append((str(piece), float(score)))
        except (TypeError, ValueError):
            raise TokenizerError(f"{where}[{i}]: expected [piece, score], got {item!r}") from None
    if not out:
        raise TokenizerError(f"{where}: a unigram vocabulary is a non-empty list of [piece, score]")
    return out


def as_merges(obj: Any, where: str) -> list[tuple[str, str]]:
    """BPE merges: ``"a b"`` lines (a ``#version`` header skipped) or ``[a, b]`` pairs."""
    out: list[tuple[str, str]] = []
    for i, item in enumerate(obj if isinstance(obj, list) else ()):
        if isinstance(item, str):
            if item.startswith("#version") or not item:
                continue
            item = item.split(" ")
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise TokenizerError(f"{where}[{i}]: a merge is 'left right' or [left, right]")
        out.append((str(item[0]), str(item[1])))
    if not isinstance(obj, list):
        raise TokenizerError(f"{where}: merges are a list, got {type(obj).__name__}")
    return out


def as_ranks(obj: Any, where: str) -> dict[bytes, int]:
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, bytes) and type(v) is int for k, v in obj.items()
    ):
        raise TokenizerError(f"{where}: ranks map token bytes to integer ranks (a tiktoken file)")
    return dict(obj)
