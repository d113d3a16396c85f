"""Build a network from a spec and load its weights: ``load_model(spec, dtype)``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from inferflow.blocks import POSITIONS
from inferflow.errors import SpecError
from inferflow.loaders import open_files
from inferflow.loaders.base import WeightSource
from inferflow.model.binding import WeightPlan, plan_weights
from inferflow.model.decoder import DecoderOnly
from inferflow.model.encoder import EncoderDecoder, EncoderOnly
from inferflow.model.materialise import materialise, trim_heap
from inferflow.model.names import NameMap
from inferflow.model.stack import StackPart
from inferflow.registry import Registry
from inferflow.spec.types import QuantSpec, Spec

log = logging.getLogger(__name__)

# what a spec builds, by network.type
BuiltNetwork = DecoderOnly | EncoderOnly | EncoderDecoder
NETWORKS: Registry[Callable[[Spec], BuiltNetwork]] = Registry("network type")
NETWORKS.add("decoder_only", DecoderOnly)
NETWORKS.add("encoder_only", EncoderOnly)
NETWORKS.add("encoder_decoder", EncoderDecoder)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    # float32 activations, rounded to 8 bits at the inputs of integer products (runtime.load
    # sets that on the loaded model: quant.linear.set_activations)
    "act8": torch.float32,
    "auto": torch.float32,  # act8 or float32, as runtime.load decides: float32 activations either way
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise SpecError(f"dtype {name!r} is not one of: {', '.join(DTYPES)}") from None


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # parameters are created directly in the run dtype (no full-precision copy first)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextmanager
def _meta_parameters() -> Iterator[None]:
    """Every parameter registered meanwhile lives on the meta device (shape and dtype, no
    storage: binding gives each its storage once, in its final form); buffers such as rope
    frequencies are computed as usual (accelerate's init_empty_weights does the same)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_network(
    spec: Spec, dtype: torch.dtype = torch.float32, part: StackPart | None = None
) -> BuiltNetwork:
    """The network with its parameters on the meta device (``load_model`` fills them)."""
    with _default_dtype(dtype), _meta_parameters():
        if part is not None:  # one rank's share of a partitioned decoder (inferflow.parallel)
            return DecoderOnly(spec, part)
        return NETWORKS.get(spec.network.type)(spec)


def held_elsewhere(part: StackPart, spec: Spec) -> Callable[[str], bool]:
    """Canonical tensor names that other ranks hold, given this rank's ``part``."""
    tied = spec.network.output.tied
    embeds: tuple[str, ...] = ("dec.type_embed.", "dec.embed_norm.")
    positions = spec.network.positions
    for name, _ in positions:  # input-only blocks are on the first stage; others on every stage
        if POSITIONS.get(name).input_only:
            embeds += ("dec.pos_embed." + (f"{name}." if len(positions) > 1 else ""),)
    heads = ("dec.output.", "dec.output_norm.", "dec.logits_bias")

    def elsewhere(canon: str) -> bool:
        layer = canon.split(".")[1] if canon.count(".") else ""
        if layer.isdigit():
            return not part.first <= int(layer) < part.last
        if canon.startswith("dec.tok_embed."):
            return not (part.embedding or (part.head and tied))
        if canon.startswith(embeds):
            return not part.embedding
        return canon.startswith(heads) and not part.head

    return elsewhere


def check_binding(spec: Spec) -> WeightPlan:
    """Build the network on the meta device and bind every checkpoint tensor by name and shape,
    reading no tensor data (what ``inferflow validate`` runs): a WeightBindingError names every
    missing, unused or mis-shaped tensor."""
    model = build_network(spec)
    source = open_files(spec.source.format, spec.source.files, spec.source.keys)
    try:
        return plan_weights(model, source, NameMap(spec.network.tensors))
    finally:
        source.close()


def load_model(
    spec: Spec,
    dtype: torch.dtype = torch.float32,
    quant: QuantSpec | None = None,
    part: StackPart | None = None,
) -> BuiltNetwork:
    """Network with its weights bound; quantized by ``quant`` (default: the spec's quant section).
    With ``part``, only that share of the decoder is built and read (each tensor already cut to
    the rank's tensor-parallel slice)."""
    t0 = time.perf_counter()
    model = build_network(spec, dtype, part)
    elsewhere = None if part is None else held_elsewhere(part, spec)
    q = spec.quant if quant is None else quant
    ties = tuple(getattr(model, "tied_outputs", ()))
    # a runtime format: the checkpoint read as `inferflow quantize` would write it, whose
    # blocks are kept as a quantized file's are (inferflow.quant.source)
    runtime = q.weights is not None or bool(q.overrides)
    keep = runtime or q.checkpoint == "keep"
    policy = None
    source: WeightSource = open_files(spec.source.format, spec.source.files, spec.source.keys)
    try:
        plan = plan_weights(model, source, NameMap(spec.network.tensors), elsewhere)
        if runtime:
            from inferflow.quant.source import quantize_on_load

            source, policy = quantize_on_load(source, plan, q, ties)
        materialise(model, source, plan, keep, q.kernel, ties, policy)
    finally:
        source.close()
    if q.dense_batch is not None:
        from inferflow.quant.linear import QuantLinear

        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.attach_dense(q.dense_batch)
    model.eval()
    trim_heap()  # the loading's freed temporaries go back to the system
    log.info(
        "loaded %s (%s) in %.2f s",
        spec.name,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - t0,
    )
    return model
