"""A Hugging Face model directory seen as a llama.cpp GGUF: what ``convert`` and ``quantize``
write when asked for a ``.gguf`` from ``config.json`` + weights + ``tokenizer.json``.

Everything here is derived from data the project already has, so there is no table per model:

- the architecture: config.json's ``model_type`` names the HF template ``specs/arch/<type>.yaml``
  and the GGUF template ``specs/gguf/<type>.yaml`` (or the one ``GGUF_ARCHITECTURES`` names:
  mistral is a llama GGUF); the two networks must agree in everything but tensor names, rope
  pairing and an attention window llama.cpp has no place for (logged as dropped where it
  binds); another difference is refused, naming the settings that differ;
- tensor names: the HF template's preset and ``map`` rules (renames, transposed or not: GPT-2's
  Conv1D) take each checkpoint name to a canonical one, the GGUF template's preset and renames
  take canonical names back to llama.cpp's;
- norm weights: where the two templates' norms are RMS norms scaling by different offsets + w
  (Gemma's HF ``rms_offset`` stores w - 1, llama.cpp's ``rms`` w), the difference is added;
- rope pairing: where the HF template rotates halves and the GGUF template adjacent pairs
  (llama), the q/k rows of every head are reordered as llama.cpp's converter does;
- hyperparameters: config.json read through ``HF_CONFIG_KEYS`` and written under ``GGUF_KEYS``
  (a norm's epsilon under the RMS or the LayerNorm key, as the GGUF template's norm is);
- tokenizer: a BPE ``tokenizer.json``, byte-level (tokens, types, merges, the pre-tokenizer's
  llama.cpp name) or sentencepiece's (byte fallback, '▁' for spaces: llama.cpp's 'llama' model,
  scores in the merges' order, whether a '▁' goes first), special ids and the chat template
  from ``tokenizer_config.json``.

What has no place in the GGUF is logged as dropped (unmapped tensors, rope scaling, a tokenizer
of another kind).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from inferflow.blocks.norm import NORMS, RMSNorm
from inferflow.errors import CheckpointError
from inferflow.loaders.base import Weight, WeightSource
from inferflow.loaders.gguf import GGUFValueType as V
from inferflow.model.binding import rope_rows
from inferflow.model.names import PRESETS, NameMap
from inferflow.paths import read_json
from inferflow.spec import BUILTIN_DIR, GGUF_TEMPLATES, _network, read_doc
from inferflow.spec.hparams import GGUF_KEYS, from_hf_config
from inferflow.spec.types import MapEntry
from inferflow.tokenizer.gguf_vocab import BPE_PRE_TOKENIZER_SPLITS

logger = logging.getLogger(__name__)

# our hyperparameter name -> GGUF value type (llama.cpp checks the type of what it reads)
HPARAM_TYPES: dict[str, int] = {
    "vocab_size": V.UINT32,
    "hidden": V.UINT32,
    "n_layers": V.UINT32,
    "n_heads": V.UINT32,
    "n_kv_heads": V.UINT32,
    "head_dim": V.UINT32,
    "ffn_hidden": V.UINT32,
    "norm_eps": V.FLOAT32,
    "rope_theta": V.FLOAT32,
    "max_positions": V.UINT32,
}  # (bos / eos ids are the tokenizer's keys: tokenizer_metadata writes them)
# GGUF token types (gguf-py TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6
MAX_TOKENIZER_JSON_BYTES = 1 << 28  # Gemma-3's tokenizer.json is 33 MB
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # a byte-fallback token
_UNMERGED = -1e9  # the score of a sentencepiece token no merge makes (a single character)
_GPT2_BYTE_LEVEL = BPE_PRE_TOKENIZER_SPLITS["gpt-2"]  # ByteLevel(use_regex=True)'s own split
_DIGITS = r"\p{N}"  # Digits(individual_digits=True)
_LAYER = re.compile(r"\w+\.(\d+)\.")  # a canonical name's layer index


@dataclasses.dataclass(frozen=True)
class _Rename:
    gguf: str
    permute_heads: int = 0  # > 0: reorder rows from half to adjacent rope pairs, per head
    offset: float = 0.0  # added to a norm's weights (another norm kind's layout)
    transpose: bool = False  # stored (in, out), as GPT-2's Conv1D


# Hugging Face model types llama.cpp runs as another architecture (its convert_hf_to_gguf.py
# writes them so): model_type -> the GGUF's general.architecture, whose template and keys apply
GGUF_ARCHITECTURES: dict[str, str] = {"mistral": "llama"}


def gguf_architecture(config: dict[str, Any], where: str) -> tuple[str, str]:
    """(HF template, GGUF architecture) of a config.json: its ``model_type`` (under
    ``GGUF_ARCHITECTURES``' name where llama.cpp has another), where both templates exist."""
    kind = config.get("model_type")
    arch_dir = BUILTIN_DIR / "arch"
    targets = {p.stem: p.stem for p in GGUF_TEMPLATES.glob("*.yaml")} | GGUF_ARCHITECTURES
    known = {
        hf: gguf
        for hf, gguf in targets.items()
        if (arch_dir / f"{hf}.yaml").is_file() and (GGUF_TEMPLATES / f"{gguf}.yaml").is_file()
    }
    if not isinstance(kind, str) or kind not in known:
        raise CheckpointError(
            f"{where}: config.json model_type {str(kind)[:64]!r} has no llama.cpp GGUF template; "
            f"convertible to a llama.cpp GGUF: {', '.join(sorted(known))}"
        )
    return kind, known[kind]


def _networks(hf: str, arch: str) -> tuple[Any, Any]:
    """The networks of the HF template ``hf`` and the GGUF template of ``arch``."""
    hf_doc = read_doc(BUILTIN_DIR / "arch" / f"{hf}.yaml")["network"]
    gguf_doc = read_doc(GGUF_TEMPLATES / f"{arch}.yaml")["network"]
    return _network(hf_doc), _network(gguf_doc)


def _pairings(net: Any) -> tuple[str, ...]:
    return tuple(getattr(o, "pairing", "") for _, o in net.positions)


def _comparable(net: Any, window: Any) -> Any:
    """``net`` without what a conversion may change: tensor names, rope pairing, the head's
    tying, and the attention window (set to ``window``: the one llama.cpp's architecture has;
    a window the GGUF cannot keep is reported as dropped, ``_hparam_metadata``)."""
    positions = tuple((n, o) for n, o in net.positions if not hasattr(o, "pairing"))
    attention = dataclasses.replace(net.attention, sliding_window=window)
    return dataclasses.replace(
        net, positions=positions, tensors=None, output=None, attention=attention
    )


def _norm_offset(hf: str | None, gguf: str | None) -> float | None:
    """What a norm weight of kind ``hf`` needs added to be one of kind ``gguf``: nothing for the
    same kind, the offsets' difference for two RMS norms (scale by offset + w); None: no way."""
    if hf == gguf:
        return 0.0
    a, b = NORMS.get(hf) if hf else None, NORMS.get(gguf) if gguf else None
    rms = [isinstance(c, type) and issubclass(c, RMSNorm) for c in (a, b)]
    return float(a.offset - b.offset) if all(rms) else None  # type: ignore[union-attr]


def _plain_names(tensors: Any, arch: str) -> dict[str, str]:
    """A GGUF template's names -> canonical ones: its preset, with its map's renames replacing
    the preset's rule for the same name (GPT-2's ffn_up is a plain FFN's w1, not a gate's w3)."""
    table = dict(PRESETS.get(str(tensors.preset))) if tensors.preset else {}
    for e in tensors.map:
        if e != MapEntry(e.source, e.target):
            raise CheckpointError(f"specs/gguf/{arch}.yaml: {e.source!r} is not a plain rename")
        table[e.source] = e.target
    return table


def _renames(
    hf: str, arch: str, hf_net: Any, gguf_net: Any, names: list[str], hp: dict[str, Any], tied: bool
) -> dict[str, _Rename]:
    qk_gguf = gguf_net.attention.qk_norm
    offsets = {
        "norm": _norm_offset(hf_net.norm, gguf_net.norm),
        "qk": _norm_offset(hf_net.attention.qk_norm, qk_gguf),
    }  # a norm convertible by an offset compares as llama.cpp's; another stays a difference
    if offsets["norm"] is not None:
        hf_net = dataclasses.replace(hf_net, norm=gguf_net.norm)
    if offsets["qk"] is not None:
        attention = dataclasses.replace(hf_net.attention, qk_norm=qk_gguf)
        hf_net = dataclasses.replace(hf_net, attention=attention)
    window = gguf_net.attention.sliding_window
    a, b = _comparable(hf_net, window), _comparable(gguf_net, window)
    if a != b:
        diff = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
        raise CheckpointError(
            f"{hf}: the Hugging Face network (specs/arch/{hf}.yaml) differs from llama.cpp's "
            f"(specs/gguf/{arch}.yaml) in: {', '.join(diff)}; a GGUF of it would not run the same"
        )
    permute = _pairings(hf_net) != _pairings(gguf_net)
    if permute and hp.get("rope_partial", 1.0) != 1.0:
        raise CheckpointError(f"{hf}: partial rotary with a rope pairing change is unsupported")
    to_gguf = {v: k for k, v in _plain_names(gguf_net.tensors, arch).items()}
    heads = {"wq": int(hp["n_heads"]), "wk": int(hp.get("n_kv_heads") or hp["n_heads"])}
    name_map = NameMap(hf_net.tensors)
    out: dict[str, _Rename] = {}
    for name in names:  # the checkpoint's order
        uses = name_map(name)
        if not uses:
            continue
        e = uses[0].entry
        if len(uses) > 1 or e != MapEntry(e.source, e.target, transpose=e.transpose):
            raise CheckpointError(
                f"{name}: mapped by {uses[0].origin} with steps or to several tensors; only "
                "one-to-one renames (transposed or not) convert to a GGUF yet"
            )
        canon = uses[0].target
        target = to_gguf.get(e.target)
        if target is None or (tied and canon == "dec.output.weight"):
            continue
        m = _LAYER.match(canon)
        layer = m.group(1) if m else None
        module = canon.split(".")[-2]
        n = heads.get(module, 0) if permute else 0
        is_norm = module.endswith("norm") and canon.endswith(".weight")
        offset = offsets["qk" if module in ("q_norm", "k_norm") else "norm"] if is_norm else 0.0
        gguf = target.replace("{i}", layer) if layer else target
        out[name] = _Rename(gguf, n, offset or 0.0, e.transpose)
    return out


def _hparam_metadata(
    arch: str, gguf_net: Any, hp: dict[str, Any], config: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], list[str]]:
    meta: dict[str, Any] = {"general.architecture": arch}
    types: dict[str, tuple[int, ...]] = {"general.architecture": (V.STRING,)}
    dropped: list[str] = []
    norm = NORMS.get(gguf_net.norm)
    rms = isinstance(norm, type) and issubclass(norm, RMSNorm)
    for ours, keys in GGUF_KEYS.items():
        if ours in hp and ours in HPARAM_TYPES and not isinstance(hp[ours], (list, dict)):
            # the norm's epsilon under the key llama.cpp reads for the GGUF's kind of norm
            key = keys[0 if rms or len(keys) == 1 else 1].format(arch=arch)
            vtype = HPARAM_TYPES[ours]
            meta[key] = float(hp[ours]) if vtype == V.FLOAT32 else int(hp[ours])
            types[key] = (vtype,)
    head_dim = int(hp.get("head_dim") or hp["hidden"] // hp["n_heads"])
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        meta[f"{arch}.{key}"], types[f"{arch}.{key}"] = head_dim, (V.UINT32,)
    if "rope_scaling" in hp:
        raise CheckpointError(
            f"config.json rope scaling {hp['rope_scaling'].get('type')!r}: writing rope scaling "
            "to a GGUF is not supported yet"
        )
    window, positions = config.get("sliding_window"), config.get("max_position_embeddings")
    binds = positions is None or window is not None and window < positions
    if window and config.get("use_sliding_window", True) and binds:
        dropped.append(
            f"sliding_window={window} (llama.cpp's {arch} has none: past {window} tokens it "
            "attends to more than the model did)"
        )
    return meta, types, dropped


def _pre_tokenizer(pre: Any) -> tuple[str, ...]:
    """The split regexes of a tokenizer.json pre_tokenizer, as llama.cpp applies them."""
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    out: list[str] = []
    for s in steps:
        kind = s.get("type")
        if kind == "Split" and s.get("behavior") == "Isolated" and "Regex" in s.get("pattern", {}):
            out.append(s["pattern"]["Regex"])
        elif kind == "Digits" and s.get("individual_digits"):
            out.append(_DIGITS)
        elif kind == "ByteLevel":
            if s.get("use_regex", True):
                out.extend(_GPT2_BYTE_LEVEL)
        else:
            raise CheckpointError(f"pre-tokenizer step {kind!r}")
    return tuple(out)


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def _byte_level_keys(tj: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's model and pre-tokenizer keys of a byte-level BPE tokenizer.json."""
    try:
        splits = _pre_tokenizer(tj.get("pre_tokenizer") or {})
    except CheckpointError as e:
        raise CheckpointError(f"its {e}, which llama.cpp has no name for") from None
    pre = next((k for k, v in BPE_PRE_TOKENIZER_SPLITS.items() if v == splits), None)
    if pre is None or pre == "default":
        raise CheckpointError("a pre-tokenizer llama.cpp has no name for")
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre}


def _steps(part: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(part, dict):
        return []
    return list(part.get(key, [])) if part.get("type") == "Sequence" else [part]


def _sentencepiece_keys(tj: dict[str, Any], tokens: list[str], merges: list[str]) -> dict[str, Any]:
    """llama.cpp's keys of a sentencepiece BPE tokenizer.json (byte fallback, '▁' for spaces):
    model 'llama', whether a '▁' goes first, and scores ranking each token by the first merge
    that makes it (llama.cpp merges by score, sentencepiece by the same order the merges keep)."""
    space = prefix = False
    for step in _steps(tj.get("normalizer"), "normalizers"):
        pattern = step.get("pattern", {}).get("String")
        if step.get("type") == "Replace" and pattern == " " and step.get("content") == "▁":
            space = True
        elif step.get("type") == "Prepend" and step.get("prepend") == "▁":
            prefix = True
        else:
            raise CheckpointError(f"a normalizer step {step.get('type')!r}")
    for step in _steps(tj.get("pre_tokenizer"), "pretokenizers"):
        kind = step.get("type")
        if kind == "Metaspace" and step.get("replacement") == "▁" and not step.get("split"):
            space, prefix = True, prefix or step.get("prepend_scheme", "always") != "never"
        # a Split on " " after the normalizer spelled spaces '▁' splits nothing
        elif not (kind == "Split" and space and step.get("pattern") == {"String": " "}):
            raise CheckpointError(f"a pre-tokenizer step {kind!r}")
    if not space:
        raise CheckpointError("spaces not spelled '▁'")
    ids = {t: i for i, t in enumerate(tokens)}
    scores = [_UNMERGED] * len(tokens)
    for rank, merge in enumerate(merges):
        i = ids.get(merge.replace(" ", "", 1))
        if i is not None and scores[i] == _UNMERGED:
            scores[i] = -float(rank)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.add_space_prefix": prefix,
    }


def tokenizer_metadata(
    directory: Path, vocab_size: int, hp: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], list[str]]:
    """llama.cpp's tokenizer.* keys from a BPE tokenizer.json, byte-level or sentencepiece's
    (byte fallback), with its config's special tokens and chat template."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return {}, {}, [f"the tokenizer ({path.name} not found; llama.cpp needs one to run)"]
    tj = read_json(path, MAX_TOKENIZER_JSON_BYTES)
    model = tj.get("model", {}) if isinstance(tj, dict) else {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type")
        return {}, {}, [f"the tokenizer (a {kind!r} tokenizer.json; only BPE)"]
    spm = bool(model.get("byte_fallback"))
    added = {int(a["id"]): a for a in tj.get("added_tokens", [])}
    n = max(vocab_size, len(model["vocab"]), max(added, default=-1) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    for tok, i in model["vocab"].items():
        tokens[i], types[i] = tok, BYTE if spm and _BYTE_TOKEN.fullmatch(tok) else NORMAL
    for i, a in added.items():
        tokens[i], types[i] = a["content"], CONTROL if a.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    try:
        keys = _sentencepiece_keys(tj, tokens, merges) if spm else _byte_level_keys(tj)
    except CheckpointError as e:
        return {}, {}, [f"the tokenizer ({e})"]
    meta: dict[str, Any] = keys | {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,  # (llama.cpp ranks sentencepiece merges by the scores)
    }
    vt: dict[str, tuple[int, ...]] = {
        "tokenizer.ggml.model": (V.STRING,),
        "tokenizer.ggml.pre": (V.STRING,),
        "tokenizer.ggml.tokens": (V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": (V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.add_space_prefix": (V.BOOL,),
    }
    vt = {k: v for k, v in vt.items() if k in meta}
    cfg = _read_optional_json(directory / "tokenizer_config.json")
    ids = {a["content"]: i for i, a in added.items()}
    for role in ("bos", "eos", "unk", "pad"):
        tid = hp.get(f"{role}_id")
        spelled = cfg.get(f"{role}_token")
        spelled = spelled.get("content") if isinstance(spelled, dict) else spelled
        if tid is None and isinstance(spelled, str):
            tid = ids.get(spelled, model["vocab"].get(spelled))
        if tid is not None:
            meta[f"tokenizer.ggml.{role}_token_id"] = int(tid)
            vt[f"tokenizer.ggml.{role}_token_id"] = (V.UINT32,)
    post = tj.get("post_processor") or {}
    single = post.get("single", []) if post.get("type") == "TemplateProcessing" else []
    add_bos = cfg.get("add_bos_token", bool(single) and "SpecialToken" in single[0])
    meta["tokenizer.ggml.add_bos_token"], vt["tokenizer.ggml.add_bos_token"] = (
        bool(add_bos),
        (V.BOOL,),
    )
    template = cfg.get("chat_template")
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        meta["tokenizer.chat_template"], vt["tokenizer.chat_template"] = template, (V.STRING,)
    return meta, vt, []


class HFAsGGUF:
    """An HF directory's weights under llama.cpp's names, with the GGUF metadata of the model:
    a WeightSource that ``write_gguf_from`` treats as a GGUF source."""

    def __init__(self, directory: Path, source: WeightSource) -> None:
        self.directory = directory
        self._inner = source
        config = source.metadata.get("config")
        if not isinstance(config, dict):
            raise CheckpointError(f"{directory}: no config.json, so no architecture for the GGUF")
        hf, arch = gguf_architecture(config, str(directory))
        hp = from_hf_config(config)
        for need in ("vocab_size", "hidden", "n_layers", "n_heads"):
            if need not in hp:
                raise CheckpointError(f"{directory}/config.json: no {need} value")
        names = source.names()
        tied = bool(config.get("tie_word_embeddings", False))
        hf_net, gguf_net = _networks(hf, arch)
        self._renames = _renames(hf, arch, hf_net, gguf_net, names, hp, tied)
        self.metadata, self.metadata_types, dropped = _hparam_metadata(arch, gguf_net, hp, config)
        meta, vt, lost = tokenizer_metadata(directory, int(hp["vocab_size"]), hp)
        self.metadata |= meta | {"general.name": directory.name}
        self.metadata_types |= vt | {"general.name": (V.STRING,)}
        dropped += lost + [f"tensor {n}" for n in names if n not in self._renames]
        self._names = {r.gguf: n for n, r in self._renames.items()}
        self.dropped = dropped
        for d in dropped:
            logger.warning("dropped: %s", d)

    def names(self) -> list[str]:
        return list(self._names)

    def source_name(self, name: str) -> str:
        """The checkpoint's own name of the GGUF tensor ``name``."""
        return self._names[name]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._inner.shape(self._names[name])
        return shape[::-1] if self._renames[self._names[name]].transpose else shape

    def dtype_name(self, name: str) -> str:
        return self._inner.dtype_name(self._names[name])

    def get(self, name: str) -> Weight:
        src = self._names[name]
        w = self._inner.get(src)
        heads = self._renames[src].permute_heads
        if heads:
            if not isinstance(w, torch.Tensor):
                raise CheckpointError(f"{src}: a quantized q/k tensor cannot be re-paired for rope")
            if w.shape[0] % (2 * heads):
                raise CheckpointError(
                    f"{src}: {w.shape[0]} rows do not split into {heads} heads (config.json) of "
                    "an even size"
                )
            w = rope_rows(w, heads, "adjacent").contiguous()
        if self._renames[src].transpose:
            if not isinstance(w, torch.Tensor):
                raise CheckpointError(f"{src}: a quantized (in, out) tensor cannot be transposed")
            w = w.t().contiguous()
        offset = self._renames[src].offset
        if offset:
            if not isinstance(w, torch.Tensor):
                raise CheckpointError(f"{src}: a quantized norm weight cannot take its offset")
            w = w.float() + offset
        return w

    def __iter__(self) -> Iterator[tuple[str, Weight]]:
        return ((n, self.get(n)) for n in self._names)

    def close(self) -> None:
        self._inner.close()
