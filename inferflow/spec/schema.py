"""The spec's JSON Schema, built from the registries so a new block needs no schema edit, and
error messages that name the YAML path, the bad value and the allowed values."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import jsonschema

from inferflow.blocks.attention import AttentionOptions
from inferflow.blocks.linear import EmbeddingOptions, OutputOptions
from inferflow.blocks.residual import GateOptions
from inferflow.registry import Registry
from inferflow.spec.types import EMBEDDING_PLACES, PARTITION_STRATEGIES, POOLINGS, HParams


def _hparam_types() -> dict[str, dict[str, Any]]:
    """JSON Schemas of the hyperparameters a spec may set: HParams' fields of a scalar type or
    a list of strings (declared once, there)."""
    named = {"int": "integer", "float": "number", "bool": "boolean"}
    out: dict[str, dict[str, Any]] = {}
    for f in fields(HParams):
        kind = str(f.type).replace(" | None", "")
        if kind in named:
            out[f.name] = {"type": named[kind]}
        elif kind == "tuple[str, ...]":
            out[f.name] = {"type": "array", "items": {"type": "string"}}
    return out


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(required),
        "additionalProperties": False,
    }


def _typed(registry: Registry[Any]) -> dict[str, Any]:
    """{type: name, ...}: one alternative per registered block, each allowing its class's
    ``Options`` (declared once, next to the block)."""
    return {
        "anyOf": [
            cls.Options.schema(type={"const": name}) | {"required": ["type"]}
            for name, cls in registry.items()
        ]
    }


def _enum(values: list[str] | tuple[str, ...]) -> dict[str, Any]:
    return {"enum": sorted(values)}


def build_schema() -> dict[str, Any]:
    from inferflow import blocks
    from inferflow.loaders import LOADERS
    from inferflow.model.build import NETWORKS
    from inferflow.model.names import PRESETS
    from inferflow.quant import FORMATS, METHODS
    from inferflow.tokenizer import TOKENIZER_KINDS
    from inferflow.tokenizer.pipeline import pipeline_schema

    num = {"type": "number"}
    string = {"type": "string"}
    files = {"type": "array", "items": string, "minItems": 1}
    # one mechanism {type: name, ...that block's options}
    position = _typed(blocks.POSITIONS)
    attention = AttentionOptions.schema()
    index = {"type": "integer", "minimum": 0}
    use = _obj(
        {
            "to": string,
            "transpose": {"type": "boolean"},
            "slice": _obj({"axis": index, "start": index, "stop": index}, ("stop",)),
            "chunk": _obj(
                {"axis": index, "parts": {"type": "integer", "minimum": 1}, "index": index},
                ("parts", "index"),
            ),
            "reshape": {"type": "array", "items": {"type": "integer", "minimum": -1}},
            "scale": num,
            "pad": _obj({"axis": index, "size": {"type": "integer", "minimum": 1}}, ("size",)),
            # each head's rows between rope layouts (heads: a number, n_heads or n_kv_heads)
            "rope_rows": _obj(
                {
                    "heads": {
                        "anyOf": [
                            {"type": "integer", "minimum": 1},
                            {"enum": ["n_heads", "n_kv_heads"]},
                        ]
                    },
                    "to": _enum(["half", "adjacent"]),
                },
                ("heads",),
            ),
            # the result fills these rows of the target (tensors concatenated along axis 0)
            "rows": _obj({"start": index, "stop": index}, ("stop",)),
            # a source without {i} stacking one value per layer along its first axis: layer i
            # takes element i (a [n_layers] vector of per-layer scalars)
            "per_layer": {"type": "boolean"},
        },
        ("to",),
    )
    # a target name, one use with steps, or a list of uses (one stored tensor, many targets)
    one = {"anyOf": [string, use]}
    map_value = {"anyOf": [string, use, {"type": "array", "items": one, "minItems": 1}]}
    tensors = _obj(
        {
            "preset": _enum(PRESETS.names()),
            "prefix": string,
            "map": {"type": "object", "additionalProperties": map_value},
            "ignore": {"type": "array", "items": string},
        }
    )
    tokenizer = _obj(
        {
            "from": _enum([*TOKENIZER_KINDS.names(), "none"]),  # none: token ids only
            "files": files,
            "chat_template": string,
            "add_bos": {"type": "boolean"},
            "add_eos": {"type": "boolean"},
            # the regex a kind that takes one (pickle_vocab, tiktoken) cuts text with
            "pattern": string,
            # the pipeline's own parts (normalizer, pre_tokenizer, model, ...)
            **pipeline_schema(),
        }
    )
    network = _obj(
        {
            "type": _enum(NETWORKS.names()),
            "norm": _enum(blocks.NORMS.names()),
            "activation": _enum(blocks.ACTIVATIONS.names()),
            # a name, or {type: name, ...that block's options}
            "ffn": {"anyOf": [_enum(blocks.FFNS.names()), *_typed(blocks.FFNS)["anyOf"]]},
            "ffn_bias": {"type": "boolean"},
            "residual": _enum(blocks.RESIDUALS.names()),
            # one mechanism, or a list of them used together
            "position": {
                "anyOf": [
                    *position["anyOf"],
                    {"type": "array", "items": position, "minItems": 1},
                ]
            },
            "attention": attention,
            # learned scalars on the residual stream (nanochat / modded-nanogpt)
            "gates": GateOptions.schema(),
            # a task head: {type: name, ...that head's options}
            "head": _typed(blocks.HEADS),
            "embedding": EmbeddingOptions.schema(),
            "final_norm": {"type": "boolean"},  # default: true unless residual is post_norm
            "output": OutputOptions.schema(),
            "tensors": tensors,
        },
        ("type", "norm", "activation", "ffn", "residual", "position", "tensors"),
    )
    return _obj(
        {
            "name": string,
            "description": string,
            "source": _obj(
                {
                    "format": _enum(LOADERS.names()),
                    "files": files,
                    # a config.json, or {key: K}: the dict at top-level key K of a pickle
                    # checkpoint (its own hyperparameters: nanoGPT's model_args)
                    "config": {"anyOf": [string, _obj({"key": string}, ("key",))]},
                    # a pickle's top-level dict(s) of tensors to read (several: "key." names)
                    "keys": {"type": "array", "items": string, "minItems": 1},
                },
                ("format", "files"),
            ),
            # one tokenizer, or an encoder-decoder's two: {source: ..., target: ...}
            "tokenizer": {
                "anyOf": [
                    tokenizer,
                    _obj({"source": tokenizer, "target": tokenizer}, ("source", "target")),
                ]
            },
            # (encoder: an encoder-decoder's encoder, where its numbers differ)
            "hparams": _obj({**_hparam_types(), "encoder": _obj(_hparam_types())}),
            "network": network,
            "quant": _obj(
                {
                    "weights": _enum([*FORMATS.names(), "none"]),
                    "checkpoint": _enum(["keep", "dequantize"]),
                    "kernel": _enum(["auto", "dequant", "int4pack"]),
                    "dense_batch": {"type": ["integer", "null"], "minimum": 1},
                    "method": _enum(list(METHODS)),
                    "imatrix": {"type": "string", "minLength": 1},
                    "overrides": {
                        "type": "object",
                        "additionalProperties": _enum([*FORMATS.names(), "none"]),
                    },
                }
            ),
            # a decoder served on /v1/embeddings pools its final hidden states this way
            "embeddings": _obj(
                {"pooling": _enum(POOLINGS), "normalize": {"type": "boolean"}}, ("pooling",)
            ),
            # optional: split the model across devices / processes (inferflow.parallel)
            "partition": _obj(
                {
                    "devices": {"type": "string", "minLength": 1},
                    "strategy": _enum(PARTITION_STRATEGIES),
                    "layer_groups": {"type": "integer", "minimum": 1},
                    "tensor_parallel": {"type": "integer", "minimum": 1},
                    "device": _enum(["cpu", "cuda"]),
                    "layers": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                    "cpu_layers": {"type": "integer", "minimum": 1},
                    "embeddings": _enum(EMBEDDING_PLACES),
                }
            ),
            "generation": _obj(
                {
                    "temperature": {"type": "number", "minimum": 0},
                    "top_k": {"type": "integer", "minimum": 0},
                    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                    "max_new_tokens": {"type": "integer", "minimum": 1},
                    "seed": {"type": "integer"},
                }
            ),
        },
        ("name", "source", "network"),
    )


def _path(err: jsonschema.ValidationError) -> str:
    out = ""
    for part in err.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def format_error(err: jsonschema.ValidationError) -> str:
    where, v = _path(err), err.validator
    if v == "enum":
        return (
            f"{where}: {err.instance!r} is not one of: {', '.join(map(str, err.validator_value))}"
        )
    if v == "additionalProperties" and isinstance(err.instance, dict):
        allowed = sorted(err.schema.get("properties", {}))
        # YAML keys need not be strings (``1: x``): sort by their text
        extra = sorted((k for k in err.instance if k not in allowed), key=str)
        return f"{where}: unknown key {', '.join(map(repr, extra))}; allowed: {', '.join(allowed)}"
    if v == "required":
        missing = [k for k in err.validator_value if k not in err.instance]
        return f"{where}: missing required key {', '.join(map(repr, missing))}"
    if v == "type":
        return f"{where}: {err.instance!r} is not of type {err.validator_value}"
    if v == "anyOf":
        # a mapping or list fails inside one alternative: say what is wrong there
        kinds = {"object": dict, "array": list}
        alts = list(enumerate(err.validator_value))
        if isinstance(err.instance, dict):  # {type: name, ...}: that name's alternative first
            consts = {i: a.get("properties", {}).get("type", {}).get("const") for i, a in alts}
            names = sorted(str(c) for c in consts.values() if c is not None)
            kind = err.instance.get("type")
            if names and kind not in names:
                return f"{where}.type: {kind!r} is not one of: {', '.join(names)}"
            alts = [(i, a) for i, a in alts if consts[i] == kind] or alts
        for i, alt in alts:
            if isinstance(err.instance, kinds.get(str(alt.get("type")), type(None))):
                near = [e for e in err.context or [] if e.relative_schema_path[0] == i]
                if near:
                    return format_error(jsonschema.exceptions.best_match(near))
        return f"{where}: {err.instance!r} is not valid here ({err.message})"
    return f"{where}: {err.message}"


def validate(doc: Any) -> list[str]:
    """All schema errors of a parsed YAML document, as messages (empty when valid)."""
    validator = jsonschema.Draft202012Validator(build_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [format_error(e) for e in errors]
