"""Checkpoint -> canonical tensor names, as data.

Canonical names are the one vocabulary between loaders and networks: ``dec.tok_embed.weight``,
``dec.{i}.self_attn.wq.weight``, ``dec.{i}.feed_forward.w1.weight``, ``dec.output.weight``...
A preset is a table for one checkpoint family; a spec's own ``tensors.map`` adds to or overrides
it. ``{i}`` stands for the layer index.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from inferflow.errors import SpecError
from inferflow.registry import Registry
from inferflow.spec.types import MapEntry, TensorsSpec

PRESETS: Registry[dict[str, str]] = Registry("tensor name preset")

# llama.cpp's GGUF names (gguf-py MODEL_TENSOR / TensorNameMap), any architecture
PRESETS.add(
    "gguf",
    {
        "token_embd.weight": "dec.tok_embed.weight",
        "position_embd.weight": "dec.pos_embed.weight",
        "output_norm.weight": "dec.output_norm.weight",
        "output_norm.bias": "dec.output_norm.bias",
        "output.weight": "dec.output.weight",
        "output.bias": "dec.output.bias",
        "blk.{i}.attn_norm.weight": "dec.{i}.attn_norm.weight",
        "blk.{i}.attn_norm.bias": "dec.{i}.attn_norm.bias",
        "blk.{i}.attn_q.weight": "dec.{i}.self_attn.wq.weight",
        "blk.{i}.attn_k.weight": "dec.{i}.self_attn.wk.weight",
        "blk.{i}.attn_v.weight": "dec.{i}.self_attn.wv.weight",
        "blk.{i}.attn_q.bias": "dec.{i}.self_attn.wq.bias",
        "blk.{i}.attn_k.bias": "dec.{i}.self_attn.wk.bias",
        "blk.{i}.attn_v.bias": "dec.{i}.self_attn.wv.bias",
        "blk.{i}.attn_qkv.weight": "dec.{i}.self_attn.wqkv.weight",
        "blk.{i}.attn_qkv.bias": "dec.{i}.self_attn.wqkv.bias",
        "blk.{i}.attn_output.weight": "dec.{i}.self_attn.wo.weight",
        "blk.{i}.attn_output.bias": "dec.{i}.self_attn.wo.bias",
        "blk.{i}.attn_q_norm.weight": "dec.{i}.self_attn.q_norm.weight",
        "blk.{i}.attn_k_norm.weight": "dec.{i}.self_attn.k_norm.weight",
        "blk.{i}.post_attention_norm.weight": "dec.{i}.post_attn_norm.weight",
        "blk.{i}.ffn_norm.weight": "dec.{i}.ffn_norm.weight",
        "blk.{i}.ffn_norm.bias": "dec.{i}.ffn_norm.bias",
        "blk.{i}.ffn_gate.weight": "dec.{i}.feed_forward.w1.weight",
        "blk.{i}.ffn_up.weight": "dec.{i}.feed_forward.w3.weight",
        "blk.{i}.ffn_down.weight": "dec.{i}.feed_forward.w2.weight",
        "blk.{i}.post_ffw_norm.weight": "dec.{i}.post_ffn_norm.weight",
    },
)

# Hugging Face llama-style checkpoints (Llama, Mistral, Qwen2, Gemma, ...)
PRESETS.add(
    "hf_llama",
    {
        "model.embed_tokens.weight": "dec.tok_embed.weight",
        "model.norm.weight": "dec.output_norm.weight",
        "lm_head.weight": "dec.output.weight",
        "model.layers.{i}.input_layernorm.weight": "dec.{i}.attn_norm.weight",
        "model.layers.{i}.self_attn.q_proj.weight": "dec.{i}.self_attn.wq.weight",
        "model.layers.{i}.self_attn.k_proj.weight": "dec.{i}.self_attn.wk.weight",
        "model.layers.{i}.self_attn.v_proj.weight": "dec.{i}.self_attn.wv.weight",
        "model.layers.{i}.self_attn.q_proj.bias": "dec.{i}.self_attn.wq.bias",
        "model.layers.{i}.self_attn.k_proj.bias": "dec.{i}.self_attn.wk.bias",
        "model.layers.{i}.self_attn.v_proj.bias": "dec.{i}.self_attn.wv.bias",
        "model.layers.{i}.self_attn.o_proj.weight": "dec.{i}.self_attn.wo.weight",
        "model.layers.{i}.self_attn.o_proj.bias": "dec.{i}.self_attn.wo.bias",
        "model.layers.{i}.self_attn.q_norm.weight": "dec.{i}.self_attn.q_norm.weight",
        "model.layers.{i}.self_attn.k_norm.weight": "dec.{i}.self_attn.k_norm.weight",
        "model.layers.{i}.post_attention_layernorm.weight": "dec.{i}.ffn_norm.weight",
        "model.layers.{i}.pre_feedforward_layernorm.weight": "dec.{i}.ffn_norm.weight",
        "model.layers.{i}.post_feedforward_layernorm.weight": "dec.{i}.post_ffn_norm.weight",
        "model.layers.{i}.mlp.gate_proj.weight": "dec.{i}.feed_forward.w1.weight",
        "model.layers.{i}.mlp.up_proj.weight": "dec.{i}.feed_forward.w3.weight",
        "model.layers.{i}.mlp.down_proj.weight": "dec.{i}.feed_forward.w2.weight",
    },
)

_INDEX = {"i": re.compile(r"\\\{i\\\}"), "e": re.compile(r"\\\{e\\\}")}


def _fill(target: str, found: dict[str, str]) -> str:
    for key, value in found.items():
        target = target.replace("{" + key + "}", value)
    return target


class Use(NamedTuple):
    """One use of a checkpoint tensor: the canonical name it fills (``{i}`` left in for a
    source without a layer index that feeds every layer), the rule's steps, where it is said."""

    target: str
    entry: MapEntry
    origin: str  # the YAML path of the rule, for errors


class NameMap:
    """Maps a checkpoint name to its uses (several: one stored tensor feeding several slots);
    None for names no rule maps."""

    def __init__(self, tensors: TensorsSpec) -> None:
        table: dict[str, list[tuple[MapEntry, str]]] = {}
        if tensors.preset:
            for k, v in PRESETS.get(tensors.preset).items():
                table[k] = [(MapEntry(k, v), f"network.tensors.preset {tensors.preset}: {k!r}")]
        mine: dict[str, list[MapEntry]] = {}
        for e in tensors.map:  # the spec's entries replace the preset's for the same source
            mine.setdefault(e.source, []).append(e)
        for k, es in mine.items():
            where = f"network.tensors.map[{k!r}]"
            table[k] = [(e, where + (f"[{n}]" if len(es) > 1 else "")) for n, e in enumerate(es)]
        self.prefix = tensors.prefix
        indexed = {k for k in table if "{i}" in k or "{e}" in k}
        self.exact = {k: v for k, v in table.items() if k not in indexed}
        self.rules = [(self._compile(k), v) for k, v in table.items() if k in indexed]
        # ignore entries: {i} / {e} as in the map, and * for any run of characters (a glob)
        self.ignore_patterns = tensors.ignore
        self.ignore = [self._compile(p, glob=True) for p in tensors.ignore]
        self.ignore_hits: set[int] = set()  # which ignore entries matched a tensor

    @staticmethod
    def _compile(pattern: str, glob: bool = False) -> re.Pattern[str]:
        regex = re.escape(pattern)
        if glob:
            regex = regex.replace(r"\*", ".*")
        for key, placeholder in _INDEX.items():
            if pattern.count("{" + key + "}") > 1:
                raise SpecError(f"network.tensors: {pattern!r} may hold at most one {{{key}}}")
            regex = placeholder.sub(f"(?P<{key}>\\\\d+)", regex)
        return re.compile(regex + r"\Z")

    def __call__(self, name: str) -> list[Use] | None:
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        hit = self.exact.get(name)
        if hit is not None:  # (a target's {i} stays: the source feeds every layer)
            return [Use(e.target, e, where) for e, where in hit]
        for pattern, uses in self.rules:
            m = pattern.match(name)
            if m:
                found = {k: v for k, v in m.groupdict().items() if v is not None}
                return [Use(_fill(e.target, found), e, w) for e, w in uses]
        return None

    def ignored(self, name: str) -> bool:
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        hits = [n for n, p in enumerate(self.ignore) if p.match(name)]
        self.ignore_hits.update(hits)
        return bool(hits)

    def unmatched_ignores(self) -> list[str]:
        """The ignore entries that matched no tensor so far."""
        return [p for n, p in enumerate(self.ignore_patterns) if n not in self.ignore_hits]
