"""A corpus of malicious pickles, assembled from raw opcode bytes at test time.

Building a payload only concatenates bytes: this module imports nothing that could run a command.
Each payload, were it given to ``pickle.loads``, would create its own canary file (``touch``);
the tests assert that our loader refuses it, names what it refused, and that no canary appears.
``live`` marks the payloads that stdlib pickle really executes on Linux (the corpus's own test runs
a few of them in a subprocess to prove the corpus is not inert).
"""

from __future__ import annotations

import shlex
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROTOCOLS = range(6)
TORCH_MAGIC = 0x1950A86A20F9469CFC6C


@dataclass(frozen=True)
class Payload:
    name: str
    protocol: int
    data: bytes
    canary: Path
    refused: str  # what the loader's error must name: a global ('os.system') or an opcode
    live: bool  # stdlib pickle.loads really creates the canary (on Linux)


class Asm:
    """Emits opcodes in the spelling a given protocol would use (pickletools' opcode table)."""

    def __init__(self, protocol: int) -> None:
        self.p = protocol
        self.body = bytearray()
        self.memo = 0

    def op(self, raw: bytes) -> Asm:
        self.body += raw
        return self

    def str_(self, s: str) -> Asm:
        if self.p == 0:  # UNICODE, escaped like pickle.py's save_str for protocol 0
            for a, b in (
                ("\\", "\\u005c"),
                ("\0", "\\u0000"),
                ("\n", "\\u000a"),
                ("\r", "\\u000d"),
            ):
                s = s.replace(a, b)
            return self.op(b"V" + s.encode("raw-unicode-escape") + b"\n")
        raw = s.encode("utf-8")
        if self.p >= 4 and len(raw) < 256:
            return self.op(b"\x8c" + bytes([len(raw)]) + raw)  # SHORT_BINUNICODE
        return self.op(b"X" + struct.pack("<I", len(raw)) + raw)  # BINUNICODE

    def glob(self, module: str, name: str) -> Asm:
        if self.p >= 4:
            return self.str_(module).str_(name).op(b"\x93")  # STACK_GLOBAL
        return self.op(b"c" + module.encode() + b"\n" + name.encode() + b"\n")  # GLOBAL

    def mark(self) -> Asm:
        return self.op(b"(")

    def tuple_(self, build: Callable[[Asm], object], n: int) -> Asm:
        """A tuple of ``n`` items that ``build`` emits."""
        if n == 0:
            return self.op(b")" if self.p >= 1 else b"(t")
        if self.p >= 2 and n <= 3:
            build(self)
            return self.op(bytes([0x84 + n]))  # TUPLE1..3
        self.mark()
        build(self)
        return self.op(b"t")

    def list_(self, items: list[str]) -> Asm:
        self.op(b"(" if self.p == 0 else b"](")
        for it in items:
            self.str_(it)
        return self.op(b"l" if self.p == 0 else b"e")

    def dict_(self) -> Asm:
        return self.op(b"(d" if self.p == 0 else b"}")

    def put(self) -> int:
        idx = self.memo
        self.memo += 1
        if self.p >= 4:
            self.op(b"\x94")  # MEMOIZE
        elif self.p >= 1:
            self.op(b"q" + bytes([idx]))
        else:
            self.op(b"p%d\n" % idx)
        return idx

    def get(self, idx: int) -> Asm:
        return self.op(b"h" + bytes([idx]) if self.p >= 1 else b"g%d\n" % idx)

    def call(self, module: str, name: str, build: Callable[[Asm], object], n: int) -> Asm:
        """``module.name(*args)`` via GLOBAL + REDUCE."""
        return self.glob(module, name).tuple_(build, n).op(b"R")

    def finish(self) -> bytes:
        body = bytes(self.body) + b"."
        if self.p >= 4:  # protocol 4 frames the stream
            body = b"\x95" + struct.pack("<Q", len(body)) + body
        return (b"\x80" + bytes([self.p]) if self.p >= 2 else b"") + body


# ---- the payloads: (name, refused, live, first protocol, emitter(asm, canary)) ---------------


def _os_like(module: str) -> Callable[[Asm, str], object]:
    return lambda a, c: a.call(module, "system", lambda a: a.str_(f"touch {shlex.quote(c)}"), 1)


def _subprocess(fn: str) -> Callable[[Asm, str], object]:
    return lambda a, c: a.call("subprocess", fn, lambda a: a.list_(["touch", c]), 1)


def _open_write(a: Asm, c: str) -> None:
    a.call("builtins", "open", lambda a: a.str_(c).str_("w"), 2)  # creates (truncates) a file


def _popen(a: Asm, c: str) -> None:
    a.call("os", "popen", lambda a: a.str_(f"touch {shlex.quote(c)}"), 1)


def _eval(a: Asm, c: str) -> None:
    a.call("builtins", "eval", lambda a: a.str_(f"__import__('os').system('touch {c}')"), 1)


def _exec(a: Asm, c: str) -> None:
    a.call("builtins", "exec", lambda a: a.str_(f"import os\nos.system('touch {c}')"), 1)


def _getattr(a: Asm, c: str) -> None:
    # getattr(__import__('os'), 'system')('touch c'): REDUCE of a REDUCE result
    def args(a: Asm) -> None:
        a.call("builtins", "__import__", lambda a: a.str_("os"), 1).str_("system")

    a.call("builtins", "getattr", args, 2)
    a.tuple_(lambda a: a.str_(f"touch {c}"), 1).op(b"R")


def _import_first(a: Asm, c: str) -> None:
    # os = __import__('os') kept in the memo, then getattr(os, 'system')('touch c')
    a.call("builtins", "__import__", lambda a: a.str_("os"), 1)
    idx = a.put()
    a.op(b"0")  # POP
    a.call("builtins", "getattr", lambda a: a.get(idx).str_("system"), 2)
    a.tuple_(lambda a: a.str_(f"touch {c}"), 1).op(b"R")


def _main_class(a: Asm, c: str) -> None:
    a.call("__main__", "Exploit", lambda a: a.str_(f"touch {c}"), 1)


def _nested_reduce(a: Asm, c: str) -> None:
    # eval('lambda: ...') returns a function; calling it is a REDUCE on a REDUCE result
    a.call("builtins", "eval", lambda a: a.str_(f"lambda: __import__('os').system('touch {c}')"), 1)
    a.tuple_(lambda a: None, 0).op(b"R")


def _reconstructor(a: Asm, c: str) -> None:
    # copyreg._reconstructor(Popen, Popen, argv) runs Popen.__init__(obj, argv)
    def args(a: Asm) -> None:
        a.glob("subprocess", "Popen").glob("subprocess", "Popen").list_(["touch", c])

    a.call("copyreg", "_reconstructor", args, 3)


def _partial(a: Asm, c: str) -> None:
    a.call("functools", "partial", lambda a: a.glob("os", "system").str_(f"touch {c}"), 2)
    a.tuple_(lambda a: None, 0).op(b"R")


def _attrgetter(a: Asm, c: str) -> None:
    a.call("operator", "attrgetter", lambda a: a.str_("system"), 1)
    a.tuple_(lambda a: a.call("builtins", "__import__", lambda a: a.str_("os"), 1), 1).op(b"R")
    a.tuple_(lambda a: a.str_(f"touch {c}"), 1).op(b"R")


def _setstate(module: str, name: str) -> Callable[[Asm, str], object]:
    # BUILD {'__setstate__': os.system} puts a callable in the instance dict; the next BUILD
    # finds it through getattr(inst, '__setstate__') and calls it with the state
    def emit(a: Asm, c: str) -> None:
        a.call(module, name, lambda a: None, 0)
        a.dict_().str_("__setstate__").glob("os", "system").op(b"s").op(b"b")
        a.str_(f"touch {c}").op(b"b")

    return emit


def _inst(a: Asm, c: str) -> None:
    a.mark().str_(f"touch {c}").op(b"ios\nsystem\n")  # INST calls os.system(...) directly


def _obj(a: Asm, c: str) -> None:
    a.mark().glob("os", "system").str_(f"touch {c}").op(b"o")  # OBJ: cls(*args)


SPECS: list[tuple[str, str, bool, int, Callable[[Asm, str], object]]] = [
    ("os_system", "os.system", True, 0, _os_like("os")),
    ("posix_system", "posix.system", True, 0, _os_like("posix")),
    ("nt_system", "nt.system", False, 0, _os_like("nt")),  # Windows only
    ("subprocess_popen", "subprocess.Popen", True, 0, _subprocess("Popen")),
    ("subprocess_check_output", "subprocess.check_output", True, 0, _subprocess("check_output")),
    ("os_popen", "os.popen", True, 0, _popen),
    ("builtins_open", "builtins.open", True, 0, _open_write),
    ("builtins_eval", "builtins.eval", True, 0, _eval),
    ("builtins_exec", "builtins.exec", True, 0, _exec),
    ("builtins_getattr", "builtins.getattr", True, 0, _getattr),
    ("builtins_import", "builtins.__import__", True, 0, _import_first),
    ("main_class", "__main__.Exploit", False, 0, _main_class),  # needs the class in __main__
    ("nested_reduce", "builtins.eval", True, 0, _nested_reduce),
    ("copyreg_reconstructor", "copyreg._reconstructor", True, 0, _reconstructor),
    ("functools_partial", "functools.partial", True, 0, _partial),
    ("operator_attrgetter", "operator.attrgetter", True, 0, _attrgetter),
    ("build_setstate", "types.SimpleNamespace", True, 0, _setstate("types", "SimpleNamespace")),
    # the BUILD target is allow-listed here; the callable smuggled into its state is not
    ("build_setstate_ordereddict", "os.system", True, 0, _setstate("collections", "OrderedDict")),
    ("inst_opcode", "os.system", True, 0, _inst),
    ("obj_opcode", "os.system", True, 1, _obj),  # OBJ is a protocol 1 opcode
]


def cases() -> list[tuple[str, int]]:
    """(payload name, protocol) for every payload in every protocol where its opcodes exist."""
    return [(name, p) for name, _, _, first, _ in SPECS for p in PROTOCOLS if p >= first]


def build_one(name: str, protocol: int, canary_dir: Path) -> Payload:
    """One payload whose command would create ``canary_dir/CANARY-<name>-p<protocol>``."""
    _, refused, live, _, emit = next(s for s in SPECS if s[0] == name)
    canary = canary_dir / f"CANARY-{name}-p{protocol}"
    asm = Asm(protocol)
    emit(asm, str(canary))
    return Payload(name, protocol, asm.finish(), canary, refused, live)


def build(canary_dir: Path) -> list[Payload]:
    return [build_one(name, p, canary_dir) for name, p in cases()]


def wrap_zip(payload: bytes, path: Path) -> Path:
    """The payload as the data.pkl of a torch.save-style zip archive."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return path


def wrap_legacy(payload: bytes, path: Path) -> Path:
    """The payload as the state-dict pickle of a legacy (non-zip) torch.save stream."""
    magic = b"\x80\x02\x8a\x0a" + TORCH_MAGIC.to_bytes(10, "little") + b"."
    version = b"\x80\x02M\xe9\x03."  # 1001
    sys_info = b"\x80\x02}."
    path.write_bytes(magic + version + sys_info + payload + b"\x80\x02].")
    return path
