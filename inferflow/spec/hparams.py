"""Hyperparameters read from the checkpoint: data tables from our names to the keys of HF
``config.json`` and of GGUF metadata (``{arch}`` is ``general.architecture``); and how a spec's
numbers are resolved: a template's defaults, then the checkpoint's, then the spec's own
(``Pinned``), with the checks that need no weights (labels, special ids)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from inferflow.blocks import ACTIVATIONS
from inferflow.blocks.position import LearnedOptions
from inferflow.errors import InferflowError, SpecError
from inferflow.paths import read_json
from inferflow.spec.types import HParams, NetworkSpec, SourceSpec

log = logging.getLogger(__name__)

# our name -> candidate config.json keys (dotted = nested); first present and non-null wins
HF_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("tgt_vocab_size", "vocab_size", "padded_vocab_size"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    # encoder-decoder configs: n_layers / n_heads / ffn_hidden are the decoder's
    "n_layers": (
        "decoder_layers",
        "num_decoder_layers",
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "n_layers",
    ),
    "n_enc_layers": ("encoder_layers", "num_layers"),
    "embed_dim": ("embedding_size",),  # factorised embeddings (ALBERT, ELECTRA)
    "n_heads": (
        "decoder_attention_heads",
        "num_attention_heads",
        "n_head",
        "num_heads",
        "n_heads",
    ),
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "head_dim": ("head_dim", "d_kv"),
    "ffn_hidden": (
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "decoder_ffn_dim",
        "d_ff",
        "hidden_dim",
    ),
    "norm_eps": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"),
    "rope_theta": ("rope_theta", "rope_parameters.rope_theta", "rotary_emb_base"),
    "rope_partial": (
        "partial_rotary_factor",
        "rope_parameters.partial_rotary_factor",
        "rotary_pct",
    ),
    "max_positions": ("max_position_embeddings", "n_positions", "n_ctx", "block_size"),
    "sliding_window": ("sliding_window",),
    "bos_id": ("bos_token_id",),
    "eos_id": ("eos_token_id",),
    "pad_id": ("pad_token_id",),
    "decoder_start_id": ("decoder_start_token_id",),
    "type_vocab_size": ("type_vocab_size",),
    "rel_buckets": ("relative_attention_num_buckets",),
    "rel_max_distance": ("relative_attention_max_distance",),
    "n_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "n_experts_used": ("num_experts_per_tok",),
    "expert_ffn_hidden": ("moe_intermediate_size",),
    "shared_ffn_hidden": ("shared_expert_intermediate_size",),
    "moe_normalize": ("norm_topk_prob",),
}

# the activation a config.json names (transformers' ACT2FN names) -> our ACTIVATIONS block
HF_ACTIVATION_KEYS = ("hidden_act", "activation_function", "hidden_activation", "activation")
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "quick_gelu": "gelu_quick",
    "relu": "relu",
    "relu2": "relu2",
    "silu": "silu",
    "swish": "silu",
    "tanh": "tanh",
}

# an encoder-decoder's encoder: our name -> its own config.json keys, where the config has them
HF_ENCODER_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("src_vocab_size",),  # (its layer count: n_enc_layers)
    "n_heads": ("encoder_attention_heads",),
    "ffn_hidden": ("encoder_ffn_dim",),
}

# our name -> candidate GGUF metadata keys (llama.cpp's LLM_KV names)
GGUF_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("{arch}.vocab_size",),
    "hidden": ("{arch}.embedding_length",),
    "n_layers": ("{arch}.block_count",),
    "n_heads": ("{arch}.attention.head_count",),
    "n_kv_heads": ("{arch}.attention.head_count_kv",),
    "head_dim": ("{arch}.attention.key_length",),
    "rotary_dim": ("{arch}.rope.dimension_count",),
    "ffn_hidden": ("{arch}.feed_forward_length",),
    "norm_eps": ("{arch}.attention.layer_norm_rms_epsilon", "{arch}.attention.layer_norm_epsilon"),
    "rope_theta": ("{arch}.rope.freq_base",),
    "max_positions": ("{arch}.context_length",),
    "sliding_window": ("{arch}.attention.sliding_window",),
    "bos_id": ("tokenizer.ggml.bos_token_id",),
    "eos_id": ("tokenizer.ggml.eos_token_id",),
    "n_experts": ("{arch}.expert_count",),
    "n_experts_used": ("{arch}.expert_used_count",),
    "expert_ffn_hidden": ("{arch}.expert_feed_forward_length",),
    "shared_ffn_hidden": ("{arch}.expert_shared_feed_forward_length",),
}

# rope scaling: HF rope_type / GGUF scaling type -> ours, and option keys -> ours
ROPE_SCALING_TYPES = {"linear": "linear", "llama3": "llama3", "yarn": "yarn"}
HF_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_positions",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "truncate": "truncate",
}
GGUF_ROPE_SCALING_KEYS = {
    "{arch}.rope.scaling.factor": "factor",
    "{arch}.rope.scaling.original_context_length": "original_max_positions",
}


def _dotted(d: dict[str, Any], key: str) -> Any:
    cur: Any = d
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _first(value: Any) -> Any:
    # eos_token_id may be a list in HF configs: the first is the model's own end token
    return value[0] if isinstance(value, list) and value else value


def _lookup(config: dict[str, Any], table: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, keys in table.items():
        for key in keys:
            v = _first(_dotted(config, key))
            if v is not None:
                out[name] = v
                break
    return out


def from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """Our hyperparameters from a config.json; ``encoder``: the encoder's own numbers."""
    out = _lookup(config, HF_CONFIG_KEYS)
    if config.get("multi_query") is True and not config.get("new_decoder_architecture"):
        out["n_kv_heads"] = 1  # (Falcon-7B, GPTBigCode: one shared K/V head, whatever else)
    out["encoder"] = _lookup(config, HF_ENCODER_KEYS)
    act = next((config[k] for k in HF_ACTIVATION_KEYS if isinstance(config.get(k), str)), None)
    if act is not None:  # (not a hyperparameter: it chooses network.activation)
        out["activation"] = HF_ACTIVATIONS.get(act, f"unknown:{act}")
    if type(config.get("num_labels")) is int:  # checked against id2label where a head reads it
        out["num_labels"] = config["num_labels"]
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels and all(str(k).isdigit() for k in labels):
        out["labels"] = tuple(str(labels[k]) for k in sorted(labels, key=int))
    rs = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rs.get("rope_type") or rs.get("type")
    if kind in ROPE_SCALING_TYPES:
        scaling: dict[str, Any] = {"type": ROPE_SCALING_TYPES[kind]}
        scaling.update(
            {ours: rs[k] for k, ours in HF_ROPE_SCALING_KEYS.items() if rs.get(k) is not None}
        )
        scaling.setdefault("original_max_positions", out.get("max_positions"))
        out["rope_scaling"] = scaling
    return out


def from_gguf_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise SpecError("GGUF metadata has no general.architecture: cannot read hyperparameters")
    out: dict[str, Any] = {}
    for name, keys in GGUF_KEYS.items():
        for key in keys:
            v = meta.get(key.format(arch=arch))
            if v is not None:
                out[name] = v
                break
    if "vocab_size" not in out and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        out["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in ROPE_SCALING_TYPES:
        scaling = {"type": ROPE_SCALING_TYPES[kind]}
        for k, ours in GGUF_ROPE_SCALING_KEYS.items():
            if meta.get(k.format(arch=arch)) is not None:
                scaling[ours] = meta[k.format(arch=arch)]
        out["rope_scaling"] = scaling
    return out


def read_hf_config(path: Path) -> dict[str, Any]:
    try:
        config = read_json(path)
    except FileNotFoundError:
        raise SpecError(f"config file {path} does not exist") from None
    except OSError as e:  # a directory, a path through a file, a name too long, no permission
        raise SpecError(f"cannot read config file {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"config file {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise SpecError(f"config file {path} must hold a JSON object")
    return config


# -- resolving a spec's hyperparameters: templates, the checkpoint, the spec -------------------


@dataclass(frozen=True)
class Pinned:
    """What the spec sets for its checkpoint, as opposed to what its templates give: a template
    (a base spec without ``source:``, written for any checkpoint of a family) gives the
    family's defaults for hyperparameters and the activation, which the checkpoint's own
    config.json overrides; the spec file itself, and any base spec of a checkpoint (one with
    ``source:``), override both."""

    hparams: frozenset[str]
    network: frozenset[str]

    @classmethod
    def of(cls, chain: list[Any]) -> Pinned:
        """From a spec's chain, the spec first (``_read_chain``)."""
        hp_keys: set[str] = set()
        net_keys: set[str] = set()
        for n, doc in enumerate(chain):
            if not isinstance(doc, dict) or (n and "source" not in doc):
                continue  # a template
            if isinstance(doc.get("hparams"), dict):
                hp_keys.update(doc["hparams"])
            if isinstance(doc.get("network"), dict):
                net_keys.update(doc["network"])
        return cls(frozenset(hp_keys), frozenset(net_keys))


def read_checkpoint_hparams(source: SourceSpec) -> dict[str, Any]:
    """Hyperparameters the checkpoint declares (GGUF metadata or a config.json)."""
    try:
        if source.format == "gguf":
            from inferflow.loaders.gguf import read_gguf_metadata

            return from_gguf_metadata(read_gguf_metadata(source.files[0]))
        if source.config_key is not None:
            from inferflow.loaders.pickle_safe import read_config_dict

            return from_hf_config(read_config_dict(source.files[0], source.config_key))
        config = source.config
        if config is None and source.format == "hf":
            config = source.files[0] / "config.json"
        if config is None:
            return {}
        return from_hf_config(read_hf_config(config))
    except SpecError:
        raise
    except InferflowError as e:  # a broken checkpoint reported in spec terms
        raise SpecError(f"source.files: cannot read hyperparameters: {e}") from None


def usable_positions(h: HParams, net: NetworkSpec) -> HParams:
    """A learned table whose declared rows include its offset rows (``offset_in_table``)
    serves ``max_positions - offset`` positions: ``max_positions`` becomes that length (the
    block adds the offset rows back to its table)."""
    for _, p in net.positions:
        if isinstance(p, LearnedOptions) and p.offset_in_table:
            offset = p.offset
            if h.max_positions <= offset:
                raise SpecError(
                    f"network.position: offset {offset} leaves no position in a table of "
                    f"{h.max_positions} rows (hparams.max_positions)"
                )
            return replace(h, max_positions=h.max_positions - offset)
    return h


def checkpoint_activation(
    network: NetworkSpec, act: str | None, pinned: Pinned | None, where: str
) -> NetworkSpec:
    """The activation the checkpoint's config.json names replaces a template's (the spec's own
    network.activation is kept, with a warning where they differ)."""
    if act is None or act == network.activation:
        return network
    if act.startswith("unknown:"):
        log.warning(
            "%s: config.json's activation %r has no block here (known: %s); keeping "
            "network.activation %r",
            where,
            act.removeprefix("unknown:"),
            ", ".join(ACTIVATIONS.names()),
            network.activation,
        )
        return network
    if pinned is None or "activation" in pinned.network:
        log.warning(
            "%s: network.activation %r differs from the checkpoint's config.json (%r); the "
            "spec's is used",
            where,
            network.activation,
            act,
        )
        return network
    log.info(
        "%s: activation %r from config.json (the template says %r)", where, act, network.activation
    )
    return replace(network, activation=act)


def check_labels(found: dict[str, Any], where: str) -> None:
    """A head's labels: config.json's num_labels and id2label must agree (the spec's
    hparams.labels settles it); num_labels alone names them as transformers does, LABEL_i."""
    n, labels = found.get("num_labels"), found.get("labels")
    if not isinstance(n, int):
        return
    if labels is None:
        found["labels"] = tuple(f"LABEL_{i}" for i in range(n))
    elif len(labels) != n:
        raise SpecError(
            f"{where}: config.json says num_labels {n} but its id2label names {len(labels)} "
            f"labels {list(labels)[:8]}; set hparams.labels to the {n} labels in output order"
        )


# hyperparameters that name a token: each must be a token of the vocabulary
TOKEN_HPARAMS = ("bos_id", "eos_id", "pad_id", "decoder_start_id")


def special_ids(h: HParams, where: str, given: dict[str, Any]) -> HParams:
    """A special token id the checkpoint declares outside the vocabulary (a config copied from
    another model) is dropped with a warning: it could never be generated or stop anything.
    One the spec itself gives is an error."""
    bad = {
        k: v
        for k in TOKEN_HPARAMS
        if (v := getattr(h, k)) is not None and not 0 <= v < h.vocab_size
    }
    for k, v in bad.items():
        if k in given:
            raise SpecError(
                f"{where}: hparams.{k} {v} is outside the vocabulary of {h.vocab_size} tokens"
            )
        log.warning(
            "%s: the checkpoint's %s %d is outside the vocabulary of %d tokens: ignored (set "
            "hparams.%s to a token of the vocabulary)",
            where,
            k,
            v,
            h.vocab_size,
            k,
        )
    dropped: dict[str, Any] = {k: None for k in bad}
    return replace(h, **dropped)


def make_hparams(found: dict[str, Any], where: str) -> HParams:
    known = {f.name for f in fields(HParams)}
    values = {k: v for k, v in found.items() if k in known}
    required = ("vocab_size", "hidden", "n_layers", "n_heads")
    missing = [k for k in required if k not in values]
    if missing:
        raise SpecError(
            f"{where}: the checkpoint does not declare {', '.join(missing)}; set them under hparams: "
            f"(or give source.config: config.json)"
        )
    return HParams(**values)
