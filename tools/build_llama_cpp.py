"""A llama.cpp build for interchange tests and benchmarks, from llama-cpp-python's source
distribution on PyPI (it vendors llama.cpp), built once and cached.

    python tools/build_llama_cpp.py            # prints the directory holding llama-perplexity etc.
    python tools/build_llama_cpp.py --server   # the same for llama-server (benchmarks/serve.py)

The binaries (``llama-completion``, ``llama-perplexity``, ``llama-quantize``, ``llama-imatrix``)
are linked statically and kept in ``~/.cache/inferflow/llama.cpp/<version>/bin``
(``INFERFLOW_LLAMA_CPP`` names another directory holding them). A build takes 10-20 minutes on
two cores; later calls find it and return at once. Tests call ``ensure()`` and skip with the
reason when it cannot build (no compiler, no cmake, no registry).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's release; its vendor/llama.cpp is what gets built
TOOLS = ("llama-completion", "llama-perplexity", "llama-quantize", "llama-imatrix")
SERVER = ("llama-server",)  # built apart (its own directory): the tests do not need it
# The host's instruction sets but AMX: on a VM whose CPU lists AMX, ggml's AMX matrix code ends
# in SIGILL at its first tile instruction (seen on a 2-core Xeon guest), and the comparisons want
# llama.cpp's AVX-512 / AVX2 kernels anyway. GGML_NATIVE (-march=native) would turn AMX on, so
# each of ggml's x86 switches is set from /proc/cpuinfo instead; like the native build, they
# apply to ggml's CPU kernels only (its reference quantizers stay baseline x86-64, no FMA, whose
# bytes tests/test_llama_cpp_interchange.py compares with ours).
X86_SWITCHES = {
    "GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma",
    "GGML_F16C": "f16c", "GGML_BMI2": "bmi2", "GGML_AVX_VNNI": "avx_vnni",
    "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16",
}  # fmt: skip
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
]  # fmt: skip


def _x86_flags() -> list[str]:
    """ggml's x86 switches, each on where this CPU has its instructions (none elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    if "avx2" not in have:  # (not x86, or an old one: ggml's defaults)
        return []
    return [f"-D{k}={'ON' if v in have else 'OFF'}" for k, v in X86_SWITCHES.items()]


# (a build with other flags is another folder; "-noamx2": the switches above, AMX off)
CACHE = Path.home() / ".cache" / "inferflow" / "llama.cpp" / f"{VERSION}-noamx2"


class BuildError(RuntimeError):
    pass


def _have(bin_dir: Path, tools: tuple[str, ...] = TOOLS) -> bool:
    return all(os.access(bin_dir / t, os.X_OK) for t in tools)


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BuildError(f"{cmd[0]} failed (exit {rc}); log {log}:\n" + "\n".join(tail))


def ensure(jobs: int | None = None, server: bool = False) -> Path:
    """The directory holding the llama.cpp tools (``server``: llama-server), building them
    first if no cached build exists."""
    tools = SERVER if server else TOOLS
    given = os.environ.get("INFERFLOW_LLAMA_CPP")
    if given:
        if not _have(Path(given), tools):
            raise BuildError(f"INFERFLOW_LLAMA_CPP={given} lacks one of {', '.join(tools)}")
        return Path(given)
    bin_dir = CACHE / ("server-bin" if server else "bin")
    if _have(bin_dir, tools):
        return bin_dir
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"building llama.cpp needs {tool} on PATH")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second caller waits for the first build
        if not _have(bin_dir, tools):
            _build(bin_dir, jobs, tools)
    return bin_dir


def _build(bin_dir: Path, jobs: int | None, tools: tuple[str, ...]) -> None:
    log = CACHE / ("build-server.log" if tools == SERVER else "build.log")
    log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        work = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q"]
        pip += [
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(work),
            f"llama-cpp-python=={VERSION}",
        ]
        _run(pip, log)
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        prefix = f"{sdist.name[: -len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(work, members=members, filter="data")
        src = work / prefix
        build = work / "build"
        server = "ON" if tools == SERVER else "OFF"
        flags = [*CMAKE_FLAGS, *_x86_flags(), f"-DLLAMA_BUILD_SERVER={server}"]
        _run(["cmake", "-S", str(src), "-B", str(build), *flags], log)
        jobs = jobs or os.cpu_count() or 2
        _run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *tools], log)
        staged = work / "bin"
        staged.mkdir()
        for t in tools:
            shutil.copy2(build / "bin" / t, staged / t)
        if bin_dir.exists():
            shutil.rmtree(bin_dir)
        staged.rename(bin_dir)  # all tools appear at once: a half-built cache is never found


def main() -> int:
    try:
        print(ensure(server="--server" in sys.argv[1:]))
    except BuildError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
