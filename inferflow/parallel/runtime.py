"""A partitioned model on torch.distributed: rank 0 runs the engine, every rank runs its part.

Each rank builds and loads only its share (``StackPart``: a layer range, the embeddings on the
first stage, the head on the last, its tensor-parallel slice of every layer). Per engine step
rank 0 broadcasts the step (inferflow.parallel.wire), and the step runs as micro-batches
through the stages: stage s receives a micro-batch's hidden states from stage s-1 (same
tensor-parallel rank), runs its layers (one all-reduce per branch inside its group) and sends
them on while it starts the next micro-batch, so with many sequences every stage is busy. The
last stage sends logits back to rank 0, which samples.

``launch`` spawns the other ranks as local processes (gloo on CPU, NCCL when every rank has a
GPU), or, under ``torchrun``, joins the process group torchrun set up (ranks != 0 then serve
steps until rank 0 closes).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from inferflow.blocks.split import TensorSplit
from inferflow.engine.kv_cache import PagedKVCache
from inferflow.errors import InferflowError, RequestError
from inferflow.model.batch import FlatBatch
from inferflow.model.build import load_model
from inferflow.model.decoder import DecoderOnly
from inferflow.model.stack import StackPart
from inferflow.parallel import free_port, wire
from inferflow.parallel.layout import Layout
from inferflow.quant.linear import QuantLinear
from inferflow.spec.types import QuantSpec, Spec

log = logging.getLogger(__name__)

_STATUS = 1024  # bytes of each rank's load report (an error message, or zeros)
_TIMEOUT = timedelta(seconds=int(os.environ.get("INFERFLOW_DIST_TIMEOUT", "600")))


def stack_part(layout: Layout, rank: int) -> StackPart:
    stage, tp = layout.stage_of(rank)
    first, last = layout.layers[stage]
    return StackPart(
        first, last, stage == 0, stage == layout.stages - 1, TensorSplit(tp, layout.tensor_parallel)
    )


class Partition:
    """One rank's part: its model, communicators and KV store, and the step it runs."""

    def __init__(self, layout: Layout, rank: int, model: DecoderOnly) -> None:
        self.layout, self.rank, self.model = layout, rank, model
        self.stage, self.tp = layout.stage_of(rank)
        self.device = layout.device(rank)
        self.gloo = layout.backend == "gloo"
        self.store: wire.KVStore | None = None
        self.rank_bytes: list[int] = []  # every rank's resident weight bytes (set at load)
        self.dtype = next(model.parameters()).dtype
        # every rank creates every group, in the same order (torch.distributed's rule)
        self.group = None
        for s in range(layout.stages):
            ranks = [layout.rank(s, j) for j in range(layout.tensor_parallel)]
            g = dist.new_group(ranks) if layout.tensor_parallel > 1 else None
            if s == self.stage:
                self.group = g
        if self.group is not None:
            for layer in model.dec.layers():
                layer.reduce = self._all_reduce

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        w = self._wire(t)
        dist.all_reduce(w, group=self.group)
        return w.to(t.device) if w is not t else w

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """gloo moves host tensors only: a GPU tensor crosses through host memory."""
        return t.cpu() if self.gloo and t.is_cuda else t.contiguous()

    def _buffer(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu" if self.gloo else self.device)

    def _peer(self, stage: int) -> int:
        return self.layout.rank(stage, self.tp)

    def kv_store(self, blocks: int, block_size: int) -> wire.KVStore:
        if self.store is None or (self.store.blocks, self.store.block_size) != (blocks, block_size):
            self.store = wire.KVStore.allocate(
                self.model.kv_geometry(), blocks, block_size, self.dtype, self.device
            )
        return self.store

    @torch.inference_mode()
    def run(self, store: wire.KVStore, mbs: list[wire.MicroBatch]) -> list[torch.Tensor]:
        """This rank's share of one step; rank 0 gets the logits of every micro-batch."""
        dec, last = self.model.dec, self.layout.stages - 1
        hidden = self.model.spec.hparams.hidden
        sends, logits = [], []
        for m, mb in enumerate(mbs):
            batch = mb.to_batch(store, self.device)
            if self.stage == 0:
                x = dec.embed(batch)
            else:
                w = self._buffer((mb.token_ids.shape[0], hidden), self.dtype)
                dist.recv(w, self._peer(self.stage - 1), tag=m)
                x = w.to(self.device)
            # (the last stage's layers: only the rows that need logits past its last attention)
            x = dec.run_layers(x, batch, batch.logits_rows if self.stage == last else None)
            if self.stage < last:
                sends.append(dist.isend(self._wire(x), self._peer(self.stage + 1), tag=m))
                continue
            out = dec.logits(dec.final_norm(x)).float()
            if self.rank == 0:
                logits.append(out)
            elif self.tp == 0:
                sends.append(dist.isend(self._wire(out), 0, tag=m))
        for s in sends:
            assert s is not None  # isend returns None only to a rank outside the group
            s.wait()
        if self.rank == 0 and last > 0:
            vocab = self.model.spec.hparams.vocab_size
            for m, mb in enumerate(mbs):
                out = self._buffer((mb.rows.shape[0], vocab), torch.float32)
                dist.recv(out, self.layout.rank(last, 0), tag=m)
                logits.append(out.to(self.device))
        return logits

    def serve(self) -> None:
        """A rank other than 0: run steps as rank 0 sends them, until it says stop."""
        while True:
            header = torch.empty(wire.HEADER, dtype=torch.long)
            dist.broadcast(header, 0)
            if int(header[0]) == wire.STOP:
                return
            payload = torch.empty(int(header[1]), dtype=torch.long)
            dist.broadcast(payload, 0)
            copies, mbs = wire.decode(header, payload)
            store = self.kv_store(int(header[4]), int(header[5]))
            store.copy_blocks(copies.to(self.device))
            self.run(store, mbs)


class PartitionedModel(nn.Module):
    """What the engine drives on rank 0: the model interface (``spec``, ``kv_geometry``,
    ``forward(flat batch) -> logits``) over every rank. ``close()`` releases the other ranks."""

    def __init__(self, part: Partition, procs: list[Any], micro_batches: int) -> None:
        super().__init__()
        self.local = part.model  # rank 0's share; its parameters are this module's
        self.spec = part.model.spec
        self.layout = part.layout
        self._part, self._procs = part, procs
        self.micro_batches = micro_batches
        self._closed = False
        atexit.register(self.close)

    def kv_geometry(self) -> tuple[int, int, int]:
        return self.local.kv_geometry()

    def forward(self, flat: FlatBatch) -> torch.Tensor:
        view = flat.group if flat.group is not None else flat.kv[0]
        cache = getattr(view, "cache", None)  # the engine's paged cache
        if not isinstance(cache, PagedKVCache):
            raise RequestError(
                "a partitioned model runs under the continuous-batching engine (inferflow "
                "serve, inferflow.engine.Engine), which gives it paged KV views"
            )
        if cache.k.dtype != cache.format.compute:
            raise RequestError(
                f"a partitioned model keeps K/V in its activations' dtype; KV cache dtype "
                f"{cache.format.name!r} is not supported with --devices"
            )
        if cache.copy_log is None:  # first step: no block can be shared (and copied) before it
            cache.copy_log = []
        copies, cache.copy_log = cache.copy_log, []
        mbs = wire.split(flat, self.micro_batches if self.layout.stages > 1 else 1)
        header, payload = wire.encode(mbs, copies, cache.alloc.num_blocks, cache.block_size)
        dist.broadcast(header, 0)
        dist.broadcast(payload, 0)
        store = wire.KVStore(cache.k, cache.v, cache.block_size)  # copies already made here
        return torch.cat(self._part.run(store, mbs))

    @property
    def rank_bytes(self) -> list[int]:
        """Resident weight bytes of each rank, as each measured its own share after loading."""
        return self._part.rank_bytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if dist.is_initialized():
                dist.broadcast(torch.tensor([wire.STOP] + [0] * (wire.HEADER - 1)), 0)
                dist.destroy_process_group()
        except Exception:  # other ranks already gone (interpreter shutdown)
            log.debug("closing the process group failed", exc_info=True)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def _load_part(
    spec: Spec, layout: Layout, rank: int, dtype: torch.dtype, quant: QuantSpec | None
) -> tuple[Partition | None, str]:
    """Load this rank's share, then learn whether every rank did: (partition, first error).
    Rank 0's partition also learns every rank's resident weight bytes (``rank_bytes``)."""
    part, error = None, ""
    try:
        model = load_model(spec, dtype, quant, stack_part(layout, rank))
        assert isinstance(model, DecoderOnly)
        model.to(layout.device(rank))
        if layout.embeddings_on_host and hasattr(model.dec, "tok_embed"):
            model.dec.tok_embed.to("cpu")
        part = Partition(layout, rank, model)
    except Exception as e:  # reported to rank 0, which raises it
        log.exception("rank %d failed to load", rank)
        error = f"rank {rank}: {type(e).__name__}: {e}"
    mine = torch.zeros(_STATUS, dtype=torch.uint8)
    raw = error.encode()[:_STATUS]
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    every = [torch.zeros(_STATUS, dtype=torch.uint8) for _ in range(layout.world_size)]
    dist.all_gather(every, mine)
    errors = [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in every]
    held = torch.tensor([0 if part is None else weight_bytes(part.model)])
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(layout.world_size)]
    dist.all_gather(sizes, held)
    if part is not None:
        part.rank_bytes = [int(t) for t in sizes]
    return part, next((e for e in errors if e), "")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters plus the blocks its quantized layers keep."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))


def _worker(
    spec: Spec,
    layout: Layout,
    rank: int,
    address: str,
    dtype: torch.dtype,
    quant: QuantSpec | None,
    threads: int,
) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank} %(levelname)s %(message)s")
    dist.init_process_group(
        layout.backend,
        init_method=address,
        rank=rank,
        world_size=layout.world_size,
        timeout=_TIMEOUT,
    )
    part, error = _load_part(spec, layout, rank, dtype, quant)
    if part is not None and not error:
        part.serve()
    dist.destroy_process_group()


def launch(
    spec: Spec,
    layout: Layout,
    dtype: torch.dtype = torch.float32,
    quant: QuantSpec | None = None,
    micro_batches: int | None = None,
) -> PartitionedModel:
    """Start every rank and load the model across them; returns rank 0's model. Under
    torchrun (WORLD_SIZE set) the ranks already exist: rank 0 returns, the others serve steps
    and exit."""
    world, procs = layout.world_size, []
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise InferflowError(
                f"partition: the layout has {world} devices but torchrun started "
                f"{os.environ['WORLD_SIZE']} processes"
            )
        dist.init_process_group(layout.backend, timeout=_TIMEOUT)
    elif not dist.is_initialized():
        threads = max(1, (os.cpu_count() or 1) // world) if layout.backend == "gloo" else 1
        address = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        for rank in range(1, world):
            p = ctx.Process(
                target=_worker,
                args=(spec, layout, rank, address, dtype, quant, threads),
                daemon=True,
            )
            p.start()
            procs.append(p)
        torch.set_num_threads(threads)
        dist.init_process_group(
            layout.backend, init_method=address, rank=0, world_size=world, timeout=_TIMEOUT
        )
    rank = dist.get_rank()
    t0 = time.perf_counter()
    part, error = _load_part(spec, layout, rank, dtype, quant)
    if rank != 0:  # torchrun: this process serves steps, then ends
        if part is not None and not error:
            part.serve()
        dist.destroy_process_group()
        sys.exit(0)
    if error or part is None:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=30)
        raise InferflowError(f"loading the partitioned model failed: {error}")
    log.info("loaded %s as %s in %.2f s", spec.name, layout.describe(), time.perf_counter() - t0)
    return PartitionedModel(part, procs, micro_batches or 2 * layout.stages)
