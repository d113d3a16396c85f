"""Analytic cost model of layer / tensor / hybrid layouts: the planner behind ``inferflow plan``.

A simplified form of Pope et al., "Efficiently Scaling Transformer Inference" (2022): each pass is
a roofline (time = max(bytes / bandwidth, FLOPs / compute)) for the linear layers plus one for
attention, plus the communication of the layout:

- tensor parallel (T ranks per stage): heads and FFN columns split T ways; 2 ring all-reduces per
  layer (1 for parallel-residual blocks) of tokens*hidden activations, each
  ``2(T-1)/T * bytes / link + latency``. KV heads split T ways, replicated when n_kv_heads < T
  (each rank holds max(1, n_kv_heads / T) KV heads and their K/V projections).
- layer parallel (P stages): layers split as evenly as possible (the first stages take the
  remainder); one send of tokens*hidden activations per stage boundary (``bytes / link +
  latency``). The embedding lives on the first stage and the output head on the last (a tied head
  is a second copy there), each replicated across that stage's T ranks.
- decode: ``batch`` is the number of concurrent sequences in total. A pipeline splits them into
  m = min(P, batch) micro-batches in flight; a sequence gets a token every
  ``max(sum of stage times, m * slowest stage time)`` (one step for P = 1), which is the per-token
  latency; throughput is batch / that.
- prefill: the batch's prompts of ``context`` tokens go through the stages one after another
  (no chunked pipelining); attention is causal.

Not counted: activations and workspace memory, norms and biases (well under 1% of the weights),
kernel efficiency (times are at the peak numbers given, so they are lower bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inferflow.blocks import RESIDUALS
from inferflow.blocks.split import TensorSplit
from inferflow.errors import RequestError, SpecError
from inferflow.model.stack import Layer
from inferflow.parallel.layout import split_problem, stage_layers
from inferflow.quant import FORMATS
from inferflow.spec.types import Spec

GiB = float(1 << 30)
OBJECTIVES = ("throughput", "latency")


@dataclass(frozen=True)
class Hardware:
    """One device and its links. Defaults: an A100-80GB-class GPU with NVLink."""

    memory_bytes: float = 80 * GiB
    bandwidth: float = 2000e9  # memory bandwidth, bytes/s (HBM2e ~2 TB/s)
    link: float = 300e9  # device-to-device bandwidth, bytes/s per direction (NVLink 3)
    link_latency: float = 10e-6  # seconds per collective or send (small NCCL all-reduce ~10 us)
    flops: float = 312e12  # dense bf16 matmul peak, FLOP/s

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "bandwidth", "link", "flops"):
            check_positive(name, getattr(self, name))
        if not (math.isfinite(self.link_latency) and self.link_latency >= 0):
            raise RequestError(f"link_latency: must be >= 0 seconds, got {self.link_latency}")


@dataclass(frozen=True)
class Estimate:
    layout: str  # "single" | "layer" | "tensor" | "hybrid"
    stages: int  # P
    tensor_parallel: int  # T
    devices: str  # device string, e.g. "0&1;2&3"
    memory_per_device: float  # bytes, the fullest device: weights + KV cache
    weights_per_device: float  # bytes, same device
    kv_per_device: float  # bytes, same device
    device_memory: float  # bytes available per device (what ``fits`` was judged against)
    fits: bool
    prefill_s: float  # whole batch's prompts, seconds
    decode_s: float  # seconds between two tokens of one sequence
    decode_tokens_per_s: float  # all sequences together
    note: str = ""  # why the layout is invalid; "" when valid

    @property
    def valid(self) -> bool:
        return not self.note


def check_positive(name: str, value: float) -> None:
    """RequestError naming ``name`` unless ``value`` is a finite number > 0."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise RequestError(f"{name}: must be a positive number, got {value!r}")


def _check(batch: int, context: int, weight_bits: float, act_bytes: float) -> None:
    for name, v in (("batch", batch), ("context", context)):
        if not isinstance(v, int) or v < 1:
            raise RequestError(f"{name}: must be an integer >= 1, got {v!r}")
    if not (isinstance(weight_bits, int | float) and 0 < weight_bits <= 64):
        raise RequestError(f"weight_bits: must be in (0, 64], got {weight_bits!r}")
    if not (isinstance(act_bytes, int | float) and 0 < act_bytes <= 8):
        raise RequestError(f"act_bytes: must be in (0, 8], got {act_bytes!r}")


def parse_weight_bits(text: str) -> float:
    """``"16"``, ``"4.5"`` or a quant format name (``q4_0``, ``Q8_0``): bits per weight."""
    try:
        return float(text)
    except ValueError:
        pass
    if text.upper() in FORMATS:
        return FORMATS.get(text.upper()).bits_per_weight
    raise RequestError(
        f"--weight-bits: {text!r} is neither a number nor a quant format; formats: "
        + ", ".join(FORMATS.names())
    )


def device_string(stages: int, tensor_parallel: int) -> str:
    """Devices 0..P*T-1 in P groups of T: ``0;1`` (layer), ``0&1`` (tensor), ``0&1;2&3``."""
    t = tensor_parallel
    return ";".join("&".join(str(s * t + j) for j in range(t)) for s in range(stages))


def layout_name(stages: int, tensor_parallel: int) -> str:
    if stages == 1 and tensor_parallel == 1:
        return "single"
    return "tensor" if stages == 1 else "layer" if tensor_parallel == 1 else "hybrid"


def layer_params(spec: Spec, tensor_parallel: int = 1) -> int:
    """Weights of one decoder layer held by one tensor-parallel rank (norms and biases left
    out): the matrices of the layer the model builds, on the meta device (nothing allocated)."""
    split = TensorSplit(0, tensor_parallel)
    with torch.device("meta"):
        layer = Layer(spec.network, spec.hparams, 0, None, split=split)
    return sum(p.numel() for p in layer.parameters() if p.dim() > 1)


def kv_bytes_per_token(spec: Spec, tensor_parallel: int = 1, kv_bytes: float = 2) -> float:
    """K and V of one token in one layer on one rank (KV heads replicated when fewer than
    ranks: inferflow.blocks.split)."""
    kv_heads = TensorSplit(0, tensor_parallel).kv_heads(spec.hparams.n_kv_heads)[1]
    return 2 * kv_heads * spec.hparams.head_dim * kv_bytes


def estimate(
    spec: Spec,
    stages: int,
    tensor_parallel: int,
    hw: Hardware,
    batch: int,
    context: int,
    weight_bits: float,
    act_bytes: float = 2,
) -> Estimate:
    """Memory per device and prefill / decode times of one P x T layout (see the module doc)."""
    if spec.network.type != "decoder_only":
        raise SpecError(f"plan: models decoder-only networks, not {spec.network.type!r}")
    _check(batch, context, weight_bits, act_bytes)
    for name, v in (("stages", stages), ("tensor_parallel", tensor_parallel)):
        if not isinstance(v, int) or v < 1:
            raise RequestError(f"{name}: must be an integer >= 1, got {v!r}")
    p, t, h = stages, tensor_parallel, spec.hparams
    name, devices = layout_name(p, t), device_string(p, t)
    problem = split_problem(spec, p, t)  # the rules `partition:` applies
    if problem:
        nan = math.nan
        return Estimate(
            name, p, t, devices, nan, nan, nan, hw.memory_bytes, False, nan, nan, nan, problem
        )

    wb = weight_bits / 8
    layer_p = layer_params(spec, t)
    table_p = h.vocab_size * h.hidden  # embedding or head, whole on each rank of its stage
    layer_w, table_w = layer_p * wb, table_p * wb
    kv_tok = kv_bytes_per_token(spec, t, act_bytes)
    q_dims = h.n_heads // t * h.head_dim
    # parallel-residual wirings sum attention and FFN before one all-reduce per layer
    n_ar = 0 if t == 1 else 1 if RESIDUALS.get(spec.network.residual).delta else 2
    layers = stage_layers(h.n_layers, p)
    last = p - 1

    def comm(nbytes: float) -> float:  # ring all-reduce
        return 2 * (t - 1) / t * nbytes / hw.link + hw.link_latency

    def stage_time(s: int, tokens: float, kv_moved: float, pairs: float, rows: float) -> float:
        """One stage's pass over ``tokens`` new tokens: KV bytes moved and (query, key) pairs
        per layer; ``rows`` logits rows on the last stage."""
        n = layers[s]
        w_read = n * layer_w + (table_w if s == last else 0.0)
        lin_flops = 2 * tokens * n * layer_p + (2 * rows * table_p if s == last else 0)
        time = max(w_read / hw.bandwidth, lin_flops / hw.flops)
        time += n * max(kv_moved * kv_tok / hw.bandwidth, 4 * pairs * q_dims / hw.flops)
        act = tokens * h.hidden * act_bytes
        time += n * n_ar * comm(act)
        if s != last:
            time += act / hw.link + hw.link_latency
        return time

    b, ctx = batch, context
    prefill = sum(stage_time(s, b * ctx, b * ctx, b * ctx * (ctx + 1) / 2, b) for s in range(p))
    m = min(p, b)
    mb = math.ceil(b / m)  # micro-batch size
    step = [stage_time(s, mb, mb * ctx, mb * ctx, mb) for s in range(p)]
    cycle = max(sum(step), m * max(step))

    def weights(s: int) -> float:
        has_head = s == last and not (spec.network.output.tied and p == 1)
        return layers[s] * layer_w + table_w * ((s == 0) + has_head)

    kv = [b * ctx * n * kv_tok for n in layers]
    worst = max(range(p), key=lambda s: weights(s) + kv[s])
    mem = weights(worst) + kv[worst]
    return Estimate(
        name, p, t, devices, mem, weights(worst), kv[worst], hw.memory_bytes,
        mem <= hw.memory_bytes, prefill, cycle, b / cycle,
    )  # fmt: skip


def plan(
    spec: Spec,
    n_devices: int,
    hw: Hardware,
    batch: int,
    context: int,
    weight_bits: float,
    act_bytes: float = 2,
) -> list[Estimate]:
    """Estimates for layer (N x 1), tensor (1 x N) and every hybrid P x T = N with P, T > 1."""
    if not isinstance(n_devices, int) or n_devices < 1:
        raise RequestError(f"devices: must be an integer >= 1, got {n_devices!r}")
    n = n_devices
    shapes = [(1, 1)] if n == 1 else [(n, 1), (1, n)]
    shapes += [(p, n // p) for p in range(2, n) if n % p == 0]
    out = [estimate(spec, p, t, hw, batch, context, weight_bits, act_bytes) for p, t in shapes]
    if n > 1 and len(shapes) == 2:
        nan = math.nan
        why = f"{n} devices have no split P x T with P, T > 1"
        out.append(Estimate("hybrid", 0, 0, "", nan, nan, nan, hw.memory_bytes, False, nan, nan, nan, why))  # fmt: skip
    return out


def recommend(
    estimates: list[Estimate], objective: str = "throughput"
) -> tuple[Estimate | None, str]:
    """The best layout that fits (highest decode throughput, or lowest per-token latency) and why."""
    if objective not in OBJECTIVES:
        raise RequestError(f"objective: {objective!r}; allowed: {', '.join(OBJECTIVES)}")
    valid = [e for e in estimates if e.valid]
    if not valid:
        why = "; ".join(f"{e.layout}: {e.note}" for e in estimates)
        return None, f"no layout can split this model ({why})"
    fit = [e for e in valid if e.fits]
    if not fit:
        e = min(valid, key=lambda e: e.memory_per_device)
        missing = e.memory_per_device - e.device_memory
        return None, (
            f"no layout fits in {e.device_memory / GiB:.2f} GiB per device: the smallest, "
            f"{e.layout} ({e.devices}), needs {e.memory_per_device / GiB:.2f} GiB, "
            f"{missing / GiB:.2f} GiB missing; add devices, quantize (--weight-bits) or shorten "
            "--batch / --context"
        )

    def key(e: Estimate) -> tuple[float, float]:
        if objective == "throughput":
            return (-e.decode_tokens_per_s, e.decode_s)
        return (e.decode_s, -e.decode_tokens_per_s)

    ranked = sorted(fit, key=key)
    best = ranked[0]
    what = (
        f"highest decode throughput ({best.decode_tokens_per_s:,.0f} tokens/s)"
        if objective == "throughput"
        else f"lowest per-token latency ({best.decode_s * 1e3:.3f} ms)"
    )
    why = f"{best.layout} ({best.devices}): {what} of the {len(fit)} layouts that fit"
    if len(ranked) > 1:
        nxt = ranked[1]
        val = (
            f"{nxt.decode_tokens_per_s:,.0f} tokens/s"
            if objective == "throughput"
            else f"{nxt.decode_s * 1e3:.3f} ms"
        )
        why += f"; next: {nxt.layout} ({nxt.devices}) {val}"
    left_out = [e for e in valid if not e.fits]
    if left_out:
        why += "; do not fit: " + ", ".join(f"{e.layout} ({e.devices})" for e in left_out)
    return best, why
