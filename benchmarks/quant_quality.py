"""Quality of every Inferflow weight format against llama.cpp's at equal bits, end to end: each
engine quantizes the same F32 GGUF with its own tool and scores the result with its own
perplexity run (llama.cpp's protocol: Hamlet, windows of --ctx tokens starting with BOS where
the model adds one, the second half of each scored; KL divergence and top-1 agreement against
the same engine's F32 run).

    python benchmarks/quant_quality.py [--models smollm2-135m-instruct,gemma-3-270m,...]
        [--formats Q8,Q6,...] [--methods minmax,search,imatrix,generated] [--llama-cpp DIR]
        [--llama-types Q2_K,...] [--ctx 512] [--chunks 4] [--calib-chunks 16] [--at-load]
        [--write-readme]

Inferflow rows: ``inferflow quantize F32.gguf --format FMT`` (its default mix: the tied
embedding / output head at Q6 below 6 bits) with ``--method minmax`` (the seed paper's rule),
``--method search``, search with ``--imatrix`` from ``inferflow imatrix`` over the
--calib-chunks windows after the scored ones (disjoint text), and (method ``generated``) with
``--imatrix generated``: no text, the model's own samples (inferflow.imatrix.named_imatrix, of
the checkpoint the F32 file comes from); then ``inferflow ppl`` on the file
with its default kernels. With --at-load, each row also loads the F32 file with ``--quant FMT``
(the same method and imatrix: quantization at load time) and reports that run's PPL beside the
file's (they must be equal). llama.cpp rows (with --llama-cpp, a directory with llama-quantize,
llama-imatrix and llama-perplexity, e.g. from ``python tools/build_llama_cpp.py``):
``llama-quantize F32.gguf TYPE`` without an imatrix, and with one from ``llama-imatrix`` over the
same calibration windows (``--chunk`` skips the scored ones, ``--process-output`` records the
head); ``llama-perplexity --kl-divergence``. Bits per weight: bytes over weights of the
transformer blocks' matrices (``blk.*``), scales and minimums included, as the file stores them.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferflow.convert import convert_checkpoint, write_gguf_from  # noqa: E402
from inferflow.evaluate import perplexity, text_ids  # noqa: E402
from inferflow.imatrix import (  # noqa: E402
    CALIBRATION_CHUNKS,
    CALIBRATION_CTX,
    CALIBRATION_FIRST,
    GENERATED,
    collect,
    named_imatrix,
)
from inferflow.imatrix import CALIBRATION_TEXT as TEXT  # noqa: E402
from inferflow.loaders.base import Weight  # noqa: E402
from inferflow.loaders.gguf import open_gguf  # noqa: E402
from inferflow.loaders.gguf_writer import GGUFTensorPlan  # noqa: E402
from inferflow.quant import LOGSCALE_FORMATS, MINMAX_FORMATS, get_format  # noqa: E402
from inferflow.quantize import quantize_checkpoint  # noqa: E402
from inferflow.runtime import load  # noqa: E402
from inferflow.spec import load_spec  # noqa: E402

MODELS = "smollm2-135m-instruct,gemma-3-270m,qwen2.5-coder-0.5b-instruct"
FORMATS = ",".join((*MINMAX_FORMATS, *LOGSCALE_FORMATS))
LLAMA_TYPES = "Q2_K,Q3_K_S,Q3_K_M,Q4_0,Q4_K_S,Q5_K_S,Q6_K,Q8_0"
START, END = "<!-- quant-quality:start -->", "<!-- quant-quality:end -->"


def block_bpw(path: Path) -> float:
    """Bits per weight of the transformer blocks' matrices as stored (scales included)."""
    src = open_gguf([path])
    bits, weights = 0.0, 0
    try:
        for n in src.names():
            shape = src.shape(n)
            if not n.startswith("blk.") or len(shape) < 2:
                continue
            count = math.prod(shape)
            f = get_format(src.dtype_name(n))
            bits += count * (f.bits_per_weight if f.block_size > 1 else 8 * _plain_bytes(f.name))
            weights += count
    finally:
        src.close()
    return bits / weights


def _plain_bytes(name: str) -> int:
    return {"F32": 4, "F16": 2, "BF16": 2}[name]


def ours(
    f32: Path, ids: list[int], bos: int | None, args, tmp: Path, matrices: dict[str, Path]
) -> list[str]:
    """``matrices``: the importance matrix of each method that takes one."""
    ref = load(str(f32), "float32", "none")
    base = tmp / "base.st"
    r0 = perplexity(ref.model, ids, args.ctx, args.chunks, save_base=base, bos=bos)
    del ref
    rows = [_row("inferflow", "F32", "", 32.0, r0.ppl, 1.0, 0.0, 1.0, 0.0)]
    print(rows[-1], flush=True)
    for given in args.formats.split(","):
        fmt, _, rules = given.partition(":")  # FMT:PATTERN=FMT;... (--per-tensor rules)
        per_tensor = rules.split(";") if rules else []
        for method in args.methods.split(","):
            out = tmp / f"{fmt}-{method}.gguf"
            t = time.perf_counter()
            quantize_checkpoint(
                f32,
                out,
                fmt,
                per_tensor,
                method="minmax" if method == "minmax" else "search",
                imatrix=matrices.get(method),
                force=True,
            )
            secs = time.perf_counter() - t
            q = load(str(out), "float32")
            r = perplexity(q.model, ids, args.ctx, args.chunks, kl_base=base, bos=bos)
            del q
            assert r.kl is not None
            at_load = None
            if args.at_load and not per_tensor:  # the F32 file quantized as it loads: --quant
                spec = load_spec(str(f32))
                how = replace(
                    spec.quant,
                    method="minmax" if method == "minmax" else "search",
                    imatrix=matrices.get(method),
                )
                q = load(replace(spec, quant=how), "float32", fmt)
                at_load = perplexity(q.model, ids, args.ctx, args.chunks, bos=bos).ppl
                del q
            label = {"minmax": "min-max", "search": "search", "imatrix": "search + imatrix"}
            label[GENERATED] = "search + generated imatrix"
            rows.append(
                _row("inferflow", given, label[method], block_bpw(out), r.ppl, r.ppl / r0.ppl,
                     r.kl.mean, r.kl.top1_agreement, secs, at_load)
            )  # fmt: skip
            print(rows[-1], flush=True)
            out.unlink()
    return rows


_NUM = r"([0-9.]+)"


def llama_cpp(f32: Path, args, tmp: Path) -> list[str]:
    bin_dir = Path(args.llama_cpp)
    text = ["-f", str(TEXT), "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", "2"]
    logits = tmp / "llama-base.kld"
    run = subprocess.run(
        [str(bin_dir / "llama-perplexity"), "-m", str(f32), *text, "--kl-divergence-base",
         str(logits)], capture_output=True, text=True, check=True,
    )  # fmt: skip
    base_ppl = float(re.findall(r"Final estimate: PPL = " + _NUM, run.stdout + run.stderr)[-1])
    rows = [_row("llama.cpp", "F32", "", 32.0, base_ppl, 1.0, 0.0, 1.0, 0.0)]
    print(rows[-1], flush=True)
    imatrix = tmp / "llama-imatrix.gguf"
    if "imatrix" in args.methods:  # the same calibration windows as ours: those after the scored
        subprocess.run(
            [str(bin_dir / "llama-imatrix"), "-m", str(f32), "-f", str(TEXT), "-c",
             str(args.ctx), "--chunk", str(args.chunks), "--chunks", str(args.calib_chunks),
             "--process-output", "--no-ppl", "-o", str(imatrix), "-t", "2"],
            capture_output=True, check=True,
        )  # fmt: skip
    for typ in args.llama_types.split(","):
        for with_imatrix in (False, True) if "imatrix" in args.methods else (False,):
            out = tmp / f"llama-{typ}.gguf"
            given = ["--imatrix", str(imatrix)] if with_imatrix else []
            t = time.perf_counter()
            subprocess.run(
                [str(bin_dir / "llama-quantize"), *given, str(f32), str(out), typ, "2"],
                capture_output=True, check=True,
            )  # fmt: skip
            secs = time.perf_counter() - t
            run = subprocess.run(
                [str(bin_dir / "llama-perplexity"), "-m", str(out), *text,
                 "--kl-divergence-base", str(logits), "--kl-divergence"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            log = run.stdout + run.stderr
            ppl = float(re.findall(r"Mean PPL\(Q\)\s*:\s*" + _NUM, log)[-1])
            kld = float(re.findall(r"Mean\s+KLD:\s*" + _NUM, log)[-1])
            top1 = float(re.findall(r"Same top p:\s*" + _NUM, log)[-1]) / 100
            how = "llama-quantize" + (" + imatrix" if with_imatrix else "")
            rows.append(
                _row("llama.cpp", typ, how, block_bpw(out), ppl, ppl / base_ppl, kld, top1, secs)
            )
            print(rows[-1], flush=True)
            out.unlink()
    return rows


def dither_rows(name: str, w: torch.Tensor, h: float) -> torch.Tensor:
    """``w`` plus uniform noise in [-h, h] * each row's RMS, seeded by the tensor's name."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    rms = w.square().mean(-1, keepdim=True).sqrt()
    return w + (torch.rand(w.shape, generator=g) * 2 - 1) * h * rms


def dither(f32: Path, out: Path, h: float) -> Path:
    """The F32 file with uniform noise in [-h, h] * RMS of each row added to every matrix: the
    models here come from quantized files, so their float weights lie on the grids of the
    source's types, which a quantizer writing the same types reproduces almost exactly (a
    fidelity no real float checkpoint offers); the noise takes the weights off those grids."""
    src = open_gguf([f32])

    def encode(plan: GGUFTensorPlan, w: Weight) -> torch.Tensor:
        assert isinstance(w, torch.Tensor)  # (an F32 file)
        return w if w.dim() < 2 else dither_rows(plan.name, w, h)

    try:
        write_gguf_from(src, "gguf", f32, out, lambda *_: "F32", True, False, encode=encode)
    finally:
        src.close()
    return out


def _row(engine, fmt, method, bpw, ppl, ratio, kl, top1, secs, at_load=None) -> str:  # noqa: ANN001
    return (
        f"| {engine} | {fmt} | {method} | {bpw:.2f} | {ppl:.3f} | {ratio:.3f}x | {kl:.4f} | "
        f"{100 * top1:.1f}% | {secs:.1f} | {'' if at_load is None else f'{at_load:.3f}'} |"
    )


def run_model(name: str, args) -> list[str]:  # noqa: ANN001
    spec = load_spec(name)
    lm = load(spec, "float32", "none")
    tok = lm._tok()
    ids, bos = text_ids(tok, TEXT.read_text(encoding="utf-8"))
    rows = [f"| **{name}** | | | | | | | | | |"]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        f32 = tmp / "f32.gguf"
        convert_checkpoint(spec.source.files[0], f32, type_name="F32")
        if args.dither:
            f32 = dither(f32, tmp / "f32-dithered.gguf", args.dither)
            lm = load(str(f32), "float32", "none")  # (the imatrix of the dithered weights)
        matrices = {"imatrix": tmp / "imatrix.gguf"}
        if "imatrix" in args.methods:
            collect(lm, ids, args.ctx, args.calib_chunks, bos, TEXT.name, False, args.chunks).write(
                matrices["imatrix"]
            )
        del lm
        if GENERATED in args.methods:  # (no text: cached per checkpoint, as a user gets it)
            matrices[GENERATED] = named_imatrix(GENERATED, spec)
        rows += ours(f32, ids, bos, args, tmp, matrices)
        if args.llama_cpp:
            rows += llama_cpp(f32, args, tmp)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--methods", default="minmax,search,imatrix")
    ap.add_argument("--llama-cpp", default=None, help="directory with llama.cpp's tools")
    ap.add_argument("--llama-types", default=LLAMA_TYPES)
    # (the windows --imatrix builtin calibrates on are the same: those after the scored ones)
    ap.add_argument("--ctx", type=int, default=CALIBRATION_CTX)
    ap.add_argument("--chunks", type=int, default=CALIBRATION_FIRST)
    ap.add_argument("--calib-chunks", type=int, default=CALIBRATION_CHUNKS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--at-load", action="store_true", help="also quantize at load (--quant)")
    ap.add_argument(
        "--dither", type=float, default=0.0, help="noise in [-H, H] * row RMS on the F32 weights"
    )
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not TEXT.exists():
        print(f"{TEXT} is missing: run `make models` (tools/fetch_models.py hamlet)")
        return 2
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    header = [
        f"`{command}` — Hamlet, ctx {args.ctx}, {args.chunks} windows (BOS first where the "
        "model adds one, second half scored); PPL ratio, KL and top-1 against the same engine's "
        f"F32 run; imatrix from the {args.calib_chunks} windows after the scored ones; bits per "
        "weight of the blocks' matrices as stored; seconds to quantize; PPL at load: the F32 "
        "file loaded with --quant FMT (same method and imatrix)."
        + (
            f" F32 weights dithered: uniform noise in ±{args.dither} × each row's RMS added "
            "(the sources are quantized files: off their grids)."
            if args.dither
            else ""
        ),
        "",
        "| engine | format | method | bits/weight | PPL | PPL ratio | KL mean | top-1 | s "
        "| PPL at load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("command: " + command)
    print("\n".join(header[2:]), flush=True)
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, args)
    table = "\n".join(header + rows)
    if args.write_readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        if START not in text or END not in text:
            print(f"README.md has no {START} ... {END} markers")
            return 2
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        readme.write_text(f"{head}{START}\n{table}\n{END}{tail}")
        print("README.md updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
