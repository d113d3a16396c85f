"""A spec as frozen dataclasses: what the network is made of plus the resolved numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferflow.blocks.attention import AttentionOptions
from inferflow.blocks.linear import EmbeddingOptions, OutputOptions
from inferflow.blocks.options import NoOptions, Options
from inferflow.blocks.residual import GateOptions
from inferflow.errors import SpecError
from inferflow.tokenizer.pipeline import PipelineSpec


@dataclass(frozen=True)
class MapEntry:
    """One checkpoint -> canonical tensor rule. ``{i}`` is the layer index; a source without
    ``{i}`` mapped to a target with it feeds every layer (shared weights). ``{e}`` is an
    expert's index (MoE); a source without ``{e}`` mapped to a target with it stacks the
    experts along its first axis: expert e takes ``t[e]`` (``pick``, set by the binding).
    With ``per_layer``, a source without ``{i}`` stacks the layers along its first axis instead
    (a ``[n_layers]`` vector of per-layer scalars): layer i takes ``t[i]``.
    Several entries of one source: the stored tensor feeds several targets. The steps apply
    in this order (after ``pick``):

    - ``transpose``: swap the two axes (GPT-2's Conv1D stores (in, out));
    - ``slice`` (axis, start, stop): ``t[start:stop]`` along ``axis``;
    - ``chunk`` (axis, parts, index): cut into ``parts`` equal pieces along ``axis``, keep piece
      ``index`` (a fused [q; k; v] in_proj_weight: parts 3, index 0, 1 or 2);
    - ``rope_rows`` (heads, to): each of ``heads`` heads' rows (a number, or ``n_heads`` /
      ``n_kv_heads`` of the target's stack) reordered between the rope layouts: ``to: half``
      takes llama.cpp's permuted q / k rows (adjacent pairs) back to HF's (halves), ``to:
      adjacent`` the other way;
    - ``reshape``: to these dims (one may be -1; unit axes are dropped or added as needed);
    - ``scale``: multiply by a constant;
    - ``pad`` (axis, size): zeros appended along ``axis`` up to ``size`` (a vocabulary the
      network rounds up);
    - ``rows`` (start, stop): the result fills rows [start, stop) of the target, whose other rows
      come from other tensors (several tensors concatenated along the first axis: a vocabulary
      or a projection stored in shards); every row must be given exactly once."""

    source: str
    target: str
    transpose: bool = False
    slice: tuple[int, int, int] | None = None
    chunk: tuple[int, int, int] | None = None
    reshape: tuple[int, ...] | None = None
    scale: float | None = None
    pad: tuple[int, int] | None = None
    rope_rows: tuple[int | str, str] | None = None  # (heads, to): each head's rows reordered
    rows: tuple[int, int] | None = None  # fills rows [start, stop) of the target
    pick: int | None = None  # index along the first axis (dropped): a stacked expert's
    # the source stacks one value per layer along its first axis: layer i takes element i
    per_layer: bool = False

    def __post_init__(self) -> None:
        where = f"network.tensors.map[{self.source!r}]"
        if self.chunk is not None and not 0 <= self.chunk[2] < self.chunk[1]:
            raise SpecError(
                f"{where}: chunk index {self.chunk[2]} is not in 0..{self.chunk[1] - 1} "
                f"(parts {self.chunk[1]})"
            )
        if self.rows is not None and not 0 <= self.rows[0] < self.rows[1]:
            raise SpecError(
                f"{where}: rows start {self.rows[0]} and stop {self.rows[1]}: need "
                "0 <= start < stop"
            )
        if self.slice is not None and not 0 <= self.slice[1] < self.slice[2]:
            raise SpecError(
                f"{where}: slice start {self.slice[1]} and stop {self.slice[2]}: need "
                "0 <= start < stop"
            )
        if self.per_layer and ("{i}" in self.source or "{i}" not in self.target):
            raise SpecError(
                f"{where}: per_layer takes element i of a stored per-layer tensor for layer i: "
                f"the source must have no {{i}} and the target {self.target!r} must have one"
            )
        for index, what in (("{i}", "layer"), ("{e}", "expert")):
            if index in self.source and index not in self.target:
                raise SpecError(
                    f"{where}: the source has {index} but the target {self.target!r} does "
                    f"not; every {what}'s tensor would land in one place"
                )

    @property
    def as_stored(self) -> bool:
        """The tensor lands as stored: no step changes it."""
        steps = (
            self.pick,
            self.slice,
            self.chunk,
            self.rope_rows,
            self.reshape,
            self.scale,
            self.pad,
        )
        return not self.transpose and all(x is None for x in steps)


@dataclass(frozen=True)
class TensorsSpec:
    preset: str | None = None
    prefix: str = ""  # stripped from checkpoint names before mapping
    map: tuple[MapEntry, ...] = ()
    ignore: tuple[str, ...] = ()  # checkpoint names (with {i}) that are expected and unused


@dataclass(frozen=True)
class SourceSpec:
    format: str
    files: tuple[Path, ...]
    config: Path | None = None  # HF config.json for hyperparameters (safetensors / pickle)
    # a pickle checkpoint's top-level dict(s) of tensors to read (several: names "key.name")
    keys: tuple[str, ...] = ()
    # the pickle checkpoint's own dict of hyperparameters (a dotted top-level key), in place of
    # a config.json
    config_key: str | None = None


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # a TOKENIZER_KINDS name, 'pipeline' (the spec's own parts) or 'none'
    files: tuple[Path, ...] = ()
    chat_template: str | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    pattern: str | None = None  # the regex a kind that takes one cuts text with
    # the spec's own pipeline parts (normalizer, pre-tokenizer, model, specials, template,
    # decoder), laid over what the kind gives
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)


AttentionSpec = AttentionOptions  # network.attention (declared once, next to the block)


@dataclass(frozen=True)
class NetworkSpec:
    type: str
    norm: str
    activation: str
    ffn: str
    residual: str
    # network.position: one mechanism, or several at once (their embeddings and biases add)
    positions: tuple[tuple[str, Options], ...]  # (block name, its options)
    attention: AttentionSpec
    tensors: TensorsSpec
    ffn_bias: bool = False
    ffn_options: Options = NoOptions()  # the FFN block's own (its class's Options)
    gates: GateOptions = GateOptions()  # learned scalars on the residual stream
    head: str | None = None  # a task head (inferflow.blocks.head): classify
    head_options: Options = NoOptions()
    embedding: EmbeddingOptions = EmbeddingOptions()
    output: OutputOptions = OutputOptions()
    final_norm: bool = True  # a norm after the last layer of each stack


@dataclass(frozen=True)
class HParams:
    """Numbers the checkpoint knows; derived defaults are filled here, in one place."""

    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    ffn_hidden: int = 0  # 0: 4 * hidden
    embed_dim: int = 0  # width of the embedding tables; 0: hidden (factorised: narrower)
    n_kv_heads: int = 0  # 0: same as n_heads (MHA); 1: MQA; else GQA
    head_dim: int = 0  # 0: hidden // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_partial: float = 1.0
    rotary_dim: int = 0  # 0: round(head_dim * rope_partial)
    rope_scaling: dict[str, Any] | None = None
    max_positions: int = 2048
    sliding_window: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    decoder_start_id: int | None = None  # encoder-decoder: the decoder's first input token
    n_enc_layers: int = 0  # encoder-decoder: 0 means n_layers
    type_vocab_size: int = 2
    rel_buckets: int = 32  # relative position bias (T5)
    rel_max_distance: int = 128
    # mixture of experts (ffn: moe): experts, experts per token, each expert's width (0:
    # ffn_hidden), the shared expert's width (0: none), and whether the chosen experts'
    # probabilities are renormalised to sum to 1
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    moe_normalize: bool = True
    labels: tuple[str, ...] = ()  # a classification head's labels, in output order (id2label)

    def __post_init__(self) -> None:
        for k in ("vocab_size", "hidden", "n_layers", "n_heads"):
            if getattr(self, k) <= 0:
                raise SpecError(f"hparams.{k}: must be positive, got {getattr(self, k)}")
        if self.ffn_hidden == 0:  # GPT-2's n_inner: null means 4 * hidden
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        object.__setattr__(self, "labels", tuple(map(str, self.labels)))
        if self.expert_ffn_hidden == 0:
            object.__setattr__(self, "expert_ffn_hidden", self.ffn_hidden)
        if self.embed_dim == 0:
            object.__setattr__(self, "embed_dim", self.hidden)
        if self.head_dim == 0:
            if self.hidden % self.n_heads:
                raise SpecError(
                    f"hparams: hidden {self.hidden} is not divisible by n_heads {self.n_heads}; set hparams.head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise SpecError(
                f"hparams: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.n_enc_layers == 0:
            object.__setattr__(self, "n_enc_layers", self.n_layers)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", round(self.head_dim * self.rope_partial))
        if not math.isfinite(self.norm_eps) or self.norm_eps <= 0:
            raise SpecError(f"hparams.norm_eps: must be a positive number, got {self.norm_eps}")

    @property
    def attention_kind(self) -> str:
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None


@dataclass(frozen=True)
class QuantSpec:
    """Runtime weight quantization: a default format and ordered (glob, format) overrides over
    canonical module paths (``dec.output``, ``dec.*.feed_forward.*``); None keeps float."""

    weights: str | None = None
    overrides: tuple[tuple[str, str | None], ...] = ()
    # "keep": linear weights a checkpoint already stores quantized (GGUF Q4_1, Q8_0 ...) stay in
    # their blocks where a fast kernel reads them, when ``weights`` is unset; "dequantize": float
    checkpoint: str = "keep"
    # the matmul kernel of quantized layers: None picks the C plane (float32 on the codes) where
    # it builds; "dequant" dequantizes row tiles per call (float32), "int4pack" is torch's
    # kernel (bf16 activations)
    kernel: str | None = None
    # int4pack layers also keep a dense bf16 copy, used by calls of at least this many rows
    # (batched decode, prefill): faster from ~16 rows, 2 more bytes per weight. None: off
    dense_batch: int | None = None
    # how a runtime format's codes are chosen (inferflow.quant.METHODS), as `inferflow quantize`
    # chooses them: "search" (least squared error), "minmax" (the format's own rule)
    method: str = "search"
    # an importance matrix of this checkpoint (inferflow.imatrix) weighting the search's error
    imatrix: Path | None = None


PARTITION_STRATEGIES = ("layer", "tensor", "hybrid")
EMBEDDING_PLACES = ("device", "host")


@dataclass(frozen=True)
class PartitionSpec:
    """How a model is split across devices (inferflow.parallel.layout resolves it).

    Either ``devices`` ("0&1;2&3": ';' separates layer groups, '&' joins the tensor-parallel
    devices of a group) or the explicit form: ``strategy`` with ``layer_groups`` and/or
    ``tensor_parallel`` on ``device`` (cpu | cuda). ``layers``: the layer count of each group
    for an uneven split; ``cpu_layers``: the first N layers on the CPU, the rest on cuda:0.
    ``embeddings: host`` keeps the embedding table in host memory."""

    devices: str | None = None
    strategy: str | None = None
    layer_groups: int | None = None
    tensor_parallel: int | None = None
    device: str | None = None
    layers: tuple[int, ...] = ()
    cpu_layers: int | None = None
    embeddings: str = "device"


# how an embedding is pooled from the final hidden states: the mean over the tokens, the first
# token's state (BERT's [CLS]), the last token's, or none (one vector per token)
POOLINGS = ("mean", "cls", "last", "none")


@dataclass(frozen=True)
class Spec:
    name: str
    path: Path | None
    source: SourceSpec
    tokenizer: TokenizerSpec
    network: NetworkSpec
    hparams: HParams
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    quant: QuantSpec = field(default_factory=QuantSpec)
    description: str = ""
    embedding_pooling: str | None = None  # one of POOLINGS: served on /v1/embeddings
    embedding_normalize: bool = True  # L2-normalise pooled embeddings
    partition: PartitionSpec | None = None  # None: one process, one device
    # an encoder-decoder's encoder, where its numbers differ (its own vocabulary, layers,
    # heads, widths: config.json's src_vocab_size / encoder_* keys, or hparams.encoder)
    enc_hparams: HParams | None = None
    # an encoder-decoder's source-side tokenizer where it differs (tokenizer: {source, target});
    # ``tokenizer`` is then the target side
    source_tokenizer: TokenizerSpec | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def encoder_hparams(self) -> HParams:
        """The encoder stack's numbers (an encoder-only network's are ``hparams``)."""
        return self.enc_hparams if self.enc_hparams is not None else self.hparams
