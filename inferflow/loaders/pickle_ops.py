"""The pickle interpreter's opcode handlers (``_DISPATCH``: opcode byte -> handler) and what they
share with the machine (``SafeCallable``, the highest protocol). Semantics as in CPython's
``Lib/pickle.py``; every handler checks what it reads against the machine's limits. The machine
that runs them is ``loaders/pickle_vm.py``."""

from __future__ import annotations

import codecs
import logging
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from inferflow.errors import UnsafePickleError
from inferflow.loaders import pickle_limits as lim

if TYPE_CHECKING:
    from inferflow.loaders.pickle_vm import _Machine

log = logging.getLogger(__name__)

HIGHEST_PROTOCOL = 5


class SafeCallable:
    """An allow-listed global that REDUCE (and, if ``new`` is overridden, NEWOBJ) may call.

    Subclasses are written by us; the VM calls nothing else.
    """

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def call(self, args: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def new(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise UnsafePickleError(f"NEWOBJ on '{self.qualname}' is not allowed")

    def __repr__(self) -> str:
        return f"<allow-listed {self.qualname}>"


class Record:
    """An instance of an allow-listed class kept as its pickled state: nothing is instantiated,
    no ``__setstate__`` runs (``loads_records``)."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname
        self.state: Any = None


class RecordClass(SafeCallable):
    """A class NEWOBJ may name: it yields a ``Record`` that BUILD fills with the state."""

    def new(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args or kwargs:
            raise UnsafePickleError(f"NEWOBJ on '{self.qualname}' with arguments is not allowed")
        return Record(self.qualname)


T = TypeVar("T")


def _describe(obj: object) -> str:
    if isinstance(obj, SafeCallable):
        return f"the global '{obj.qualname}'"
    return f"an object of type {type(obj).__name__}"


def _decode_str(m: _Machine, raw: bytes) -> str:
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise m.fail(f"invalid UTF-8 text: {e}") from None


def _text_string(m: _Machine, raw: bytes) -> str:
    # STRING carries a Python 2 repr: a quoted, backslash-escaped byte string
    if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b"'", b'"'):
        raise m.fail("STRING argument is not a quoted string")
    return _decode_str(m, codecs.escape_decode(raw[1:-1])[0])


def _op_mark(m: _Machine) -> None:
    if len(m.metastack) >= m.limits.max_marks:
        raise m.fail(f"MARKs nested deeper than {m.limits.max_marks}")
    m.metastack.append(m.stack)
    m.depth_items += len(m.stack)
    m.stack = []


def _op_proto(m: _Machine) -> None:
    proto = m.uint(1)
    if proto > HIGHEST_PROTOCOL:
        raise m.fail(f"unsupported pickle protocol {proto} (known: 0-{HIGHEST_PROTOCOL})")


def _op_frame(m: _Machine) -> None:
    # framing only groups opcodes for buffered readers; the payload is read in place
    size = m.uint(8)
    if size > m.end - m.pos:
        raise m.fail(f"truncated: FRAME of {size} bytes, only {m.end - m.pos} left")


def _op_int(m: _Machine) -> None:
    raw = m.line()
    if raw == b"00":
        m.push(False)
    elif raw == b"01":
        m.push(True)
    else:
        m.push(m.new(int(raw), lim.SIZE_NUMBER))


def _op_long(m: _Machine) -> None:
    raw = m.line()
    m.push(m.new(int(raw[:-1] if raw.endswith(b"L") else raw), lim.SIZE_NUMBER + len(raw)))


def _op_long_n(nbytes_len: int) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        n = m.uint(nbytes_len)
        if n > m.limits.max_long_bytes:
            raise m.fail(f"integer of {n} bytes exceeds the limit {m.limits.max_long_bytes}")
        m.push(m.new(int.from_bytes(m.take(n), "little", signed=True), lim.SIZE_NUMBER + n))

    return op


def _op_binint(m: _Machine) -> None:
    m.push(m.new(int.from_bytes(m.take(4), "little", signed=True), lim.SIZE_NUMBER))


def _op_persid(m: _Machine, pid: Any) -> None:
    if m.persistent_load is None:
        raise UnsafePickleError(
            f"persistent id at byte offset {m.op_pos} refused: this stream may not reference "
            "external objects"
        )
    m.push(m.new(m.persistent_load(pid), lim.SIZE_CALL))


def _op_reduce(m: _Machine) -> None:
    args = m.pop()
    func = m.pop()
    if not isinstance(func, SafeCallable):
        raise UnsafePickleError(
            f"refused REDUCE at byte offset {m.op_pos}: callee is {_describe(func)}, "
            "only allow-listed globals may be called"
        )
    if not isinstance(args, tuple):
        raise m.fail(f"REDUCE arguments must be a tuple, got {type(args).__name__}")
    out = func.call(args)
    n = len(out) if isinstance(out, dict | set | frozenset) else 0  # OrderedDict(pairs), set(list)
    m.push(m.new(out, lim.SIZE_CALL + lim.SIZE_ENTRY * n, items=n))


def _op_newobj(m: _Machine, kwargs: dict[str, Any]) -> None:
    args = m.pop()
    cls = m.pop()
    if not isinstance(cls, SafeCallable):
        raise UnsafePickleError(
            f"refused NEWOBJ at byte offset {m.op_pos}: class is {_describe(cls)}"
        )
    if not isinstance(args, tuple):
        raise m.fail("NEWOBJ arguments must be a tuple")
    m.push(m.new(cls.new(args, kwargs), lim.SIZE_CALL))


def _op_newobj_ex(m: _Machine) -> None:
    kwargs = m.pop()
    if not isinstance(kwargs, dict):
        raise m.fail("NEWOBJ_EX keyword arguments must be a dict")
    _op_newobj(m, kwargs)


def _op_build(m: _Machine) -> None:
    state = m.pop()
    inst = m.top()
    if type(inst) is Record:
        if inst.state is not None:
            raise UnsafePickleError(f"second BUILD at byte offset {m.op_pos} on {inst.qualname}")
        inst.state = state
        return
    # The only BUILD a state dict needs is OrderedDict's instance dict (``state_dict()`` carries
    # ``_metadata``). We never setattr: the state is checked and dropped, so ``__setstate__``
    # tricks have nothing to hook into.
    if type(inst) is not OrderedDict:
        raise UnsafePickleError(
            f"refused BUILD at byte offset {m.op_pos} on {_describe(inst)}; "
            "only OrderedDict state is accepted"
        )
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if part is None:
            continue
        if not isinstance(part, dict):
            raise UnsafePickleError(
                f"refused BUILD at byte offset {m.op_pos}: state of type {type(part).__name__}"
            )
        for key in part:
            if not isinstance(key, str) or key.startswith("__"):
                raise UnsafePickleError(
                    f"refused BUILD at byte offset {m.op_pos}: state key {key!r}"
                )
    log.debug("dropping OrderedDict state with keys %s", [list(p or ()) for p in parts])


def _op_global(m: _Machine) -> None:
    module = _decode_str(m, m.line())
    name = _decode_str(m, m.line())
    m.push(m.global_(module, name))


def _op_stack_global(m: _Machine) -> None:
    name = m.pop()
    module = m.pop()
    if not isinstance(module, str) or not isinstance(name, str):
        raise m.fail("STACK_GLOBAL needs two strings")
    m.push(m.global_(module, name))


def _fill(m: _Machine, container: type[Any], items: list[Any]) -> None:
    """APPEND(S), SETITEM(S), ADDITEMS: add ``items`` to the container below them."""
    target: Any = m.top()
    if not isinstance(target, container):
        raise m.fail(f"adds items to a {type(target).__name__}, expected {container.__name__}")
    if container is list:
        m.new(None, lim.SIZE_SLOT * len(items), items=len(items), objects=0)
        target.extend(items)
        return
    keys = items[::2] if container is dict else items
    if container is dict and len(items) % 2:
        raise m.fail("odd number of items for a dict")
    m.new(None, lim.SIZE_ENTRY * len(keys), items=len(keys), objects=0)
    m.check_keys(keys)
    target.update(zip(keys, items[1::2], strict=True) if container is dict else items)


def _op_setitem(m: _Machine) -> None:
    value = m.pop()
    _fill(m, dict, [m.pop(), value])


def _op_dict(m: _Machine) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise m.fail("DICT with an odd number of items")
    keys = items[::2]
    m.check_keys(keys)
    d = dict(zip(keys, items[1::2], strict=True))
    m.push(m.new(d, lim.SIZE_DICT + lim.SIZE_ENTRY * len(keys), len(keys)))


def _op_frozenset(m: _Machine) -> None:
    items = m.pop_mark()
    m.check_keys(items)
    m.push(m.new(frozenset(items), lim.SIZE_SET + lim.SIZE_ENTRY * len(items), len(items)))


def _op_tuple_n(n: int) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        if len(m.stack) < n:
            raise m.fail("stack underflow")
        items = m.make_tuple(m.stack[len(m.stack) - n :])
        del m.stack[len(m.stack) - n :]
        m.push(items)

    return op


def _list(m: _Machine, items: list[Any]) -> list[Any]:
    return m.new(items, lim.SIZE_LIST + lim.SIZE_SLOT * len(items), len(items))


def _op_pop(m: _Machine) -> None:
    if m.stack:
        m.stack.pop()
    else:
        m.pop_mark()  # CPython: POP on an empty frame discards the mark


def _bytes_op(len_bytes: int, kind: str) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        raw = m.take(m.uint(len_bytes))
        if kind == "str":
            # also SHORT_BINSTRING: a Python 2 str, decoded as UTF-8 like torch.load does
            m.push(m.new(_decode_str(m, raw), lim.SIZE_STR + len(raw)))
        elif kind == "bytes":
            m.push(m.new(raw, lim.SIZE_STR + len(raw)))
        else:
            m.push(m.new(bytearray(raw), lim.SIZE_STR + len(raw)))

    return op


def _op_pop_mark(m: _Machine) -> None:
    m.pop_mark()


def _op_binstring(m: _Machine) -> None:
    raw = m.take(int.from_bytes(m.take(4), "little", signed=True))
    m.push(m.new(_decode_str(m, raw), lim.SIZE_STR + len(raw)))


_DISPATCH: dict[int, Callable[[_Machine], None]] = {
    ord("("): _op_mark,
    ord("0"): _op_pop,
    ord("1"): _op_pop_mark,
    ord("2"): lambda m: m.push(m.top()),
    ord("F"): lambda m: m.push(m.new(float(m.line()), lim.SIZE_NUMBER)),
    ord("G"): lambda m: m.push(m.new(struct.unpack(">d", m.take(8))[0], lim.SIZE_NUMBER)),
    ord("I"): _op_int,
    ord("J"): _op_binint,
    ord("K"): lambda m: m.push(m.uint(1)),
    ord("M"): lambda m: m.push(m.new(m.uint(2), lim.SIZE_NUMBER)),
    ord("L"): _op_long,
    0x8A: _op_long_n(1),
    0x8B: _op_long_n(4),
    ord("N"): lambda m: m.push(None),
    0x88: lambda m: m.push(True),
    0x89: lambda m: m.push(False),
    ord("S"): lambda m: m.push(m.new(_text_string(m, m.line()), lim.SIZE_STR + m.pos - m.op_pos)),
    ord("T"): _op_binstring,
    ord("U"): _bytes_op(1, "str"),
    ord("V"): lambda m: m.push(
        m.new(codecs.raw_unicode_escape_decode(m.line())[0], lim.SIZE_STR + m.pos - m.op_pos)
    ),
    ord("X"): _bytes_op(4, "str"),
    0x8C: _bytes_op(1, "str"),
    0x8D: _bytes_op(8, "str"),
    ord("B"): _bytes_op(4, "bytes"),
    ord("C"): _bytes_op(1, "bytes"),
    0x8E: _bytes_op(8, "bytes"),
    0x96: _bytes_op(8, "bytearray"),
    ord(")"): lambda m: m.push(()),
    ord("t"): lambda m: m.push(m.make_tuple(m.pop_mark())),
    0x85: _op_tuple_n(1),
    0x86: _op_tuple_n(2),
    0x87: _op_tuple_n(3),
    ord("]"): lambda m: m.push(m.new([], lim.SIZE_LIST)),
    ord("l"): lambda m: m.push(_list(m, m.pop_mark())),
    ord("a"): lambda m: _fill(m, list, [m.pop()]),
    ord("e"): lambda m: _fill(m, list, m.pop_mark()),
    ord("}"): lambda m: m.push(m.new({}, lim.SIZE_DICT)),
    ord("d"): _op_dict,
    ord("s"): _op_setitem,
    ord("u"): lambda m: _fill(m, dict, m.pop_mark()),
    0x8F: lambda m: m.push(m.new(set(), lim.SIZE_SET)),
    0x90: lambda m: _fill(m, set, m.pop_mark()),
    0x91: _op_frozenset,
    ord("g"): lambda m: m.push(m.memo_get(int(m.line()))),
    ord("h"): lambda m: m.push(m.memo_get(m.uint(1))),
    ord("j"): lambda m: m.push(m.memo_get(m.uint(4))),
    ord("p"): lambda m: m.memo_put(int(m.line()), m.top()),
    ord("q"): lambda m: m.memo_put(m.uint(1), m.top()),
    ord("r"): lambda m: m.memo_put(m.uint(4), m.top()),
    0x94: lambda m: m.memo_put(len(m.memo), m.top()),
    ord("c"): _op_global,
    0x93: _op_stack_global,
    ord("R"): _op_reduce,
    0x81: lambda m: _op_newobj(m, {}),
    0x92: _op_newobj_ex,
    ord("b"): _op_build,
    ord("P"): lambda m: _op_persid(m, _decode_str(m, m.line())),
    ord("Q"): lambda m: _op_persid(m, m.pop()),
    0x80: _op_proto,
    0x95: _op_frame,
}
