"""How long ``inferflow quantize`` takes, per model and format, in fresh processes (start-up,
reading the source, quantizing and writing the GGUF: what a user waits for).

    python benchmarks/quantize_speed.py [--specs smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct]
                                        [--formats Q4_B32,Q3H,Q2,Q4_0,Q4_K,Q3_K] [--rounds 3]

Inferflow's formats use the default method (the searched grid, quant/minmax.py); GGML formats
their reference quantizers. Reports the median wall seconds and peak RSS over ``--rounds``
runs, the output's size, and the process's own "wrote ..." line.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _one(spec: str, fmt: str, out: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS in MiB) of one `inferflow quantize` process."""
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "inferflow.cli.main"]
    cmd += ["quantize", spec, "-o", str(out), "--format", fmt, "--force"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return wall, int(done.stderr.strip().splitlines()[-1]) // 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--formats", default="Q4_B32,Q3H,Q2,Q4_0,Q4_K,Q3_K")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("command: python benchmarks/quantize_speed.py " + shlex.join(sys.argv[1:]))
    print(f"medians of {args.rounds} fresh processes; seconds, MiB\n")
    print("| model | format | seconds | peak RSS | output MiB |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.specs.split(","):
            for fmt in args.formats.split(","):
                out = Path(tmp) / f"{fmt}.gguf"
                runs = [_one(spec, fmt, out) for _ in range(args.rounds)]
                wall = statistics.median(r[0] for r in runs)
                rss = statistics.median(r[1] for r in runs)
                size = out.stat().st_size / 2**20
                print(f"| {spec} | {fmt} | {wall:.1f} | {rss} | {size:.0f} |", flush=True)
                out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
