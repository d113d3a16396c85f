"""Partition layouts: which process holds which layers and which slice of every weight.

``devices: "0&1;2&3"``: ';' separates layer groups (pipeline stages), '&' joins the
tensor-parallel devices of a group; so ``0;1`` splits by layer, ``0&1`` by tensor and
``0&1;2&3`` is hybrid (2 groups x 2). Every device is one process (rank = stage * T + tp rank).
A device is ``cpu`` (``cpu:N`` only labels distinct CPU processes), ``cuda:N`` or a bare ``N``
(= ``cuda:N``). Layers split as evenly as possible, the first groups taking one more when the
count does not divide; ``layers: [a, b, ...]`` gives each group's count.

Every check here runs on the spec alone, before any weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from inferflow.blocks import POSITIONS
from inferflow.errors import SpecError
from inferflow.spec.types import PartitionSpec, QuantSpec, Spec

_DEVICE = re.compile(r"^(?:cpu(?::\d+)?|cuda:\d+|\d+)$")


@dataclass(frozen=True)
class Layout:
    groups: tuple[tuple[str, ...], ...]  # device of each rank, group by group
    layers: tuple[tuple[int, int], ...]  # [first, last) layer range of each group
    embeddings_on_host: bool = False

    @property
    def stages(self) -> int:
        return len(self.groups)

    @property
    def tensor_parallel(self) -> int:
        return len(self.groups[0])

    @property
    def world_size(self) -> int:
        return self.stages * self.tensor_parallel

    @property
    def strategy(self) -> str:
        if self.tensor_parallel == 1:
            return "layer"
        return "tensor" if self.stages == 1 else "hybrid"

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tensor_parallel + tp_rank

    def stage_of(self, rank: int) -> tuple[int, int]:
        """(stage, tensor-parallel rank) of a global rank."""
        return divmod(rank, self.tensor_parallel)

    def device(self, rank: int) -> torch.device:
        stage, tp = self.stage_of(rank)
        return torch.device(self.groups[stage][tp])

    @property
    def backend(self) -> str:
        """NCCL when every rank is on a GPU (and NCCL is built in), gloo otherwise."""
        on_gpu = all(d.startswith("cuda") for g in self.groups for d in g)
        nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
        return "nccl" if on_gpu and nccl else "gloo"

    def describe(self) -> str:
        ranges = ", ".join(f"layers {a}-{b - 1}" for a, b in self.layers)
        devs = ";".join("&".join(g) for g in self.groups)
        return f"{self.strategy} ({self.stages} x {self.tensor_parallel}: {devs}; {ranges})"


def _device(token: str) -> str:
    t = token.strip()
    if not _DEVICE.match(t):
        raise SpecError(
            f"partition.devices: {token!r} is not a device; use cpu, cuda:N or N (= cuda:N), "
            "'&' between the devices of a tensor-parallel group, ';' between layer groups"
        )
    return f"cuda:{t}" if t.isdigit() else ("cpu" if t.startswith("cpu") else t)


def parse_devices(text: str) -> tuple[tuple[str, ...], ...]:
    groups = []
    for part in text.split(";"):
        if not part.strip():
            raise SpecError(f"partition.devices: {text!r} has an empty layer group")
        groups.append(tuple(_device(d) for d in part.split("&")))
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        raise SpecError(
            f"partition.devices: {text!r} has groups of {' and '.join(map(str, sizes))} "
            "devices; every layer group needs the same number of tensor-parallel devices"
        )
    return tuple(groups)


def _explicit(p: PartitionSpec) -> tuple[tuple[str, ...], ...]:
    if p.strategy is None:
        raise SpecError(
            'partition: give devices (e.g. "0&1;2&3"), cpu_layers, or strategy '
            "(layer | tensor | hybrid) with layer_groups / tensor_parallel"
        )
    need = {"layer": ("layer_groups",), "tensor": ("tensor_parallel",)}.get(
        p.strategy, ("layer_groups", "tensor_parallel")
    )
    for key in need:
        if getattr(p, key) is None:
            raise SpecError(f"partition: strategy {p.strategy} needs {key}")
    stages = p.layer_groups if p.strategy != "tensor" else 1
    tp = p.tensor_parallel if p.strategy != "layer" else 1
    assert stages is not None and tp is not None
    if p.strategy == "hybrid" and (stages < 2 or tp < 2):
        raise SpecError(
            f"partition: hybrid needs layer_groups >= 2 and tensor_parallel >= 2, got "
            f"{stages} x {tp} (use strategy layer or tensor)"
        )
    kind = p.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = iter(range(stages * tp))
    return tuple(
        tuple("cpu" if kind == "cpu" else f"cuda:{next(names)}" for _ in range(tp))
        for _ in range(stages)
    )


def _layer_ranges(counts: list[int]) -> tuple[tuple[int, int], ...]:
    out, first = [], 0
    for n in counts:
        out.append((first, first + n))
        first += n
    return tuple(out)


def quant_block(q: QuantSpec) -> int:
    """The largest block of the runtime weight formats ``q`` names (1 for float)."""
    from inferflow.quant import get_format

    names = [q.weights, *(f for _, f in q.overrides)]
    return max([get_format(n).block_size for n in names if n], default=1)


def resolve_layout(p: PartitionSpec, spec: Spec, quant: QuantSpec | None = None) -> Layout:
    """The layout a partition section asks for, checked against the model and the runtime
    weight format (default: the spec's) before anything is loaded."""
    n_layers = spec.hparams.n_layers
    forms = [k for k in ("devices", "strategy", "cpu_layers") if getattr(p, k) is not None]
    if len(forms) > 1:
        raise SpecError(f"partition: give one of devices, strategy, cpu_layers, not {forms}")
    layers = list(p.layers)
    if p.cpu_layers is not None:  # CPU-GPU hybrid: a two-stage pipeline, CPU first
        if layers:
            raise SpecError("partition: cpu_layers already fixes the layer split; drop layers")
        if not 0 < p.cpu_layers < n_layers:
            raise SpecError(
                f"partition.cpu_layers: {p.cpu_layers} must be between 1 and {n_layers - 1} "
                f"(the model has {n_layers} layers)"
            )
        groups: tuple[tuple[str, ...], ...] = (("cpu",), ("cuda:0",))
        layers = [p.cpu_layers, n_layers - p.cpu_layers]
    elif p.devices is not None:
        groups = parse_devices(p.devices)
    else:
        groups = _explicit(p)
    stages = len(groups)
    if layers:
        if len(layers) != stages or sum(layers) != n_layers or min(layers) < 1:
            raise SpecError(
                f"partition.layers: {layers} must give one count of at least 1 per layer group "
                f"({stages}) adding up to the model's {n_layers} layers"
            )
    else:
        layers = stage_layers(n_layers, stages)
    layout = Layout(groups, _layer_ranges(layers), p.embeddings == "host")
    check_layout(layout, spec, quant_block(quant or spec.quant))
    return layout


def stage_layers(n_layers: int, stages: int) -> list[int]:
    """Layers of each stage, as even as possible: the first stages take one more when the
    count does not divide."""
    base, extra = divmod(n_layers, stages)
    return [base + (i < extra) for i in range(stages)]


def split_problem(spec: Spec, stages: int, tensor_parallel: int, quant_block: int = 1) -> str:
    """Why the model cannot run as ``stages`` layer groups of ``tensor_parallel`` devices each
    ("" when it can): the rules of ``check_layout`` and of the planner (inferflow.parallel.cost).
    ``quant_block``: the block size of the runtime weight format (row-parallel weights are cut
    across their blocks' direction)."""
    h, t = spec.hparams, tensor_parallel
    if stages > h.n_layers:
        return f"{stages} layer groups, but the model has only {h.n_layers} layers"
    if t == 1:
        return ""
    if h.n_heads % t:
        return (
            f"{t} tensor-parallel devices cannot split {h.n_heads} attention heads; use a "
            f"divisor of {h.n_heads}"
        )
    if h.n_kv_heads % t and t % h.n_kv_heads:
        return (
            f"{t} tensor-parallel devices cannot split {h.n_kv_heads} KV heads: the device "
            "count must divide the KV heads, or be a multiple of them (each KV head is then "
            "replicated)"
        )
    if h.ffn_hidden % t:
        return (
            f"{t} tensor-parallel devices cannot split the FFN width {h.ffn_hidden}; use a "
            "divisor of it"
        )
    for name, _ in spec.network.positions:
        if not POSITIONS.get(name).splits_heads:
            return f"tensor parallelism does not split the {name} position bias"
    for what, width in (
        ("attention output", h.n_heads * h.head_dim // t),
        ("FFN down projection", h.ffn_hidden // t),
    ):
        if width % quant_block:
            return (
                f"each device's slice of the {what} is {width} wide, not a multiple of the "
                f"quantization block ({quant_block}); use fewer tensor-parallel devices or a "
                "format with smaller blocks"
            )
    return ""


def check_layout(layout: Layout, spec: Spec, quant_block: int = 1) -> None:
    """Errors for a layout the model cannot take (``split_problem``) or the machine lacks."""
    net = spec.network
    if net.type != "decoder_only":
        raise SpecError(
            f"partition: {net.type} networks are not partitioned; only decoder_only networks are"
        )
    problem = split_problem(spec, layout.stages, layout.tensor_parallel, quant_block)
    if problem:
        raise SpecError(f"partition: {problem}")
    cuda = [d for g in layout.groups for d in g if d.startswith("cuda")]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for d in cuda:
        if int(d.split(":")[1]) >= have:
            raise SpecError(
                f"partition: device {d} does not exist (this machine has {have} CUDA "
                f"device{'s' if have != 1 else ''}; cpu runs one process per device entry)"
            )
    if len(set(cuda)) != len(cuda):
        raise SpecError(f"partition: a GPU appears twice in {cuda}; give each rank its own")
