"""``inferflow serve [SPEC]``: the OpenAI-compatible HTTP server (default: the embedded
SmolLM2-135M-Instruct). Binds 127.0.0.1 unless --host says otherwise."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re

from inferflow.cli.common import (
    add_dtype,
    add_quant,
    add_speculation,
    draft_spec,
    speculation,
    with_quant,
)
from inferflow.engine.engine import EngineConfig
from inferflow.engine.grammar_bounds import GrammarLimits
from inferflow.engine.kv_cache import KV_DTYPES
from inferflow.engine.scheduler import SchedulerConfig
from inferflow.errors import InferflowError
from inferflow.parallel.layout import resolve_layout
from inferflow.runtime import load, quant_for
from inferflow.server.limits import MAX_SCORED
from inferflow.server.store import StoreLimits
from inferflow.server.tools import CALL_FORMATS
from inferflow.spec import load_spec, partition_spec
from inferflow.tokenizer.chat import TemplateBudget

DEFAULT_SPEC = "smollm2-135m-instruct"
UNITS = {"": 1 << 30, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def memory_bytes(text: str) -> int:
    """'2' or '2GiB' (GiB), '512MiB', or a fraction of physical memory such as '0.1' or '10%'."""
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(%|b|kib|mib|gib)?", t)
    if m is None:
        raise InferflowError(
            f"--kv-cache-memory: {text!r} is not a size; use GiB ('2'), a unit (512MiB, 2GiB) "
            "or a fraction of RAM ('0.1', '10%')"
        )
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit == "%" or (unit == "" and value < 1):
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(ram * (value / 100 if unit == "%" else value))
    return int(value * UNITS[unit])


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__
    )
    p.add_argument(
        "spec", nargs="?", default=DEFAULT_SPEC, help=f"spec file or built-in name ({DEFAULT_SPEC})"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (127.0.0.1; 0.0.0.0 exposes it)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (8000)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (env "
        "INFERFLOW_API_KEY); repeatable: any of the keys, and the prefix cache keeps each "
        "key's prompts apart",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model ids clients may send (the spec's name); the first is the one responses "
        "report, and /v1/models lists them all (as vLLM's flag of that name)",
    )
    add_dtype(p)
    add_quant(p)
    p.add_argument(
        "--dense-batch",
        type=int,
        default=None,
        metavar="ROWS",
        help="int4pack layers keep a dense bf16 copy too and use it for steps of at least ROWS "
        "tokens (faster batched decode and prefill from about 16; 2 more bytes per weight); "
        "replaces the spec's quant.dense_batch",
    )
    p.add_argument(
        "--devices",
        default=None,
        help="split the model across devices, one process each: ';' between layer groups, '&' "
        "between the tensor-parallel devices of a group ('cpu;cpu' by layer, 'cpu&cpu' by "
        "tensor, '0&1;2&3' hybrid on GPUs 0-3); replaces the spec's partition section",
    )
    p.add_argument(
        "--max-batched-tokens", type=int, default=512, help="token budget of one engine step (512)"
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=256,
        help="prompt tokens one engine step takes at most, within --max-batched-tokens (256): a "
        "burst of prompts finishes a few at a time, running sequences still step each time",
    )
    p.add_argument(
        "--max-running", type=int, default=64, help="sequences in the running batch at most (64)"
    )
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429 (256)")
    p.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV cache size: GiB ('2'), with a unit (512MiB) or a fraction of RAM ('0.1', '10%%'); 1GiB",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (16)")
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=KV_DTYPES,
        help="how K/V are kept: q8 (GGML Q8_0 blocks) holds 3.76x the tokens of "
        "float32 in the same memory, float16 (llama.cpp's default) and bfloat16 2x "
        "(default: the --dtype)",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="do not share identical prompt prefixes"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="each request computed on its own (slower under load): batch-invariant also where "
        "the default is not (soft-capped or biased attention, float layers, bfloat16)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="request body limit, bytes (4 MiB)"
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, new requests get 503 and running ones may finish for this "
        "long before they end with finish reason 'abort' (10)",
    )
    p.add_argument(
        "--template-timeout",
        type=float,
        default=TemplateBudget.seconds,
        metavar="SECONDS",
        help=f"time limit of one chat template rendering ({TemplateBudget.seconds:g})",
    )
    p.add_argument(
        "--template-max-chars",
        type=int,
        default=TemplateBudget.max_output_chars,
        help=f"size limit of a rendered chat prompt ({TemplateBudget.max_output_chars})",
    )
    p.add_argument(
        "--responses-store",
        type=int,
        default=StoreLimits.items,
        metavar="N",
        help="responses kept in memory for previous_response_id and GET /v1/responses/{id}, "
        f"oldest out first (at most {StoreLimits.chars} characters in all; 0: none) "
        f"({StoreLimits.items})",
    )
    p.add_argument(
        "--responses-ttl",
        type=float,
        default=StoreLimits.seconds,
        metavar="SECONDS",
        help=f"how long a stored response is kept ({StoreLimits.seconds:g})",
    )
    for f in dataclasses.fields(GrammarLimits):  # (each declares its flag and help)
        p.add_argument(
            f.metadata["flag"],
            type=type(f.default),
            default=f.default,
            dest=f"grammar_{f.name}",
            help=f"at most this many {f.metadata['help']}; past it, 400 ({f.default:g})",
        )
    p.add_argument(
        "--max-scored-tokens",
        type=int,
        default=None,
        help="prompt tokens one request may have scored with echo or prompt_logprobs "
        f"({MAX_SCORED}, or the model's context where longer)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="FORMAT",
        help="how the model writes tool calls: "
        f"{', '.join(CALL_FORMATS.names())} (default: the format the chat template prints)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="allow this browser origin (repeatable; off by default)",
    )
    add_speculation(p)
    p.set_defaults(run=run)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings the serve flags give (``args`` from this subcommand's parser)."""
    for flag in (
        "max_batched_tokens",
        "max_prefill_tokens",
        "max_running",
        "max_waiting",
        "block_size",
    ):
        if getattr(args, flag) < 1:
            raise InferflowError(
                f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}"
            )
    return EngineConfig(
        SchedulerConfig(
            args.max_batched_tokens,
            args.max_running,
            args.max_waiting,
            not args.no_prefix_caching,
            args.max_prefill_tokens,
        ),
        block_size=args.block_size,
        kv_cache_bytes=memory_bytes(args.kv_cache_memory),
        deterministic=args.deterministic,
        speculative=speculation(args),
        kv_cache_dtype=args.kv_cache_dtype,
    )


def run(args: argparse.Namespace) -> int:
    from inferflow.server.app import ServerConfig, create_app
    from inferflow.server.shutdown import listen, serve

    spec = load_spec(args.spec)  # a bad spec fails here, before the port opens
    if args.dense_batch is not None:
        if args.dense_batch < 1:
            raise InferflowError(f"--dense-batch: must be >= 1, got {args.dense_batch}")
        spec = dataclasses.replace(
            spec, quant=dataclasses.replace(spec.quant, dense_batch=args.dense_batch)
        )
    spec = with_quant(spec, args)  # (an unknown format fails here)
    quant = quant_for(spec, args.quant)  # what load will use
    if args.devices is not None:
        spec = dataclasses.replace(spec, partition=partition_spec({"devices": args.devices}))
    if spec.partition is not None:  # a layout the model cannot take fails before loading
        resolve_layout(spec.partition, spec, quant)
        if int(os.environ.get("RANK", "0")) != 0:
            # torchrun started this process as another rank: load serves rank 0's steps on
            # this rank's share until rank 0 closes, then ends the process (never returns)
            load(spec, args.dtype, args.quant)
    for flag in ("port", "max_body_bytes", "template_max_chars"):
        if getattr(args, flag) < 1:
            raise InferflowError(
                f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}"
            )
    if args.responses_store < 0:
        raise InferflowError(f"--responses-store: must be >= 0, got {args.responses_store}")
    for flag in ("shutdown_grace", "template_timeout", "responses_ttl"):
        if not 0 < getattr(args, flag) < 86400:
            raise InferflowError(
                f"--{flag.replace('_', '-')}: seconds in (0, 86400), got {getattr(args, flag)}"
            )
    engine = engine_config(args)
    grammar = GrammarLimits(
        **{f.name: getattr(args, f"grammar_{f.name}") for f in dataclasses.fields(GrammarLimits)}
    )
    if args.max_scored_tokens is not None and args.max_scored_tokens < 1:
        raise InferflowError(f"--max-scored-tokens: must be >= 1, got {args.max_scored_tokens}")
    keys = args.api_key or (
        [os.environ["INFERFLOW_API_KEY"]] if "INFERFLOW_API_KEY" in os.environ else []
    )
    if args.tool_call_parser is not None:
        CALL_FORMATS.get(args.tool_call_parser)  # (an unknown name: the error lists them)
    draft = draft_spec(args, spec)
    sock = listen(args.host, args.port)  # (a port in use fails here, before the model loads)
    cfg = ServerConfig(
        spec,
        tuple(args.served_model_name or ()),
        args.dtype,
        args.quant,
        engine,
        tuple(keys),
        args.max_body_bytes,
        tuple(args.cors_origin),
        args.shutdown_grace,
        TemplateBudget(seconds=args.template_timeout, max_output_chars=args.template_max_chars),
        f"http://{args.host}:{args.port}",
        StoreLimits(items=args.responses_store, seconds=args.responses_ttl),
        draft,
        grammar,
        args.max_scored_tokens,
        tool_call_parser=args.tool_call_parser,
    )
    # what loads, how long it took and when requests can be served: said at the default level
    for name in ("inferflow.server", "inferflow.model.materialise", "inferflow.runtime"):
        # (+ loading progress, and the dtype the model runs in)
        said = logging.getLogger(name)
        said.setLevel(min(said.getEffectiveLevel(), logging.INFO))
    serve(create_app(cfg), args.host, args.port, args.shutdown_grace, sock)
    return 0
