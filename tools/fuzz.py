"""Fuzz the parsers of untrusted files (a thin CLI over ``inferflow.fuzz``).

    python tools/fuzz.py gguf --count 100000 --seed 1 --out fuzz-out
    python tools/fuzz.py all --count 2000

Each input runs in a worker process with a memory bound and a per-input time limit; the exit
status is 1 when any bug was found. Crashing inputs (the smallest per distinct bug) and a JSON
report go under --out. Inputs are reproducible: input i of a campaign depends only on
(--seed, target, i), so --start resumes or splits a campaign.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from inferflow.fuzz import (
    MEMORY_BOUND,
    PUBLIC_TARGETS,
    TARGETS,
    TIME_LIMIT,
    Campaign,
    TargetReport,
    write_report,
)


def _show(r: TargetReport, final: bool = False) -> None:
    outcomes = ", ".join(f"{k} {v}" for k, v in r.outcomes.most_common())
    print(
        f"{r.target}: {r.inputs} inputs in {r.seconds:.0f} s ({r.rate:.0f}/s); {outcomes}",
        flush=True,
    )
    if final:
        print(f"  slowest input {r.slowest:.3f} s; worker restarted {r.worker_restarts} time(s)")
        if r.mutator_errors:
            print(
                f"  mutator failed on {r.mutator_errors} input(s), made by havoc instead "
                "(see the warnings)"
            )
        for bug in r.bugs.values():
            print(f"  BUG {bug.outcome} at {bug.site} x{bug.count}: {bug.message[:200]}")
            if bug.input_file:
                print(f"      input: {bug.input_file} ({bug.input_size} bytes)")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "target", choices=[*PUBLIC_TARGETS, "all", *sorted(set(TARGETS) - set(PUBLIC_TARGETS))]
    )
    ap.add_argument("--count", type=int, default=1000, help="inputs per target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="index of the first input")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per input")
    ap.add_argument(
        "--memory-mb", type=int, default=MEMORY_BOUND >> 20, help="address space one input may add"
    )
    ap.add_argument("--max-seconds", type=float, default=None, help="stop each target after this")
    ap.add_argument("--out", type=Path, default=Path("fuzz-out"), help="crashing inputs, report")
    args = ap.parse_args(argv)
    targets = list(PUBLIC_TARGETS) if args.target == "all" else [args.target]
    command = "python tools/fuzz.py " + shlex.join(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    reports = []
    with Campaign(
        targets,
        seed=args.seed,
        time_limit=args.time_limit,
        memory_bound=args.memory_mb << 20,
        out_dir=args.out,
    ) as campaign:
        for t in targets:
            r = campaign.run(t, args.count, args.start, args.max_seconds, progress=_show)
            _show(r, final=True)
            reports.append(r)
    write_report(reports, args.out / "report.json", command)
    print(f"report: {args.out / 'report.json'}")
    return 1 if any(r.bugs for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
