"""Format-blind mutations of byte strings, the base layer of every fuzz target.

AFL's classic havoc set: bit flips, random bytes, insertions and deletions, block duplication,
splicing with another seed, truncation, and "interesting" integers (boundaries where a length or
count check is most likely to be off by one or to overflow) written at random offsets.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence

# values that sit on the edges of signed/unsigned widths, or that make size arithmetic overflow
INTERESTING: tuple[int, ...] = (
    0, 1, 2, 7, 8, 16, 31, 32, 63, 64, 100, 127, 128, 255, 256, 1000, 1024, 4096, 32767, 32768,
    65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
    -1, -2, -128, -32768, -(2**31), -(2**63),
)  # fmt: skip

_WIDTHS = ((1, "B"), (2, "H"), (4, "I"), (8, "Q"))


def interesting(rng: random.Random, base: int | None = None) -> int:
    """An interesting integer, or (given the field's real value) a small step away from it."""
    if base is not None and rng.random() < 0.3:
        return base + rng.choice((-1, 1, -8, 8, 2**32, -(2**32))) * rng.randint(1, 3)
    if rng.random() < 0.1:
        return rng.getrandbits(rng.choice((8, 16, 32, 64)))
    return rng.choice(INTERESTING)


def pack_uint(value: int, width: int) -> bytes:
    """``value`` wrapped into an unsigned little-endian field of ``width`` bytes."""
    fmt = dict(_WIDTHS)[width]
    return struct.pack("<" + fmt, value % (1 << (8 * width)))


def _flip_bit(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)


def _random_byte(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    data[rng.randrange(len(data))] = rng.randrange(256)


def _insert(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    i = rng.randrange(len(data) + 1)
    if rng.random() < 0.5:
        data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:
        data[i:i] = bytes([rng.randrange(256)]) * rng.choice((1, 16, 256, 4096))


def _delete(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    i = rng.randrange(len(data))
    del data[i : i + rng.choice((1, 1, 2, 4, 8, 64, 512))]


def _duplicate(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    i = rng.randrange(len(data))
    n = rng.randint(1, min(256, len(data) - i))
    j = rng.randrange(len(data) + 1)
    data[j:j] = data[i : i + n]


def _interesting_int(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    width, _ = rng.choice(_WIDTHS)
    if len(data) < width:
        return
    i = rng.randrange(len(data) - width + 1)
    data[i : i + width] = pack_uint(interesting(rng), width)


def _splice(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    other = rng.choice(seeds)
    if not other:
        return
    i = rng.randrange(len(data))
    j = rng.randrange(len(other))
    data[i:] = other[j : j + rng.randint(1, 4096)]


def _truncate(rng: random.Random, data: bytearray, seeds: Sequence[bytes]) -> None:
    del data[rng.randrange(len(data)) :]


Mutator = Callable[[random.Random, bytearray, Sequence[bytes]], None]
HAVOC: tuple[Mutator, ...] = (
    _flip_bit, _flip_bit, _random_byte, _random_byte, _insert, _delete, _duplicate,
    _interesting_int, _interesting_int, _interesting_int, _splice, _truncate,
)  # fmt: skip


def havoc(rng: random.Random, data: bytes, seeds: Sequence[bytes] = (), rounds: int = 0) -> bytes:
    """``data`` after 1-8 (or ``rounds``) random format-blind mutations."""
    out = bytearray(data)
    for _ in range(rounds or rng.choice((1, 1, 2, 2, 3, 4, 8))):
        if not out:
            out += bytes([rng.randrange(256)])
            continue
        rng.choice(HAVOC)(rng, out, seeds or (data,))
    return bytes(out)


def set_field(rng: random.Random, data: bytes, offset: int, width: int) -> bytes:
    """``data`` with the ``width``-byte little-endian field at ``offset`` set to an odd value or
    one near its current value."""
    value = int.from_bytes(data[offset : offset + width], "little")
    out = bytearray(data)
    out[offset : offset + width] = pack_uint(interesting(rng, value), width)
    return bytes(out)
