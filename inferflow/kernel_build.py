"""Compiling the C kernels (inferflow/kernels) into the kernel cache. No torch here, nor in the
package this module sits in, so a command can start the builds it will need before ``import
torch`` (2 s on a 2-core machine) and overlap the two."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from functools import cache
from pathlib import Path

log = logging.getLogger("inferflow.kernels")

HERE = Path(__file__).resolve().parent / "kernels"
# Vectorized sums need reassociation; not -ffast-math, whose shared libraries switch the whole
# process to flush-to-zero on load (5e-324 would become 0 in every later Python computation)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros"]
FLAGS += ["-fassociative-math", "-fopenmp", "-shared", "-fPIC"]
# the kernels a model's forward pass may call (quant_search: only `quantize`)
INFERENCE_KERNELS = ("rows", "paged_attention", "quant_decode")
_locks: dict[Path, threading.Lock] = {}
_locks_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("INFERFLOW_KERNELS", "1").strip().lower() not in ("0", "off", "no")


def cache_dir() -> Path:
    env = os.environ.get("INFERFLOW_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "inferflow" / "kernels"


@cache
def _cpu_key() -> str:
    """What -march=native depends on: the CPU's feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compile_kernel(here: Path, name: str, flags: list[str]) -> Path:
    """Compile ``here/name.c`` (once per source, the folder's headers, flags and CPU) and return
    the shared library. Builds of one library in this process wait for each other; other
    processes may build it at once (each writes a temporary file and renames it)."""
    src = here / f"{name}.c"
    cc = shlex.split(os.environ.get("CC", "cc"))
    headers = [h.read_bytes() for h in sorted(here.glob("*.h"))]  # what a source may include
    key = hashlib.sha256(
        b"\0".join([src.read_bytes(), *headers, " ".join(cc + flags).encode(), _cpu_key().encode()])
    ).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    with _locks_lock:
        lock = _locks.setdefault(out, threading.Lock())
    with lock:
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            cmd = [*cc, *flags, str(src), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{shlex.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.info("built kernel %s: %s", name, out)
    return out


def prebuild(names: Iterable[str] = INFERENCE_KERNELS) -> None:
    """Start building ``names`` in background threads (compilers run as their own processes):
    a later ``build`` of one waits for it instead of compiling it again. The threads are not
    daemons, so a command that ends first still finishes the builds it started (no half-written
    cache). A failure here is left for the real build to report."""
    if not enabled():
        return

    def one(name: str) -> None:
        try:
            compile_kernel(HERE, name, FLAGS)
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("prebuild of kernel %s failed: %s", name, e)

    for name in names:
        threading.Thread(target=one, args=(name,), name=f"build-{name}").start()
