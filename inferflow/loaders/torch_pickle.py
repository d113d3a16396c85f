"""What a ``torch.save`` pickle may contain: the allow-list of globals and our own rebuilds.

``torch.save`` pickles each tensor as ``torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, requires_grad, hooks[, metadata])`` (``_rebuild_tensor_v3(..., dtype)`` for dtypes with no
legacy storage class, e.g. float8 and uint16), wraps parameters in ``_rebuild_parameter``, and
refers to storages by persistent id. Every allow-listed global here resolves to an object of
ours: the rebuild functions only *record* where a tensor lives (``TensorRecord``), so parsing
reads no tensor data and calls no torch function; ``materialize`` builds the tensor later with
``torch.as_strided`` over the storage bytes. Device locations ('cuda:0', 'mps', 'meta') are
recorded and ignored: everything loads on CPU.
"""

from __future__ import annotations

import logging
import math
import reprlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from inferflow.errors import CheckpointError, UnsafePickleError
from inferflow.loaders.pickle_limits import refuse_keys
from inferflow.loaders.pickle_vm import SafeCallable

log = logging.getLogger(__name__)
_REPR = reprlib.Repr()  # bounded reprs: a hostile value may be a list of millions of items
_REPR.maxstring = _REPR.maxother = 60
short_repr = _REPR.repr

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch/serialization.py: first pickle of a legacy file
LEGACY_PROTOCOL_VERSION = 1001

# legacy typed-storage class -> element dtype (torch.storage._dtype_to_storage_type_map, inverted;
# the quantized storages are left out because _rebuild_qtensor is not allowed either)
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}

# ``torch.<name>`` dtype globals (_rebuild_tensor_v3's dtype argument); looked up in this fixed
# list, never by getattr on a name from the file (torch's module __getattr__ imports submodules)
DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex32", "complex64", "complex128", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "double", "float", "half", "long", "int", "short", "cfloat", "cdouble", "chalf",
)  # fmt: skip


@dataclass(frozen=True)
class StorageType:
    """A storage class named in a persistent id: a tag for its element dtype, never called."""

    qualname: str
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorType:
    """``torch.Tensor`` / ``torch.nn.Parameter`` as passed to ``_rebuild_from_type_v2``."""

    qualname: str


@dataclass(frozen=True)
class StorageRef:
    """Bytes ``[byte_offset, byte_offset + nbytes)`` of the stored storage ``key``."""

    key: str
    dtype: torch.dtype
    location: str
    nbytes: int
    byte_offset: int = 0  # legacy storage views start inside their root storage


@dataclass(frozen=True)
class TensorRecord:
    """Where a tensor lives in its storage; nothing is read until ``materialize``."""

    storage: StorageRef
    storage_offset: int  # in elements of ``dtype``
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    conj: bool = False
    neg: bool = False

    def check(self, name: str) -> None:
        """Refuse a tensor that would reach outside its storage."""
        if self.storage_offset < 0 or min(self.stride, default=0) < 0:
            raise CheckpointError(
                f"tensor {name!r}: negative storage offset or stride "
                f"({self.storage_offset}, {list(self.stride)})"
            )
        if max(self.storage_offset, *self.shape, *self.stride, math.prod(self.shape)) >= 1 << 62:
            # torch sizes are int64: refuse here rather than fail inside as_strided
            raise CheckpointError(f"tensor {name!r}: shape {list(self.shape)} is too large")
        if 0 in self.shape:
            return
        last = self.storage_offset + sum(
            (n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)
        )
        need = (last + 1) * self.dtype.itemsize
        if need > self.storage.nbytes:
            raise CheckpointError(
                f"tensor {name!r} of shape {list(self.shape)} needs {need} bytes of storage "
                f"{self.storage.key!r}, which holds {self.storage.nbytes}"
            )


def _swap_unit(dtype: torch.dtype) -> int:
    # complex numbers are two floats, each swapped on its own
    return dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize


def materialize(rec: TensorRecord, raw: torch.Tensor, byteswap: bool = False) -> torch.Tensor:
    """The tensor ``rec`` describes, over ``raw`` (uint8, the bytes of ``rec.storage``)."""
    itemsize = rec.dtype.itemsize
    raw = raw[: raw.numel() // itemsize * itemsize]
    unit = _swap_unit(rec.dtype)
    if byteswap and unit > 1:
        raw = raw.view(-1, unit).flip(1).reshape(-1)  # (elements, bytes) reversed: a copy
    elif raw.numel() and raw.data_ptr() % itemsize:
        raw = raw.clone()  # legacy files store data unaligned; typed views need alignment
    typed = raw.view(rec.dtype)
    t = torch.as_strided(typed, rec.shape, rec.stride, rec.storage_offset)
    if rec.conj:
        t = t.conj()
    if rec.neg:
        t = torch._neg_view(t)
    return t


# ---- allow-listed callables -----------------------------------------------------------------


class _Func(SafeCallable):
    """An allow-listed callable implemented here, with its own argument checks."""

    def __init__(
        self,
        qualname: str,
        call: Callable[[tuple[Any, ...]], Any],
        new: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(qualname)
        self._call = call
        self._new = new

    def call(self, args: tuple[Any, ...]) -> Any:
        return self._call(args)

    def new(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._new is None or args or kwargs:
            return super().new(args, kwargs)
        return self._new()


def _bad(qualname: str, why: str) -> CheckpointError:
    return CheckpointError(f"malformed checkpoint pickle: {qualname}: {why}")


def _nargs(qualname: str, args: tuple[Any, ...], *counts: int) -> None:
    if len(args) not in counts:
        want = " or ".join(map(str, counts))
        raise _bad(qualname, f"called with {len(args)} arguments, expected {want}")


def _collection(qualname: str, make: Callable[[Any], Any]) -> _Func:
    def call(args: tuple[Any, ...]) -> Any:
        _nargs(qualname, args, 0, 1)
        if args and not isinstance(args[0], list | tuple | set | frozenset | dict):
            raise _bad(qualname, f"argument of type {type(args[0]).__name__}")
        arg = args[0] if args else ()
        items = list(arg)
        if make is OrderedDict and not isinstance(arg, dict):  # a list of (key, value)
            if not all(isinstance(p, list | tuple) and len(p) == 2 for p in items):
                raise _bad(qualname, f"items {short_repr(items)} are not (key, value) pairs")
            items = [k for k, _ in items]
        why = refuse_keys(items)  # make() hashes them: no keys a stream could make collide
        if why:
            raise _bad(qualname, why)
        return make(arg)

    return _Func(qualname, call, lambda: make(()))


def _latin1(qualname: str, wrap: Callable[[bytes], Any] = bytes) -> _Func:
    # protocols 0-2 spell bytes as encode(text, 'latin1'); no codec registry is ever consulted
    def call(args: tuple[Any, ...]) -> Any:
        if not args:
            return wrap(b"")
        if len(args) == 1 and isinstance(args[0], bytes | bytearray):
            return wrap(bytes(args[0]))
        if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
            return wrap(args[0].encode("latin-1"))
        kinds = ", ".join(type(a).__name__ for a in args)
        raise UnsafePickleError(f"refused call {qualname}({kinds}): only (str, 'latin1')")

    return _Func(qualname, call)


def _ints(qualname: str, what: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(v) is int and v >= 0 for v in value):
        raise _bad(
            qualname, f"{what} must be a tuple of non-negative ints, got {short_repr(value)}"
        )
    return tuple(value)


def _tensor_record(
    qualname: str, storage: Any, offset: Any, size: Any, stride: Any, dtype: torch.dtype | None,
    metadata: Any,
) -> TensorRecord:  # fmt: skip
    if not isinstance(storage, StorageRef):
        raise _bad(qualname, f"storage argument is a {type(storage).__name__}, not a storage")
    if type(offset) is not int or offset < 0:
        raise _bad(qualname, f"storage offset {short_repr(offset)}")
    shape = _ints(qualname, "size", size)
    strides = _ints(qualname, "stride", stride)
    if len(shape) != len(strides):
        raise _bad(qualname, f"size {list(shape)} and stride {list(strides)} differ in length")
    flags = {} if metadata is None else metadata
    if not isinstance(flags, dict) or not set(flags) <= {"conj", "neg"}:
        raise _bad(qualname, f"tensor metadata {short_repr(metadata)}; known keys: conj, neg")
    return TensorRecord(
        storage, offset, shape, strides, dtype or storage.dtype,
        conj=bool(flags.get("conj")), neg=bool(flags.get("neg")),
    )  # fmt: skip


def _rebuild_tensor(args: tuple[Any, ...]) -> TensorRecord:
    q = "torch._utils._rebuild_tensor"
    _nargs(q, args, 4)
    return _tensor_record(q, args[0], args[1], args[2], args[3], None, None)


def _rebuild_tensor_v2(args: tuple[Any, ...]) -> TensorRecord:
    # (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
    q = "torch._utils._rebuild_tensor_v2"
    _nargs(q, args, 6, 7)
    meta = args[6] if len(args) == 7 else None
    return _tensor_record(q, args[0], args[1], args[2], args[3], None, meta)


def _rebuild_tensor_v3(args: tuple[Any, ...]) -> TensorRecord:
    # (storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype[, metadata]);
    # the storage is untyped (bytes) and the offset counts elements of ``dtype``
    q = "torch._utils._rebuild_tensor_v3"
    _nargs(q, args, 7, 8)
    if not isinstance(args[6], torch.dtype):
        raise _bad(q, f"dtype argument is a {type(args[6]).__name__}")
    meta = args[7] if len(args) == 8 else None
    return _tensor_record(q, args[0], args[1], args[2], args[3], args[6], meta)


def _rebuild_parameter(args: tuple[Any, ...], with_state: bool) -> TensorRecord:
    # (data, requires_grad, backward_hooks[, state]): a Parameter loads as its plain data; its
    # Python attributes (state) are dropped, never set
    q = "torch._utils._rebuild_parameter" + ("_with_state" if with_state else "")
    _nargs(q, args, 4 if with_state else 3)
    if not isinstance(args[0], TensorRecord):
        raise _bad(q, f"data argument is a {type(args[0]).__name__}, not a tensor")
    return args[0]


TENSOR_REBUILDS: dict[str, Callable[[tuple[Any, ...]], TensorRecord]] = {
    "_rebuild_tensor": _rebuild_tensor,
    "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_tensor_v3": _rebuild_tensor_v3,
    "_rebuild_parameter": lambda a: _rebuild_parameter(a, with_state=False),
    "_rebuild_parameter_with_state": lambda a: _rebuild_parameter(a, with_state=True),
}


def _rebuild_from_type_v2(args: tuple[Any, ...]) -> TensorRecord:
    # (func, new_type, args, state): how torch pickles a Tensor or Parameter that carries Python
    # attributes; allowed only when ``func`` is one of our rebuilds and the type a plain tensor
    q = "torch._tensor._rebuild_from_type_v2"
    _nargs(q, args, 4)
    func, new_type, inner, _state = args
    if not isinstance(func, _Func) or func.qualname.rpartition(".")[2] not in TENSOR_REBUILDS:
        raise UnsafePickleError(f"refused {q} of {short_repr(func)}: only tensor rebuilds")
    if not isinstance(new_type, TensorType) or not isinstance(inner, tuple):
        raise UnsafePickleError(f"refused {q} to type {short_repr(new_type)}")
    result = func.call(inner)
    if not isinstance(result, TensorRecord):
        raise _bad(q, "inner rebuild did not produce a tensor")
    return result


def _size(args: tuple[Any, ...]) -> tuple[int, ...]:
    _nargs("torch.Size", args, 0, 1)
    return _ints("torch.Size", "size", args[0] if args else ())


ALLOWED: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): _collection("collections.OrderedDict", OrderedDict),
    ("_codecs", "encode"): _latin1("_codecs.encode"),
    ("torch._tensor", "_rebuild_from_type_v2"): _Func(
        "torch._tensor._rebuild_from_type_v2", _rebuild_from_type_v2
    ),
    ("torch", "Size"): _Func("torch.Size", _size),
    ("torch", "Tensor"): TensorType("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): TensorType("torch.nn.parameter.Parameter"),
    ("torch.nn", "Parameter"): TensorType("torch.nn.Parameter"),
}
for _name, _fn in TENSOR_REBUILDS.items():
    ALLOWED[("torch._utils", _name)] = _Func(f"torch._utils.{_name}", _fn)
for _mod in ("builtins", "__builtin__"):  # __builtin__: how protocols <= 2 spell it
    ALLOWED[(_mod, "set")] = _collection(f"{_mod}.set", set)
    ALLOWED[(_mod, "frozenset")] = _collection(f"{_mod}.frozenset", frozenset)
    ALLOWED[(_mod, "bytes")] = _latin1(f"{_mod}.bytes")
    ALLOWED[(_mod, "bytearray")] = _latin1(f"{_mod}.bytearray", bytearray)
for _cls, _dtype in STORAGE_DTYPES.items():
    # torch.cuda.*Storage: how pre-1.x torch named storages saved from a GPU
    for _mod in ("torch", "torch.cuda"):
        ALLOWED[(_mod, _cls)] = StorageType(f"{_mod}.{_cls}", _dtype)
for _mod in ("torch", "torch.storage"):
    # an untyped storage is a byte buffer; torch 2.x emits it for _rebuild_tensor_v3 tensors
    ALLOWED[(_mod, "UntypedStorage")] = StorageType(f"{_mod}.UntypedStorage", torch.uint8)
for _name in DTYPE_NAMES:
    _value = getattr(torch, _name, None)  # fixed names: some dtypes are newer than torch 2.4
    if isinstance(_value, torch.dtype):
        ALLOWED[("torch", _name)] = _value


def resolve_global(module: str, name: str) -> object | None:
    """The allow-listed object for ``module.name``, or None to refuse it."""
    return ALLOWED.get((module, name))


def describe_allowed() -> str:
    named = sorted(
        f"{m}.{n}"
        for (m, n), v in ALLOWED.items()
        if not isinstance(v, StorageType | torch.dtype) and m != "__builtin__"
    )
    return (
        f"{', '.join(named)}, torch.<Type>Storage ({', '.join(STORAGE_DTYPES)}, UntypedStorage), "
        "torch.<dtype>"
    )


def make_persistent_load(storages: dict[str, StorageRef]) -> Callable[[Any], StorageRef]:
    """Persistent-id handler: records each storage a tensor refers to, reading no data.

    zip format: ("storage", storage_type, key, location, numel); legacy format adds a sixth
    item, view metadata (view_key, offset, numel) or None.
    """

    def persistent_load(pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or not pid:
            raise CheckpointError(f"malformed checkpoint: persistent id {short_repr(pid)}")
        kind = pid[0].decode("ascii") if isinstance(pid[0], bytes) else pid[0]
        if kind != "storage":
            raise UnsafePickleError(
                f"refused persistent id of kind {short_repr(kind)}; only 'storage'"
            )
        if len(pid) not in (5, 6):
            raise CheckpointError(f"malformed storage id with {len(pid)} fields: {short_repr(pid)}")
        stype, key, location, numel = pid[1:5]
        location = location.decode("ascii") if isinstance(location, bytes) else location
        if (
            not isinstance(stype, StorageType)
            or not isinstance(key, str)
            or not isinstance(location, str)
            or type(numel) is not int
            or numel < 0
        ):
            raise CheckpointError(f"malformed storage id {short_repr(pid)}")
        if key not in storages:
            if location != "cpu":
                log.debug("storage %r saved on %r: loading it on CPU", key, location)
            storages[key] = StorageRef(key, stype.dtype, location, numel * stype.dtype.itemsize)
        root = storages[key]  # like torch.load, the first reference fixes a storage's dtype
        view = pid[5] if len(pid) == 6 else None
        if view is None:
            return root
        if not (
            isinstance(view, tuple) and len(view) == 3 and all(type(v) is int for v in view[1:])
        ):
            raise CheckpointError(f"malformed storage view {short_repr(view)}")
        start, count = view[1] * root.dtype.itemsize, view[2] * root.dtype.itemsize
        if start < 0 or count < 0 or start + count > root.nbytes:
            raise CheckpointError(
                f"storage view of {count} bytes at {start} lies outside storage {key!r} "
                f"of {root.nbytes} bytes"
            )
        return StorageRef(key, root.dtype, location, count, root.byte_offset + start)

    return persistent_load
