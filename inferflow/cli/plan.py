"""``inferflow plan SPEC --devices N``: estimated memory per device, prefill and decode latency and
decode throughput of the layer / tensor / hybrid layouts of a model over N devices, and the one
to use.

The analytic model of Pope et al., "Efficiently Scaling Transformer Inference" (2022), simplified
(inferflow/parallel/cost.py says how). Defaults describe an A100-80GB-class GPU with NVLink; times
are at peak bandwidth and FLOP/s, so real runs are slower. Reads only the spec and the
checkpoint's header. Exit status 1 when no layout fits (or none can split the model).

    inferflow plan smollm2-135m-instruct --devices 4 --batch 64 --context 2048
    inferflow plan my-70b.yaml --devices 8 --weight-bits q4_k --objective latency
"""

from __future__ import annotations

import argparse
import math

from inferflow.errors import RequestError
from inferflow.parallel.cost import (
    OBJECTIVES,
    Estimate,
    GiB,
    Hardware,
    check_positive,
    parse_weight_bits,
    plan,
    recommend,
)
from inferflow.spec import load_spec

_HW = Hardware()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="estimate memory, latency and throughput of layer / tensor / hybrid layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.add_argument("--devices", type=int, required=True, help="number of devices N (>= 1)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences in total (default 1)")
    p.add_argument(
        "--context",
        type=int,
        default=2048,
        help="tokens per sequence: prompt length of the prefill, KV length of decode (default 2048)",
    )
    p.add_argument(
        "--device-memory",
        type=float,
        default=_HW.memory_bytes / GiB,
        help="memory per device in GiB (default %(default)g)",
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=_HW.bandwidth / 1e9,
        help="memory bandwidth per device in GB/s (default %(default)g, HBM2e)",
    )
    p.add_argument(
        "--link",
        type=float,
        default=_HW.link / 1e9,
        help="device-to-device bandwidth in GB/s per direction (default %(default)g, NVLink 3)",
    )
    p.add_argument(
        "--link-latency-us",
        type=float,
        default=_HW.link_latency * 1e6,
        help="latency of one all-reduce or send in microseconds (default %(default)g, small NCCL "
        "collectives on NVLink)",
    )
    p.add_argument(
        "--flops",
        type=float,
        default=_HW.flops / 1e12,
        help="matmul peak per device in TFLOP/s (default %(default)g, bf16 dense)",
    )
    p.add_argument(
        "--weight-bits",
        default="16",
        help="bits per weight, a number (16 = bf16) or a quant format name such as q8_0 (8.5), "
        "q4_0 (4.5), q4_k (4.5) (default 16)",
    )
    p.add_argument(
        "--act-bytes",
        type=float,
        default=2,
        help="bytes per activation and KV cache value (default 2)",
    )
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="throughput",
        help="what the recommendation maximises: decode throughput or per-token latency "
        "(default throughput; with --batch 1 they agree)",
    )
    p.set_defaults(run=run)


def _hardware(args: argparse.Namespace) -> Hardware:
    # checked here too, so that errors name the flag and the value in the units it was typed in
    for name in ("device_memory", "bandwidth", "link", "flops"):
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    if not (math.isfinite(args.link_latency_us) and args.link_latency_us >= 0):
        raise RequestError(f"--link-latency-us: must be >= 0, got {args.link_latency_us}")
    return Hardware(
        memory_bytes=args.device_memory * GiB,
        bandwidth=args.bandwidth * 1e9,
        link=args.link * 1e9,
        link_latency=args.link_latency_us * 1e-6,
        flops=args.flops * 1e12,
    )


def _row(e: Estimate) -> list[str]:
    shape = f"{e.stages}x{e.tensor_parallel}" if e.stages else "-"
    if not e.valid:
        return [e.layout, e.devices or "-", shape, "-", "-", "-", "-", "-", e.note]
    return [
        e.layout,
        e.devices,
        shape,
        f"{e.memory_per_device / GiB:.3f}",
        "yes" if e.fits else "no",
        f"{e.prefill_s * 1e3:.3f}",
        f"{e.decode_s * 1e3:.3f}",
        f"{e.decode_tokens_per_s:,.0f}",
        "",
    ]


def run(args: argparse.Namespace) -> int:
    # other bad values fail in the library (plan), whose errors name them
    bits = parse_weight_bits(args.weight_bits)
    hw = _hardware(args)
    spec = load_spec(args.spec)
    estimates = plan(spec, args.devices, hw, args.batch, args.context, bits, args.act_bytes)

    h = spec.hparams
    print(
        f"{spec.name}: {h.n_layers} layers, hidden {h.hidden}, {h.n_heads} heads / "
        f"{h.n_kv_heads} KV heads, vocab {h.vocab_size}; {bits:g} bits/weight; "
        f"batch {args.batch}, context {args.context}"
    )
    print(
        f"per device: {hw.memory_bytes / GiB:g} GiB, {hw.bandwidth / 1e9:g} GB/s, "
        f"{hw.flops / 1e12:g} TFLOP/s; link {hw.link / 1e9:g} GB/s, "
        f"{hw.link_latency * 1e6:g} us"
    )
    if args.context > h.max_positions:
        print(f"note: --context {args.context} exceeds the model's max_positions {h.max_positions}")
    head = ["layout", "devices", "PxT", "GiB/device", "fits", "prefill ms", "ms/token", "tokens/s", "note"]  # fmt: skip
    rows = [head] + [_row(e) for e in estimates]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    best, why = recommend(estimates, args.objective)
    print(f"recommend: {why}" if best else f"no recommendation: {why}")
    print(
        "(peak-rate estimates; embedding and head replicated across a stage's tensor-parallel "
        "ranks; activations and workspace not counted)"
    )
    return 0 if best else 1
