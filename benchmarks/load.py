"""Load memory and time: for each model, a fresh process loads it and computes a first token.

Per model (medians over ``--rounds`` fresh processes): checkpoint file size; resident memory
after ``import torch`` and the loader (the floor every model pays); the bytes the loaded
weights hold (inferflow.model.materialise.resident_bytes: kernel copies included); load time; peak RSS while
loading (VmHWM when load_model returns); RSS once loaded; time to the first token
(one decode step of a 4-token prompt, an embedding or one translation step); the peak over
the whole run. With ``--llama-cli``, llama.cpp's peak RSS for one token on the same GGUF.

    python benchmarks/load.py [--specs smollm2-135m-instruct,gemma-3-270m,...]
                              [--synthetic DIR] [--rounds 3] [--llama-cli PATH]

``--synthetic DIR`` adds a ~1.5B-weight Q4_0 llama-shaped GGUF written there by
tools/synthetic_gguf.py (0.9 GB; written once, reused).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPECS = [
    "smollm2-135m-instruct",
    "gemma-3-270m",
    "qwen2.5-coder-0.5b-instruct",
    "all-minilm-l6-v2",
    "annalog-smiles",
]
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    try:
        from inferflow.model.materialise import peak_rss
    except ImportError:  # (an older checkout measured for comparison)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)
    return peak_rss()


def child(ref: str) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    t0 = time.perf_counter()
    import torch

    from inferflow.engine.sampling import SamplingParams
    from inferflow.engine.search import SearchParams
    from inferflow.runtime import load
    from inferflow.spec import load_spec

    spec = load_spec(ref)
    floor, t1 = _rss(), time.perf_counter()
    lm = load(spec)
    t2 = time.perf_counter()
    peak_load, loaded = _peak(), _rss()
    try:
        from inferflow.model.materialise import resident_bytes

        weights = float(sum(resident_bytes(lm.model)))
    except ImportError:  # (an older checkout measured for comparison)
        weights = float("nan")
    ids = [5, 6, 7, 8]
    with torch.inference_mode():
        if spec.network.type == "decoder_only":
            next(iter(lm.stream(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))))
        elif spec.network.type == "encoder_only":
            lm.embed([ids])
        else:
            lm.translate_ids([ids], SearchParams(max_new_tokens=1))
    t3 = time.perf_counter()
    files = spec.source.files
    size = sum(
        sum(p.stat().st_size for p in f.rglob("*") if p.is_file())
        if f.is_dir()
        else f.stat().st_size
        for f in files
    )
    print(
        json.dumps(
            {
                "file": size,
                "floor": floor,
                "import_s": t1 - t0,
                "load_s": t2 - t1,
                "peak_load": peak_load,
                "weights": weights,
                "loaded": loaded,
                "first_token_s": t3 - t2,
                "peak": _peak(),
                "gguf": str(files[0]) if spec.source.format == "gguf" else None,
            }
        )
    )


def _run_child(ref: str) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, __file__, "--child", ref],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{ref}: the measuring process failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# Started from a small process: a child's ru_maxrss also counts the memory of the process it
# was forked from, so llama.cpp is forked from this tiny interpreter, not from the benchmark.
_FORK_AND_WAIT = """
import os, sys
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1), os.dup2(null, 2)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(status, usage.ru_maxrss)
"""


def llama_peak(cli: str, gguf: str) -> float:
    """llama.cpp's peak RSS (bytes) generating one token from ``gguf`` with 2 threads."""
    args = [cli, "-m", gguf, "-p", "Hello", "-n", "1", "-t", "2", "-no-cnv", "--no-warmup"]
    out = subprocess.run(
        [sys.executable, "-c", _FORK_AND_WAIT, *args], capture_output=True, text=True, check=True
    )
    status, maxrss = map(int, out.stdout.split())
    if status != 0:
        raise RuntimeError(f"{cli} failed on {gguf} (wait status {status})")
    return maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--specs", default=",".join(DEFAULT_SPECS))
    ap.add_argument("--synthetic", type=Path, default=None, help="also a ~1.5B GGUF written here")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-cli", default=None, help="a llama-cli binary, for its peak RSS")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    refs = [s for s in args.specs.split(",") if s]
    if args.synthetic is not None:
        spec = args.synthetic / "synthetic-1.5b.yaml"
        if not spec.exists():
            sys.path.insert(0, str(ROOT / "tools"))
            from synthetic_gguf import write

            spec = write(args.synthetic, "1.5b")
        refs.append(str(spec))
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"medians of {args.rounds} fresh processes each; MiB; seconds\n")
    cols = "| model | file | floor | weights | load s | peak in load | loaded | first token s | peak | llama.cpp peak (ratio) |"
    print(cols)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ref in refs:
        name = Path(ref).stem if ref.endswith(".yaml") else ref
        try:
            runs = [_run_child(ref) for _ in range(args.rounds)]
        except RuntimeError as e:
            print(f"| {name} | skipped: {str(e).splitlines()[0]} ||||||||")
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "gguf"}
        gguf = runs[0]["gguf"]
        peer = "-"
        if args.llama_cli and gguf:
            try:  # (same file, same 2 threads' box)
                theirs = llama_peak(args.llama_cli, str(gguf))
                peer = f"{theirs / MIB:.0f} (ours {med['peak'] / theirs:.2f}x)"
            except RuntimeError:  # e.g. the synthetic file: no tokenizer in it
                peer = "llama.cpp cannot load it"
        print(
            f"| {name} | {med['file'] / MIB:.0f} | {med['floor'] / MIB:.0f} | "
            f"{med['weights'] / MIB:.0f} | "
            f"{med['load_s']:.2f} | {med['peak_load'] / MIB:.0f} | {med['loaded'] / MIB:.0f} | "
            f"{med['first_token_s']:.2f} | {med['peak'] / MIB:.0f} | {peer} |"
        )


if __name__ == "__main__":
    main()
