"""The fuzz campaign: mutate seeds, run each input in the worker, judge and record the outcome.

Allowed outcomes: the load succeeds, or it raises one of Inferflow's own errors with a message.
Bugs: any other exception, an allocation past the memory bound (``bug:memory``), a write or
command (``bug:write``), an input still running after the time limit (``bug:hang``, confirmed by a
second run in a fresh worker; one that passes the second time counts as ``slow``), and a worker
that dies (``bug:crash``). Each distinct bug (outcome + where it was raised) keeps its smallest
input under the output folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inferflow.fuzz.mutate import havoc
from inferflow.fuzz.targets import TARGETS
from inferflow.fuzz.worker import HEAD

log = logging.getLogger(__name__)

MEMORY_BOUND = 1 << 30  # bytes a single input may add to the worker's address space
TIME_LIMIT = 2.0  # seconds per input


class WorkerDied(Exception):
    pass


class Worker:
    """The worker process, restarted (and warmed up again) whenever an input kills or hangs it."""

    def __init__(self, warmup: Sequence[tuple[str, bytes]], memory_bound: int, log: Path) -> None:
        self.warmup = list(warmup)
        self.memory_bound = memory_bound
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = ""
        self.starts = 0

    def start(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="inferflow-fuzz-")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inferflow.fuzz.worker", self.dir],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.starts += 1
        # the seeds first, so that lazy imports happen before the limits are set
        for name, data in self.warmup:
            if self.call(b"R", name, data, 120.0) is None:
                raise RuntimeError(
                    f"fuzz worker: warm-up on a {name} seed timed out; see {self.log}"
                )
        if self.call(b"A", "", str(self.memory_bound).encode(), 60.0) is None:
            raise RuntimeError(f"fuzz worker: no answer to arming; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def call(self, kind: bytes, name: str, data: bytes, timeout: float) -> dict[str, Any] | None:
        """The worker's answer, None past ``timeout`` seconds; WorkerDied if it exits."""
        if self.proc is None:
            self.start()
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(HEAD.pack(kind, len(name), len(data)) + name.encode() + data)
            proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerDied(self._death()) from None
        deadline = time.monotonic() + timeout
        buf = b""
        fd = proc.stdout.fileno()
        while True:
            if len(buf) >= 4 and len(buf) >= 4 + struct.unpack("<I", buf[:4])[0]:
                return json.loads(buf[4:])  # type: ignore[no-any-return]
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise WorkerDied(self._death())
            buf += chunk

    def _death(self) -> str:
        assert self.proc is not None
        code = self.proc.wait()
        self.stop()
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


@dataclass
class Bug:
    outcome: str
    site: str
    message: str
    count: int = 0
    input_file: str = ""
    input_size: int = 0
    first_input: int = 0  # index in the campaign (inputs are reproducible from seed + index)
    traceback: str = ""


@dataclass
class TargetReport:
    target: str
    inputs: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    bugs: dict[str, Bug] = field(default_factory=dict)
    slowest: float = 0.0
    worker_restarts: int = 0  # after a hang, a crash or an allocation failure
    mutator_errors: int = 0  # inputs made by blind havoc because the target's mutator raised

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["outcomes"] = dict(self.outcomes.most_common())
        out["inputs_per_second"] = round(self.rate, 1)
        out["bugs"] = list(out["bugs"].values())
        return out


def input_rng(seed: int, target: str, index: int) -> random.Random:
    return random.Random(f"{seed}/{target}/{index}")


def make_input(
    target: str,
    seeds: Sequence[bytes],
    seed: int,
    index: int,
    report: TargetReport | None = None,
) -> bytes:
    """Input ``index`` of a campaign: the seeds themselves first, then mutants."""
    if index < len(seeds):
        return seeds[index]
    rng = input_rng(seed, target, index)
    base = rng.choice(seeds)
    try:
        return TARGETS[target].mutate(rng, base, seeds)
    except Exception as e:
        # a bug in the mutator, not in a loader: logged and counted, the input made by havoc
        log.warning("fuzz %s input %d: mutator failed: %s: %s", target, index, type(e).__name__, e)
        if report is not None:
            report.mutator_errors += 1
        return havoc(rng, base, seeds)


class Campaign:
    """Seeds built once, one worker for all targets; ``run`` fuzzes one target for ``count``."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        seed: int = 0,
        time_limit: float = TIME_LIMIT,
        memory_bound: int = MEMORY_BOUND,
        out_dir: Path | None = None,
    ) -> None:
        self.seed = seed
        self.time_limit = time_limit
        self.out_dir = out_dir
        self.seeds = {t: [data for _, data in TARGETS[t].seeds()] for t in targets}
        self.own_dir = tempfile.mkdtemp(prefix="inferflow-fuzz-log-")
        warmup = [(t, s[0]) for t, s in self.seeds.items() if s]
        self.worker = Worker(warmup, memory_bound, Path(self.own_dir) / "worker.log")
        try:
            self.worker.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.worker.stop()
        shutil.rmtree(self.own_dir, ignore_errors=True)

    def __enter__(self) -> Campaign:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _attempt(self, target: str, data: bytes) -> dict[str, Any]:
        try:
            reply = self.worker.call(b"R", target, data, self.time_limit)
        except WorkerDied as e:
            return {"outcome": "bug:crash", "site": str(e), "message": f"worker {e}"}
        if reply is None:
            self.worker.stop()
            return {"outcome": "bug:hang", "site": "hang", "message": f"over {self.time_limit} s"}
        if reply["outcome"] == "bug:memory":
            self.worker.stop()  # a process that hit its limit is not trusted for the next input
        return reply

    def run_input(self, target: str, data: bytes) -> dict[str, Any]:
        reply = self._attempt(target, data)
        if reply["outcome"] in ("bug:hang", "bug:crash"):
            again = self._attempt(target, data)  # a loaded machine, or an OOM kill from outside?
            if again["outcome"] != reply["outcome"]:
                return {"outcome": "slow" if reply["outcome"] == "bug:hang" else "flaky-crash"}
        return reply

    def run(
        self,
        target: str,
        count: int,
        start: int = 0,
        max_seconds: float | None = None,
        progress: Callable[[TargetReport], None] | None = None,
    ) -> TargetReport:
        report = TargetReport(target)
        seeds = self.seeds[target]
        starts = self.worker.starts
        t0 = last = time.monotonic()
        for index in range(start, start + count):
            data = make_input(target, seeds, self.seed, index, report)
            reply = self.run_input(target, data)
            report.inputs += 1
            report.outcomes[reply["outcome"]] += 1
            report.slowest = max(report.slowest, reply.get("secs", 0.0))
            if reply["outcome"].startswith("bug:"):
                self._record(report, reply, data, index)
            now = time.monotonic()
            if progress is not None and now - last > 10:
                report.seconds, last = now - t0, now
                progress(report)
            if max_seconds is not None and now - t0 > max_seconds:
                break
        report.seconds = time.monotonic() - t0
        report.worker_restarts = self.worker.starts - starts
        return report

    def _record(self, report: TargetReport, reply: dict[str, Any], data: bytes, index: int) -> None:
        key = f"{reply['outcome']} {reply.get('site', '')}"
        bug = report.bugs.get(key)
        if bug is None:
            bug = report.bugs[key] = Bug(
                reply["outcome"],
                reply.get("site", ""),
                reply.get("message", ""),
                first_input=index,
                traceback=reply.get("traceback", ""),
            )
        bug.count += 1
        if self.out_dir is not None and (not bug.input_file or len(data) < bug.input_size):
            folder = self.out_dir / report.target
            folder.mkdir(parents=True, exist_ok=True)
            if bug.input_file:
                Path(bug.input_file).unlink(missing_ok=True)
            digest = hashlib.sha1(data).hexdigest()[:12]
            path = folder / f"{reply['outcome'][4:]}-{digest}{TARGETS[report.target].suffix}"
            path.write_bytes(data)
            bug.input_file, bug.input_size = str(path), len(data)
            bug.message = reply.get("message", "")  # the message of the kept input


def write_report(reports: Sequence[TargetReport], path: Path, command: str) -> None:
    doc = {"command": command, "targets": [r.to_json() for r in reports]}
    path.write_text(json.dumps(doc, indent=2) + "\n")
