"""A pickle opcode interpreter that never imports or calls anything it was not given.

``pickle.load`` resolves globals through the import machinery and calls whatever REDUCE names;
that is arbitrary code execution on untrusted files. This module walks the opcode stream itself:
globals are looked up in a table the caller provides (``resolve``), the only callables are
``SafeCallable`` objects from that table, every length is checked against the bytes that are
actually there before anything is allocated, and the work a stream asks for is counted against
``PickleLimits`` (``pickle_limits``). Opcode semantics follow CPython's
``Lib/pickle.py`` (``_Unpickler``) and the protocol descriptions in ``Lib/pickletools.py``.
The opcode handlers are ``loaders/pickle_ops.py``; this module is the machine that runs them.
"""

from __future__ import annotations

import logging
import mmap
import pickletools
import struct
from collections.abc import Callable
from typing import Any, NoReturn

from inferflow.errors import CheckpointError, UnsafePickleError
from inferflow.loaders import pickle_limits as lim
from inferflow.loaders.pickle_limits import HASH_MODULUS, PickleLimits
from inferflow.loaders.pickle_ops import _DISPATCH, Record, RecordClass, T, _decode_str
from inferflow.loaders.pickle_ops import HIGHEST_PROTOCOL as HIGHEST_PROTOCOL
from inferflow.loaders.pickle_ops import SafeCallable as SafeCallable

log = logging.getLogger(__name__)

# the stream: anything with slicing, indexing to int and ``find`` (bytes or a memory map)
Buffer = bytes | bytearray | mmap.mmap

# resolve(module, name) -> the allow-listed object, or None when the global is refused
Resolver = Callable[[str, str], Any]
PersistentLoad = Callable[[Any], Any]

# opcode byte -> name, for every opcode of protocols 0-5 (pickletools only describes them)
OPCODE_NAMES: dict[int, str] = {ord(op.code): op.name for op in pickletools.opcodes}

# Opcodes that exist but have no handler below, on purpose: a state dict never needs them and
# they only serve to build arbitrary objects (INST/OBJ call classes, EXT* go through copyreg's
# extension registry, NEXT_BUFFER/READONLY_BUFFER need out-of-band buffers).
REFUSED_OPCODES = frozenset(ord(c) for c in ("i", "o", "\x82", "\x83", "\x84", "\x97", "\x98"))


# what hostile or corrupt input makes built-in containers and conversions raise
_DATA_ERRORS = (
    TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError, struct.error,
    RecursionError,
)  # fmt: skip


class _Machine:
    def __init__(
        self,
        data: Buffer,
        pos: int,
        resolve: Resolver,
        allowed: Callable[[], str],
        persistent_load: PersistentLoad | None,
        limits: PickleLimits,
    ) -> None:
        self.data = data
        self.end = len(self.data)
        self.pos: int = pos
        self.op_pos: int = pos
        self.op = 0
        self.resolve = resolve
        self.allowed = allowed
        self.persistent_load = persistent_load
        self.limits = limits
        self.objects = self.items = self.alloc = 0  # what the stream built: see PickleLimits
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.depth_items = 0  # objects held under marks, counted against max_stack
        self.memo: dict[int, Any] = {}
        # id -> (nesting depth, the tuple itself, kept alive so that ids are never reused)
        self.tuple_depth: dict[int, tuple[int, tuple[Any, ...]]] = {}

    # ---- reading -------------------------------------------------------------------------
    def fail(self, why: str) -> CheckpointError:
        name = OPCODE_NAMES.get(self.op, f"0x{self.op:02x}")
        return CheckpointError(f"malformed pickle at byte offset {self.op_pos} ({name}): {why}")

    def take(self, n: int) -> bytes:
        if n < 0:
            raise self.fail(f"negative length {n}")
        if n > self.end - self.pos:
            raise self.fail(
                f"truncated: needs {n} bytes, only {self.end - self.pos} left in the stream"
            )
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def line(self) -> bytes:
        limit = min(self.end, self.pos + self.limits.max_line)
        i = self.data.find(b"\n", self.pos, limit)
        if i < 0:
            if limit == self.end:
                raise self.fail("truncated: line without a newline")
            raise self.fail(f"line longer than {self.limits.max_line} bytes")
        out = bytes(self.data[self.pos : i])
        self.pos = i + 1
        return out

    # ---- stack ---------------------------------------------------------------------------
    def push(self, obj: Any) -> None:
        if len(self.stack) + self.depth_items >= self.limits.max_stack:
            raise self.fail(f"stack grew past {self.limits.max_stack} objects")
        self.stack.append(obj)

    def pop(self) -> Any:
        if not self.stack:
            raise self.fail("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise self.fail("stack underflow")
        return self.stack[-1]

    def new(self, obj: T, nbytes: int, items: int = 0, objects: int = 1) -> T:
        """Count a newly built object (and the entries put in it) against the limits."""
        self.objects += objects
        self.items += items
        self.alloc += nbytes
        limits = self.limits
        if (
            self.objects > limits.max_objects
            or self.items > limits.max_items
            or self.alloc > limits.max_alloc_bytes
        ):
            raise self.fail(lim.exceeded(limits, self.objects, self.items, self.alloc))
        return obj

    def check_keys(self, keys: list[Any]) -> None:
        why = lim.refuse_keys(keys)
        if why:
            raise self.fail(why)

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise self.fail("no MARK to pop to")
        items = self.stack
        self.stack = self.metastack.pop()
        self.depth_items -= len(self.stack)
        return items

    def make_tuple(self, items: list[Any] | tuple[Any, ...]) -> tuple[Any, ...]:
        depth = 1
        for x in items:
            if type(x) is tuple:
                depth = max(depth, self.tuple_depth.get(id(x), (1,))[0] + 1)
        if depth > self.limits.max_tuple_depth:
            raise self.fail(f"tuples nested deeper than {self.limits.max_tuple_depth}")
        t = self.new(
            tuple(items), lim.SIZE_TUPLE + lim.SIZE_SLOT * len(items) + lim.SIZE_ENTRY * (depth > 1)
        )
        if depth > 1:
            self.tuple_depth[id(t)] = (depth, t)
        return t

    def memo_put(self, idx: int, obj: Any) -> None:
        if not 0 <= idx < HASH_MODULUS:  # a larger index could be made to collide in the memo
            raise self.fail(f"memo index {idx} outside 0..{HASH_MODULUS - 1}")
        if idx not in self.memo:
            if len(self.memo) >= self.limits.max_memo:
                raise self.fail(f"memo grew past {self.limits.max_memo} entries")
            self.new(None, lim.SIZE_ENTRY + lim.SIZE_NUMBER, items=1, objects=0)
        self.memo[idx] = obj

    def memo_get(self, idx: int) -> Any:
        try:
            return self.memo[idx]
        except KeyError:
            raise self.fail(f"memo index {idx} was never stored") from None

    def global_(self, module: str, name: str) -> Any:
        obj = self.resolve(module, name)
        if obj is None:
            raise UnsafePickleError(
                f"refused global '{module}.{name}' ({OPCODE_NAMES[self.op]}) at byte offset "
                f"{self.op_pos}; "
                f"allowed: {self.allowed()}"
            )
        return obj

    def refuse_opcode(self) -> NoReturn:
        name = OPCODE_NAMES.get(self.op)
        if name is None:
            raise CheckpointError(
                f"malformed pickle: unknown opcode byte 0x{self.op:02x} at byte offset "
                f"{self.op_pos}"
            )
        if name == "INST":
            # INST names its class inline: a refused class is reported like any global
            module, qual = _decode_str(self, self.line()), _decode_str(self, self.line())
            self.global_(module, qual)
            raise UnsafePickleError(
                f"refused opcode INST at byte offset {self.op_pos} (instantiates "
                f"'{module}.{qual}'): not supported"
            )
        raise UnsafePickleError(
            f"refused opcode {name} at byte offset {self.op_pos}: not supported"
        )

    # ---- main loop -----------------------------------------------------------------------
    def run(self) -> Any:
        for _ in range(self.limits.max_opcodes):
            if self.pos >= self.end:
                raise CheckpointError(
                    f"truncated pickle: stream ended at byte offset {self.pos} without STOP"
                )
            self.op_pos = self.pos
            self.op = self.data[self.pos]
            self.pos += 1
            if self.op == 0x2E:  # STOP
                return self.pop()
            handler = _DISPATCH.get(self.op)
            if handler is None:
                self.refuse_opcode()
            try:
                handler(self)
            except CheckpointError:
                raise
            except _DATA_ERRORS as e:
                raise self.fail(f"{type(e).__name__}: {e}") from e
        raise self.fail(
            f"ran more than {self.limits.max_opcodes} opcodes (PickleLimits.max_opcodes)"
        )


def load_one(
    data: Buffer,
    pos: int = 0,
    *,
    resolve: Resolver,
    allowed: Callable[[], str],
    persistent_load: PersistentLoad | None = None,
    limits: PickleLimits | None = None,
) -> tuple[Any, int]:
    """Interpret one pickle starting at ``pos``; return the object and the offset after STOP.

    ``resolve(module, name)`` returns the allow-listed object for a global or None to refuse it;
    ``allowed()`` describes the allow-list for the error message.
    """
    m = _Machine(data, pos, resolve, allowed, persistent_load, limits or PickleLimits())
    return m.run(), m.pos


def _no_globals(module: str, name: str) -> None:
    return None


def loads_plain(data: bytes, limits: PickleLimits | None = None) -> Any:
    """Interpret a pickle of plain built-in values only (no globals, no persistent ids)."""
    obj, _ = load_one(data, resolve=_no_globals, allowed=lambda: "(none)", limits=limits)
    return obj


def loads_records(
    data: bytes, classes: frozenset[tuple[str, str]], limits: PickleLimits | None = None
) -> Any:
    """Like ``loads_plain``, but instances of the (module, name) ``classes`` are allowed and
    read as their pickled state (a top-level instance is returned as its state)."""

    def resolve(module: str, name: str) -> RecordClass | None:
        return RecordClass(f"{module}.{name}") if (module, name) in classes else None

    def allowed() -> str:
        return ", ".join(f"{m}.{n}" for m, n in sorted(classes)) or "(none)"

    obj, _ = load_one(data, resolve=resolve, allowed=allowed, limits=limits)
    return obj.state if isinstance(obj, Record) else obj
