"""Specs: YAML -> validated, resolved, frozen ``Spec``.

``load_spec(ref)`` takes a path or the name of a built-in spec; hyperparameters come from the
checkpoint (GGUF metadata or HF config.json) and are overridden by the spec's ``hparams``. A GGUF
file stands for a spec of its own: its ``general.architecture`` names the network template
``specs/gguf/<architecture>.yaml`` (data: one file per architecture), so ``inferflow generate
model.gguf`` needs no spec file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from inferflow.blocks import FFNS, HEADS, POSITIONS
from inferflow.blocks.linear import EmbeddingOptions, OutputOptions
from inferflow.blocks.options import NoOptions
from inferflow.blocks.residual import GateOptions
from inferflow.errors import SpecError
from inferflow.loaders.gguf import GGUF_MAGIC
from inferflow.paths import PACKAGE_SCHEME, expand_user, resolve_ref
from inferflow.spec import hparams as hp
from inferflow.spec.schema import validate
from inferflow.spec.tokenizer import default_tokenizer, parse_tokenizer
from inferflow.spec.types import (
    AttentionSpec,
    GenerationDefaults,
    MapEntry,
    NetworkSpec,
    PartitionSpec,
    QuantSpec,
    SourceSpec,
    Spec,
    TensorsSpec,
)

log = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "specs"
GGUF_TEMPLATES = BUILTIN_DIR / "gguf"  # <general.architecture>.yaml: the network of such GGUFs
DEFAULT_SPEC = "smollm2-135m-instruct"

__all__ = [
    "BUILTIN_DIR",
    "DEFAULT_SPEC",
    "Spec",
    "builtin_specs",
    "load_spec",
    "parse_spec",
    "partition_spec",
]


def builtin_specs() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def find_spec_file(ref: str | Path) -> Path:
    """The file ``ref`` names: a path (``package://`` included) or a built-in spec's name."""
    if str(ref).startswith(PACKAGE_SCHEME):
        return resolve_ref(str(ref), Path.cwd(), what="spec")
    p = expand_user(ref, "spec")
    # os.path: False for any path that cannot be checked (too long, under a file, ...)
    if os.path.isfile(p):
        return p
    builtin = BUILTIN_DIR / f"{ref}.yaml"  # also templates such as "arch/llama"
    if os.path.isfile(builtin):
        return builtin
    raise SpecError(
        f"no spec file {str(ref)!r} and no built-in spec of that name; built-in: {', '.join(builtin_specs())}"
    )


def load_spec(ref: str | Path, hparam_overrides: dict[str, Any] | None = None) -> Spec:
    """The spec ``ref`` names: a spec file, a built-in name, or a GGUF file (see gguf_spec_doc)."""
    path = find_spec_file(ref)
    with open(path, "rb") as f:
        is_gguf = f.read(4) == GGUF_MAGIC
    if is_gguf:
        return parse_spec(
            gguf_spec_doc(path), path.parent, path, hparam_overrides, hp.Pinned.of([])
        )
    chain = _read_chain(path)
    return parse_spec(_merged(chain), path.parent, path, hparam_overrides, hp.Pinned.of(chain))


def gguf_templates() -> list[str]:
    return sorted(p.stem for p in GGUF_TEMPLATES.glob("*.yaml"))


def gguf_spec_doc(path: Path) -> dict[str, Any]:
    """The spec of a GGUF file: the template of its architecture, its file as the source, and
    a head tied to the token embeddings exactly when the file has no ``output.weight``."""
    from inferflow.loaders.gguf import open_gguf

    source = open_gguf([path])
    try:
        arch = source.metadata.get("general.architecture")
        tied = "output.weight" not in source.names()
    finally:
        source.close()
    template = GGUF_TEMPLATES / f"{arch}.yaml"
    if not isinstance(arch, str) or not arch.isidentifier() or not template.is_file():
        raise SpecError(
            f"{path}: no network template for GGUF architecture {str(arch)[:64]!r}; known: "
            f"{', '.join(gguf_templates())}. Write a spec with the file as source.files (a "
            "template's network is a start: base: gguf/llama)"
        )
    doc = {
        "name": path.stem,
        "source": {"format": "gguf", "files": [str(path.resolve())]},
        "network": {"output": {"tied": tied}},
    }
    merged = _merge(read_doc(template), doc)
    merged.pop("description", None)
    return merged


# A spec is a few kilobytes, nests a handful of levels and holds a few hundred values. YAML
# aliases can make a document recursive (``&a [*a]``) or exponentially large once expanded
# ("billion laughs"), and the composer recurses per nesting level: all refused from the parser's
# events, before a node is composed.
MAX_SPEC_BYTES = 1 << 20
MAX_YAML_DEPTH = 32
MAX_YAML_VALUES = 100_000
# libyaml where installed: PyYAML's pure-Python scanner is quadratic in flow nesting
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_BASE_LOADER):  # type: ignore[misc,valid-type]
    """A safe loader that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently: a spec's earlier setting would vanish)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # (<<: merged keys may be overridden: that is what merging is for)
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
                seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the constructor reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given at line {first})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)  # type: ignore[no-any-return]


_LOADER = _Loader


def _read_yaml(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # not stat(): a device or pipe reports no size
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES} bytes, the limit for a spec")
        text = raw.decode("utf-8")
        _check_events(text, path)
        return yaml.load(text, Loader=_LOADER)  # a safe loader, C or Python
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read: {e}") from None


def _check_events(text: str, path: Path) -> None:
    """Refuse a document nested deeper than MAX_YAML_DEPTH or holding more than MAX_YAML_VALUES
    values once its aliases are expanded, counting as the parser streams its events."""
    values = 0  # expanded so far
    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (expanded values, nesting) of its node
    open_: list[list[Any]] = []  # per open collection: [anchor, values before it, deepest level]
    for event in yaml.parse(text, Loader=_LOADER):
        size, depth = 1, len(open_)
        if isinstance(event, yaml.AliasEvent):
            if any(c[0] == event.anchor for c in open_):
                raise SpecError(f"{path}: recursive YAML alias *{event.anchor}")
            size, nesting = anchors.get(event.anchor, (1, 0))  # undefined: the composer says so
            depth += nesting
        elif isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            open_.append([event.anchor, values, depth])
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before, deepest = open_.pop()
            if anchor is not None:
                anchors[anchor] = (values - before, deepest - len(open_))
            if open_:
                open_[-1][2] = max(open_[-1][2], deepest)
            continue
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                anchors[event.anchor] = (1, 0)
        else:
            continue  # stream and document boundaries
        values += size
        if values > MAX_YAML_VALUES:
            raise SpecError(
                f"{path}: more than {MAX_YAML_VALUES} values once YAML aliases are expanded"
            )
        if depth > MAX_YAML_DEPTH:
            raise SpecError(
                f"{path}: YAML nested deeper than {MAX_YAML_DEPTH} levels (aliases expanded)"
            )
        if open_ and depth > open_[-1][2]:
            open_[-1][2] = depth


# network sections that pick a block by ``type`` (their other keys are that block's options)
BLOCK_SECTIONS = ("position", "ffn", "head")


def _merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """The child's keys win, maps merge, and a null in the child removes the base's key (e.g. a
    ``network.tensors.map`` entry or an ``hparams`` override the base spec gives). A block
    section whose ``type`` the child changes is replaced whole: the base's options belong to
    the other block."""
    out = dict(base)
    for k, v in child.items():
        if v is None:
            out.pop(k, None)
        else:
            inner = isinstance(v, dict) and isinstance(out.get(k), dict)
            if (
                inner
                and k in BLOCK_SECTIONS
                and v.get("type", out[k].get("type")) != out[k].get("type")
            ):
                inner = False
            out[k] = _merge(out[k], v) if inner else v
    return out


MAX_BASE_DEPTH = 16  # specs in one base: chain (a template's chain is 2 or 3)


def read_doc(path: Path) -> Any:
    """A spec document with its ``base:`` chain merged in (``_merge``)."""
    return _merged(_read_chain(path))


def _merged(chain: list[Any]) -> Any:
    doc = chain[-1]
    for child in reversed(chain[:-1]):
        doc = _merge(doc, child)
    return doc


def _read_chain(path: Path) -> list[Any]:
    """The spec at ``path`` and its ``base:`` specs, the spec first (each without its
    ``base`` key), the chain followed without recursion and at most MAX_BASE_DEPTH long."""
    chain: list[Any] = []
    seen = [path.resolve()]
    doc = _read_yaml(path)
    while isinstance(doc, dict) and "base" in doc:
        ref = doc.pop("base")
        if not isinstance(ref, str):
            raise SpecError(f"{path}: base: must be a spec path or built-in name, got {ref!r}")
        if len(chain) + 1 == MAX_BASE_DEPTH:
            raise SpecError(
                f"{path}: base: {ref!r} makes the chain of bases longer than {MAX_BASE_DEPTH} "
                f"specs (from {seen[0]})"
            )
        rel = path.parent / expand_user(ref, "base")
        if not ref.endswith(".yaml") and rel.name:  # '', '.', '/': no name to give a suffix
            rel = rel.with_suffix(".yaml")
        base_path = rel if os.path.isfile(rel) else find_spec_file(ref)
        if base_path.resolve() in seen:
            raise SpecError(f"{path}: base: {ref!r} makes a cycle")
        chain.append(doc)
        seen.append(base_path.resolve())
        path, doc = base_path, _read_yaml(base_path)
        if not isinstance(doc, dict):
            raise SpecError(f"{base_path}: a spec must be a YAML mapping")
    return [*chain, doc]


def parse_spec(
    doc: Any,
    base_dir: Path,
    path: Path | None = None,
    hparam_overrides: dict[str, Any] | None = None,
    pinned: hp.Pinned | None = None,
) -> Spec:
    """``pinned``: what the spec file itself sets (None: everything in ``doc``)."""
    where = str(path) if path else "spec"
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: a spec must be a YAML mapping, got {type(doc).__name__}")
    errors = validate(doc)
    if errors:
        raise SpecError(f"{where}: invalid spec:\n  " + "\n  ".join(errors))

    src = doc["source"]
    files = tuple(resolve_ref(f, base_dir, what="source.files") for f in src["files"])
    for ref, f in zip(src["files"], files, strict=True):
        if not os.path.exists(f):
            raise SpecError(f"source.files: {ref!r} resolves to {f}, which does not exist")
    cfg = src.get("config")
    config_key = cfg["key"] if isinstance(cfg, dict) else None
    if config_key is not None and src["format"] != "pickle":
        raise SpecError(
            f"{where}: source.config: {{key: ...}} names a dict inside a pickle checkpoint; "
            f"source.format is {src['format']!r}"
        )
    config = resolve_ref(cfg, base_dir, what="source.config") if isinstance(cfg, str) else None
    source = SourceSpec(src["format"], files, config, tuple(src.get("keys", ())), config_key)

    tok_doc = doc.get("tokenizer") or default_tokenizer(source)
    source_tokenizer = None
    if "target" in tok_doc:  # an encoder-decoder's two sides
        if doc["network"]["type"] != "encoder_decoder":
            raise SpecError(
                f"{where}: tokenizer.source / tokenizer.target are an encoder_decoder's two "
                f"sides; network.type is {doc['network']['type']!r}: give one tokenizer"
            )
        source_tokenizer = parse_tokenizer(tok_doc["source"], base_dir, "tokenizer.source")
        tokenizer = parse_tokenizer(tok_doc["target"], base_dir, "tokenizer.target")
    else:
        tokenizer = parse_tokenizer(tok_doc, base_dir)

    network = _network(doc["network"])
    found = hp.read_checkpoint_hparams(source)
    given = dict(doc.get("hparams", {}))
    encoder = {**found.get("encoder", {}), **given.pop("encoder", {})}  # the spec's win
    if pinned is not None:  # a template's numbers: defaults under the checkpoint's
        defaults = {k: v for k, v in given.items() if k not in pinned.hparams}
        given = {k: v for k, v in given.items() if k in pinned.hparams}
        found = {**defaults, **found}
    network = hp.checkpoint_activation(network, found.pop("activation", None), pinned, where)
    found.update(given)
    found.update(hparam_overrides or {})
    found["encoder"] = encoder
    if network.head is not None and "labels" not in given:
        hp.check_labels(found, where)
    hparams = hp.special_ids(
        hp.usable_positions(hp.make_hparams(found, where), network), where, given
    )
    enc_hparams = None
    if network.type == "encoder_decoder":
        # the encoder: the common numbers, its own where the checkpoint or the spec gives them
        own = {"n_layers": hparams.n_enc_layers, **found.get("encoder", {})}
        enc_found = {k: v for k, v in found.items() if k not in ("n_layers", "encoder")} | own
        enc_hparams = hp.usable_positions(hp.make_hparams(enc_found, where + " (encoder)"), network)
    gen = GenerationDefaults(**doc.get("generation", {}))
    q = doc.get("quant", {})
    quant = QuantSpec(
        _fmt(q.get("weights")),
        tuple((pat, _fmt(f)) for pat, f in q.get("overrides", {}).items()),
        # weights: none means float everywhere, the checkpoint's own blocks included
        "dequantize" if q.get("weights") == "none" else q.get("checkpoint", "keep"),
        None if q.get("kernel", "auto") == "auto" else q["kernel"],
        q.get("dense_batch"),
        q.get("method", "search"),
        resolve_ref(q["imatrix"], base_dir, what="quant.imatrix") if "imatrix" in q else None,
    )
    return Spec(
        name=doc["name"],
        path=path,
        source=source,
        tokenizer=tokenizer,
        network=network,
        hparams=hparams,
        generation=gen,
        quant=quant,
        description=doc.get("description", ""),
        embedding_pooling=doc.get("embeddings", {}).get("pooling"),
        embedding_normalize=doc.get("embeddings", {}).get("normalize", True),
        partition=partition_spec(doc["partition"]) if "partition" in doc else None,
        enc_hparams=enc_hparams,
        source_tokenizer=source_tokenizer,
        raw=doc,
    )


def partition_spec(p: dict[str, Any]) -> PartitionSpec:
    """The ``partition`` section (schema-checked): the spec's, or the CLI's --devices."""
    return PartitionSpec(**{**p, "layers": tuple(p.get("layers", ()))})


def _fmt(name: str | None) -> str | None:
    return None if name in (None, "none") else name


def _network(n: dict[str, Any]) -> NetworkSpec:
    t = n["tensors"]
    entries = tuple(
        _map_entry(k, u)
        for k, v in t.get("map", {}).items()
        for u in (v if isinstance(v, list) else [v])
    )
    tensors = TensorsSpec(t.get("preset"), t.get("prefix", ""), entries, tuple(t.get("ignore", ())))
    ffn_doc = n["ffn"] if isinstance(n["ffn"], dict) else {"type": n["ffn"]}
    ffn = ffn_doc["type"]
    head_doc = n.get("head")
    return NetworkSpec(
        type=n["type"],
        norm=n["norm"],
        activation=n["activation"],
        ffn=ffn,
        ffn_options=FFNS.get(ffn).Options.parse(ffn_doc, "network.ffn"),  # type: ignore[attr-defined]
        gates=GateOptions.parse(n.get("gates", {}), "network.gates"),
        head=head_doc["type"] if head_doc else None,
        head_options=(
            HEADS.get(head_doc["type"]).Options.parse(head_doc, "network.head")
            if head_doc
            else NoOptions()
        ),
        residual=n["residual"],
        positions=tuple(
            (p["type"], POSITIONS.get(p["type"]).Options.parse(p, "network.position"))
            for p in (n["position"] if isinstance(n["position"], list) else [n["position"]])
        ),
        attention=AttentionSpec.parse(n.get("attention", {}), "network.attention"),
        tensors=tensors,
        ffn_bias=n.get("ffn_bias", False),
        embedding=EmbeddingOptions.parse(n.get("embedding", {}), "network.embedding"),
        output=OutputOptions.parse(n.get("output", {}), "network.output"),
        final_norm=n.get("final_norm", n["residual"] != "post_norm"),
    )


def _map_entry(source: str, use: str | dict[str, Any]) -> MapEntry:
    """One use of a ``network.tensors.map`` entry (schema-checked)."""
    if isinstance(use, str):
        return MapEntry(source, use)
    sl, ch = use.get("slice"), use.get("chunk")
    return MapEntry(
        source,
        use["to"],
        bool(use.get("transpose")),
        None if sl is None else (sl.get("axis", 0), sl.get("start", 0), sl["stop"]),
        None if ch is None else (ch.get("axis", 0), ch["parts"], ch["index"]),
        None if "reshape" not in use else tuple(use["reshape"]),
        use.get("scale"),
        None if "pad" not in use else (use["pad"].get("axis", 0), use["pad"]["size"]),
        rows=None if "rows" not in use else (use["rows"].get("start", 0), use["rows"]["stop"]),
        rope_rows=None
        if "rope_rows" not in use
        else (use["rope_rows"]["heads"], use["rope_rows"].get("to", "half")),
        per_layer=bool(use.get("per_layer")),
    )
