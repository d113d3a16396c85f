"""Bounds on what one pickle stream may make ``pickle_vm`` build, and the hash-safe key rule.

Every length in a stream is checked against the bytes that are there, but a one-byte opcode can
still build a 216-byte set or put a 64-byte entry in a dict, and a dict of keys whose hashes
collide takes quadratic time to fill. So the interpreter counts what it builds (objects, container
entries, estimated bytes) against ``PickleLimits`` and only hashes keys whose hashes a stream
cannot choose.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# hash(n) == n for |n| < the modulus (2**61 - 1 on 64-bit CPython): distinct such ints never
# collide, while k * modulus all hash to 0. str and bytes hashes are salted per process.
HASH_MODULUS = sys.hash_info.modulus
HASH_SAFE_KEYS = f"str, bytes, int with |n| < {HASH_MODULUS}, bool, None"

# estimated CPython sizes (64-bit) charged against max_alloc_bytes
SIZE_STR = 56  # + the encoded length
SIZE_NUMBER = 32  # a float, or an int outside CPython's small-int cache
SIZE_LIST = 56
SIZE_DICT = 64
SIZE_SET = 216  # an empty set already holds a table of 8 entries
SIZE_TUPLE = 40  # + 8 per item
SIZE_SLOT = 8  # a list or tuple item
SIZE_ENTRY = 64  # a dict, set or memo entry, with the table's spare room
SIZE_CALL = 128  # what an allow-listed callable returns (a tensor record, an OrderedDict)


@dataclass(frozen=True)
class PickleLimits:
    """Bounds that keep a hostile stream from exhausting memory before we notice."""

    max_stack: int = 10_000_000  # objects on the stack plus under all marks
    max_marks: int = 100_000  # nesting depth of MARKs
    max_memo: int = 10_000_000
    max_line: int = 1 << 16  # text opcodes (protocol 0) read a line
    max_long_bytes: int = 1 << 12  # LONG4: a 32 KiB-bit integer is already absurd in a state dict
    # hash() of nested tuples recurses in C without a depth check: CPython segfaults on a
    # million-deep tuple used as a dict key, so nesting is bounded here instead
    max_tuple_depth: int = 1000
    # A torch.save state dict takes ~30 opcodes and builds ~9 objects per tensor, a pickled
    # vocabulary ~4 opcodes and 2 objects per token: these leave room for ~50k tensors or ~250k
    # tokens, and stop a bomb in a few seconds (the interpreter runs ~1M opcodes a second).
    max_opcodes: int = 2_500_000
    max_objects: int = 500_000  # strings, numbers, containers, call results
    max_items: int = 2_000_000  # entries put in lists, tuples, dicts, sets and the memo
    max_alloc_bytes: int = 256 << 20  # estimated bytes of all of those


def exceeded(limits: PickleLimits, objects: int, items: int, nbytes: int) -> str:
    """Which limit these counts of what a stream built pass, for the error message."""
    if objects > limits.max_objects:
        return f"built more than {limits.max_objects} objects (PickleLimits.max_objects)"
    if items > limits.max_items:
        return (
            f"put more than {limits.max_items} entries in containers and the memo "
            "(PickleLimits.max_items)"
        )
    return (
        f"built more than {limits.max_alloc_bytes} bytes of objects (PickleLimits.max_alloc_bytes)"
    )


def refuse_keys(keys: list[object]) -> str | None:
    """Why one of these dict keys or set items is refused: unhashable, or a hash a stream could
    make collide with the others' (a float, a tuple, a large int); None when all are safe."""
    for key in keys:
        t = type(key)
        if t is str or t is bytes or t is bool or key is None:
            continue
        if t is int and -HASH_MODULUS < key < HASH_MODULUS:  # type: ignore[operator]
            continue
        why = "unhashable" if t.__hash__ is None else "its hash can be chosen to collide"
        return (
            f"refused dict key or set item of type {t.__name__} ({why}); allowed: {HASH_SAFE_KEYS}"
        )
    return None
