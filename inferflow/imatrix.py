"""Importance matrices, as llama.cpp's ``llama-imatrix`` makes them: for every weight matrix,
the sum over a calibration text's tokens of each input column's squared activation, and the
number of tokens. ``quantize --imatrix`` weights each weight's squared error by its column's
mean (``sum / count``), so the columns that carry large activations are kept more precisely.

The file is llama.cpp's imatrix GGUF (``general.type = imatrix``, ``imatrix.datasets``,
``imatrix.chunk_count``, ``imatrix.chunk_size``; per matrix ``<name>.in_sum2`` F32 (1, columns)
and ``<name>.counts`` F32 (1, 1)), under the checkpoint's tensor names: llama.cpp's quantizer
reads ours, ours reads llama.cpp's. A tied head's statistics are those of its input, recorded
under the token embedding's name (as llama.cpp does, since the head multiplies by that table).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from inferflow.blocks.linear import Linear
from inferflow.errors import CheckpointError, QuantError
from inferflow.evaluate import windows
from inferflow.loaders import open_files
from inferflow.loaders.base import WeightSource
from inferflow.model.batch import FlatBatch
from inferflow.model.binding import plan_weights
from inferflow.model.names import NameMap
from inferflow.model.stack import Stack
from inferflow.runtime import LanguageModel
from inferflow.spec.types import Spec

log = logging.getLogger(__name__)


@dataclass
class ImportanceMatrix:
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (columns,) float64
    counts: dict[str, int] = field(default_factory=dict)  # name -> tokens seen
    chunks: int = 0
    chunk_size: int = 0
    datasets: list[str] = field(default_factory=list)

    def importance(self, name: str) -> torch.Tensor | None:
        """Mean squared activation per column of ``name`` (float32), None when not recorded.
        Columns no token ever reached get the smallest positive mean (never zero: a weight of
        zero would leave its error free)."""
        if name not in self.sums or not self.counts.get(name):
            return None
        mean = (self.sums[name] / self.counts[name]).float()
        floor = mean[mean > 0].min() if bool((mean > 0).any()) else torch.tensor(1.0)
        return torch.where(mean > 0, mean, floor)

    def check(self, source: WeightSource, where: str) -> None:
        """Refuse a matrix made for another model: every name must be one of ``source``'s
        tensors with as many columns as recorded."""
        names = set(source.names())
        foreign = [n for n in self.sums if n not in names]
        if foreign or not self.sums:
            raise QuantError(
                f"{where}: an importance matrix for another model: {len(foreign)} of its "
                f"{len(self.sums)} tensors are not in the checkpoint (e.g. "
                f"{', '.join(foreign[:3]) or 'none recorded'})"
            )
        for n, s in self.sums.items():
            cols = source.shape(n)[-1]
            if s.numel() != cols:
                raise QuantError(
                    f"{where}: {n} has {cols} columns in the checkpoint but {s.numel()} in the "
                    "importance matrix (another model)"
                )

    def write(self, out: Path, force: bool = False) -> None:
        from inferflow.convert import atomic_output
        from inferflow.loaders.gguf_writer import GGUFTensorPlan, write_gguf

        meta = {
            "general.type": "imatrix",
            "imatrix.datasets": self.datasets,
            "imatrix.chunk_count": self.chunks,
            "imatrix.chunk_size": self.chunk_size,
        }
        # UINT32 counts; an array of strings even when no dataset is named
        types = {
            "imatrix.chunk_count": (4,),
            "imatrix.chunk_size": (4,),
            "imatrix.datasets": (9, 8),
        }
        plans, data = [], {}
        for n in sorted(self.sums):
            plans.append(GGUFTensorPlan(f"{n}.in_sum2", (1, self.sums[n].numel()), "F32"))
            plans.append(GGUFTensorPlan(f"{n}.counts", (1, 1), "F32"))
            data[f"{n}.in_sum2"] = self.sums[n].float().reshape(1, -1)
            data[f"{n}.counts"] = torch.tensor([[float(self.counts[n])]])
        with atomic_output(out, force) as f:
            write_gguf(f, meta, plans, lambda p: data[p.name], types)

    @classmethod
    def read(cls, path: Path) -> ImportanceMatrix:
        from inferflow.loaders.gguf import open_gguf

        src = open_gguf([path])
        try:
            if src.metadata.get("general.type") != "imatrix":
                raise CheckpointError(
                    f"{path}: not an importance matrix (general.type is "
                    f"{src.metadata.get('general.type')!r}, not 'imatrix'); make one with "
                    "`inferflow imatrix` or llama-imatrix"
                )
            m = cls(
                chunks=int(src.metadata.get("imatrix.chunk_count", 0)),
                chunk_size=int(src.metadata.get("imatrix.chunk_size", 0)),
                datasets=list(src.metadata.get("imatrix.datasets", [])),
            )
            for t in src.names():
                if not t.endswith(".in_sum2"):
                    continue
                n = t[: -len(".in_sum2")]
                sums, counts = src.get(t), src.get(f"{n}.counts")
                if not isinstance(sums, torch.Tensor) or not isinstance(counts, torch.Tensor):
                    raise CheckpointError(f"{path}: {n}'s statistics are not F32")
                if sums.shape[0] != 1 or counts.numel() != 1:
                    raise CheckpointError(
                        f"{path}: {n} has statistics for {sums.shape[0]} experts; only dense "
                        "matrices (one) are supported"
                    )
                m.sums[n], m.counts[n] = sums.double().reshape(-1), int(counts.item())
        finally:
            src.close()
        return m


def _targets(lm: LanguageModel) -> tuple[dict[nn.Module, list[str]], dict[Stack, list[str]]]:
    """Checkpoint tensor names whose columns are each linear layer's inputs, and each head's."""
    spec, model = lm.spec, lm.model
    assert isinstance(model, nn.Module)
    source = open_files(spec.source.format, spec.source.files, spec.source.keys)
    try:
        plan = plan_weights(model, source, NameMap(spec.network.tensors))
        cols = {n: source.shape(n)[-1] for n in source.names()}
    finally:
        source.close()
    params = {id(p): n for n, p in model.named_parameters()}

    def names(param: nn.Parameter) -> list[str]:
        parts = plan.parts.get(params.get(id(param), ""), [])
        return [b.name for b in parts if cols[b.name] == param.shape[-1]]

    stacks = [s for s in model.modules() if isinstance(s, Stack)]
    outputs = {id(s.output) for s in stacks}  # recorded at their stack's head_input
    layers = {
        m: names(m.weight)
        for m in model.modules()
        if isinstance(m, Linear) and id(m) not in outputs
    }
    heads = {}
    for s in stacks:
        if isinstance(s, Stack) and s.has_head:
            w = s.output.weight if s.output is not None else s.embedding.weight
            heads[s] = names(w)
    return {m: n for m, n in layers.items() if n}, {s: n for s, n in heads.items() if n}


@contextmanager
def _recording(lm: LanguageModel, out: ImportanceMatrix) -> Iterator[None]:
    layers, heads = _targets(lm)

    def add(names: list[str], x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        sq = x.square().sum(0)
        for n in names:
            out.sums[n] = out.sums[n] + sq if n in out.sums else sq.clone()
            out.counts[n] = out.counts.get(n, 0) + x.shape[0]

    hooks = [
        m.register_forward_pre_hook(lambda _m, args, names=names: add(names, args[0]))
        for m, names in layers.items()
    ]
    wrapped = []
    for s, names in heads.items():
        inner = s.head_input

        def head_input(h: torch.Tensor, inner=inner, names=names) -> torch.Tensor:
            y = inner(h)
            add(names, y)
            return y

        s.head_input = head_input  # type: ignore[method-assign]
        wrapped.append(s)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for s in wrapped:
            del s.head_input


@torch.inference_mode()
def collect(
    lm: LanguageModel,
    ids: list[int],
    ctx: int,
    chunks: int | None,
    bos: int | None = None,
    dataset: str = "",
    progress: bool = False,
    first: int = 0,
) -> ImportanceMatrix:
    """The importance matrix of ``lm`` (a float model) over ``chunks`` windows of ``ctx``
    tokens of ``ids`` from window ``first`` on (each starting with ``bos`` when given; e.g. the
    text after the windows a perplexity run scores), every position's head input included."""
    from inferflow.engine.generate import new_cache

    out = ImportanceMatrix(chunk_size=ctx, datasets=[dataset] if dataset else [])
    todo = windows(ids, ctx, None if chunks is None else first + chunks, bos)[first:]
    if not todo:
        raise QuantError(f"the text has no windows of {ctx} tokens from window {first} on")
    bar = tqdm(todo, desc="imatrix", unit="window", file=sys.stderr, disable=not progress)
    with _recording(lm, out), bar:
        for w in bar:
            batch = FlatBatch.single(torch.tensor(w), 0, new_cache(lm.model, ctx))
            batch.logits_rows = torch.arange(ctx)
            lm.model(batch)
            out.chunks += 1
    log.info("importance matrix: %d tensors over %d windows of %d", len(out.sums), out.chunks, ctx)
    return out


# Named importance matrices, computed once per model and cached (keyed by the checkpoint files'
# paths, sizes and modification times): "builtin" from Hamlet (the text `make models` fetches;
# the perplexity corpus of `inferflow ppl` and the benchmarks), its windows those after the
# first CALIBRATION_FIRST, which perplexity runs score; "generated" from no text at all: the
# model's own samples (temperature 1 from its first token, GENERATED_SEQS sequences of
# CALIBRATION_CTX tokens), a calibration-free proxy of the activations text would give.
BUILTIN, GENERATED = "builtin", "generated"
NAMED = (BUILTIN, GENERATED)
CALIBRATION_TEXT = Path.home() / ".cache" / "inferflow" / "texts" / "hamlet.txt"
CALIBRATION_CTX, CALIBRATION_FIRST, CALIBRATION_CHUNKS = 512, 4, 16
GENERATED_SEQS = 16
IMATRIX_CACHE = Path.home() / ".cache" / "inferflow" / "imatrix"


def named_imatrix(name: str, ref: str | Path | Spec) -> Path:
    """The cached importance matrix ``name`` (NAMED) of the model ``ref`` is or names (a spec
    name or file, a GGUF), computed on first use by a float32 pass over CALIBRATION_CHUNKS
    windows of Hamlet (builtin) or over the model's own samples (generated)."""
    import hashlib

    from inferflow.evaluate import text_ids
    from inferflow.runtime import load, require_tokenizer, tokenizer_for
    from inferflow.spec import load_spec

    if name not in NAMED:
        raise QuantError(f"--imatrix {name!r}: not a file nor one of {', '.join(NAMED)}")
    spec = ref if isinstance(ref, Spec) else load_spec(ref)
    key = hashlib.sha256()
    for f in spec.source.files:
        st = Path(f).stat()
        key.update(f"{Path(f).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    tag = "" if name == BUILTIN else f"-{name}"
    out = IMATRIX_CACHE / f"{spec.name}{tag}-{key.hexdigest()[:16]}.gguf"
    if out.exists():
        return out
    tok = require_tokenizer(spec, tokenizer_for(spec))
    log.info("--imatrix %s: computing %s's importance matrix (once; cached)", name, spec.name)
    if name == BUILTIN:
        if not CALIBRATION_TEXT.exists():
            raise CheckpointError(
                f"--imatrix {BUILTIN}: the calibration text {CALIBRATION_TEXT} is missing; `make "
                "models` fetches it (python tools/fetch_models.py hamlet)"
            )
        ids, bos = text_ids(tok, CALIBRATION_TEXT.read_text(encoding="utf-8"))
        first, dataset = CALIBRATION_FIRST, CALIBRATION_TEXT.name
    else:  # (sampled by the model as served: its integer products write faster than float32)
        ids, bos = own_samples(load(spec, "auto", None, tok), GENERATED_SEQS, CALIBRATION_CTX), None
        first, dataset = 0, f"{GENERATED_SEQS} samples of the model's own"
    lm = load(spec, "float32", "none", tok)
    m = collect(lm, ids, CALIBRATION_CTX, CALIBRATION_CHUNKS, bos, dataset, first=first)
    out.parent.mkdir(parents=True, exist_ok=True)
    m.write(out, force=True)
    log.info("--imatrix %s: wrote %s", name, out)
    return out


def own_samples(lm: LanguageModel, seqs: int, ctx: int) -> list[int]:
    """``seqs`` sequences of ``ctx`` tokens the model writes itself (seeded sampling at
    temperature 1, EOS ignored), each from its first token (BOS, else the end-of-text one)."""
    from inferflow.engine.engine import Engine, EngineConfig
    from inferflow.engine.sampling import SamplingParams

    h = lm.model.spec.hparams
    first = h.bos_id if h.bos_id is not None else h.eos_id
    start = [first if first is not None else 0]
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_bytes=1 << 30))
    params = [
        SamplingParams(max_new_tokens=ctx - 1, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(seqs)
    ]
    rids = [eng.add_request(start, p) for p in params]
    got: dict[str, list[int]] = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.token_ids)
    return [t for r in rids for t in start + got[r]]
