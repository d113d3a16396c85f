"""The fuzz worker process: runs inputs through a target and reports how each one ended.

Started by ``harness.Worker`` as ``python -m inferflow.fuzz.worker WORKDIR``. After a warm-up (so
lazy imports are done) the parent arms it: an address-space limit (``RLIMIT_AS``) of the current
size plus a fixed bound, and an audit hook that blocks and reports anything a loader must never
do while it reads a file (open for writing, delete, rename, mkdir, run a command, connect). Hangs
and crashes are the parent's to see: it watches the pipe with a deadline.

Protocol on stdin: ``<c kind><H name length><I data length>`` + name + data; kind R runs ``data``
through target ``name``, A arms with a bound of ``int(data)`` bytes. Each answer on stdout is a
4-byte length and a JSON object.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import resource
import shutil
import struct
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, BinaryIO

HEAD = struct.Struct("<cHI")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# audit events (PEP 578 table) that change the file system or leave the process
FORBIDDEN_EVENTS = frozenset(
    {
        "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate",
        "os.chmod", "os.chown", "os.utime", "os.chdir", "shutil.rmtree", "shutil.move",
        "shutil.copyfile", "shutil.copytree", "shutil.make_archive", "tempfile.mkstemp",
        "tempfile.mkdtemp", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
        "os.forkpty", "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "socket.connect",
        "socket.bind", "socket.sendto", "webbrowser.open", "urllib.Request", "ctypes.dlopen",
    }
)  # fmt: skip


class Blocked(BaseException):
    """Raised inside a target by the audit hook; BaseException so no loader swallows it."""


class Guard:
    def __init__(self) -> None:
        self.active = False
        self.violations: list[str] = []
        self.event = ""

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        bad = event in FORBIDDEN_EVENTS
        if event == "open":
            mode, flags = args[1], args[2]
            bad = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
            )
        elif event == "mmap.__new__":
            bad = args[2] == mmap.ACCESS_WRITE
        if bad:
            self.active = False  # the report itself must not trip the hook
            self.violations.append(f"{event}{args!r}"[:300])
            self.event = event
            raise Blocked(event)


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _is_alloc_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError | OSError)
        and ("can't allocate memory" in text or "cannot allocate memory" in text)
    )


def _site(tb: Any) -> str:
    """``file:line`` of the innermost frame inside inferflow (else the innermost of all)."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "/inferflow/" in f.filename and "/fuzz/" not in f.filename]
    if not (ours or frames):
        return "?"
    f = (ours or frames)[-1]
    return f"{f.filename.rsplit('/inferflow/', 1)[-1]}:{f.lineno}"


def run_one(target: Any, data: bytes, workdir: Path, n: int, guard: Guard) -> dict[str, Any]:
    from inferflow.errors import InferflowError

    path = workdir / f"input-{n}{target.suffix}"  # a fresh name: no cache sees a stale file
    path.write_bytes(data)
    result: dict[str, Any] = {"outcome": "ok"}
    t0 = time.perf_counter()
    guard.violations.clear()
    guard.active = True
    try:
        target.run(path)
    except Blocked:
        result = {"outcome": "bug:write"}
    except InferflowError as e:
        name = type(e).__name__
        result = {"outcome": f"error:{name}", "message": str(e)[:300]}
        if not str(e).strip():
            result = {"outcome": "bug:empty-message", "site": f"{name} {_site(e.__traceback__)}"}
    except BaseException as e:  # noqa: BLE001 -- every other ending is what the fuzzer hunts
        kind = "memory" if _is_alloc_failure(e) else type(e).__name__
        result = {
            "outcome": f"bug:{kind}",
            "site": f"{type(e).__name__} {_site(e.__traceback__)}",
            "message": str(e)[:500],
            "traceback": "".join(traceback.format_exception(e)[-12:])[-4000:],
        }
    finally:
        guard.active = False
    result["secs"] = time.perf_counter() - t0
    if guard.violations:
        result.update(
            outcome="bug:write", site=f"audit {guard.event}", message="; ".join(guard.violations)
        )
    path.unlink()
    left = sorted(os.listdir(workdir))
    if left:  # something the target created, e.g. through a C library the hook cannot see
        result.update(outcome="bug:write", site="workdir", message=f"files left: {left[:10]}")
        for name in left:
            p = workdir / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return result


def _read(f: BinaryIO, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def main(argv: list[str]) -> int:
    workdir = Path(argv[0]).resolve()
    os.chdir(workdir)
    sys.dont_write_bytecode = True
    logging.disable(logging.CRITICAL)  # loaders warn about odd files: not news here
    warnings.simplefilter("ignore")
    import torch

    from inferflow.fuzz.targets import TARGETS

    torch.set_num_threads(1)
    # answers go to a private copy of stdout; a target that prints cannot corrupt the protocol
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    guard = Guard()
    sys.addaudithook(guard.hook)
    n = 0
    while True:
        try:
            kind, tlen, dlen = HEAD.unpack(_read(inp, HEAD.size))
            name = _read(inp, tlen).decode()
            data = _read(inp, dlen)
        except EOFError:
            return 0
        if kind == b"A":
            limit = _vm_bytes() + int(data)
            resource.setrlimit(
                resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1])
            )
            reply: dict[str, Any] = {"armed": limit}
        else:
            reply = run_one(TARGETS[name], data, workdir, n, guard)
            n += 1
        raw = json.dumps(reply).encode()
        out.write(struct.pack("<I", len(raw)) + raw)
        out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
