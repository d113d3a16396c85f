"""One registry type for every name a spec (or a CLI flag) may use.

Duplicate registration is an error; an unknown name lists the known ones, and the spec's JSON
Schema takes its allowed values from ``Registry.names()`` so a new block needs no schema edit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from inferflow.errors import InferflowError

T = TypeVar("T")


class RegistryError(InferflowError):
    """Unknown or duplicate registry name."""


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator: ``@NORMS.register("rms")`` on a class or factory function."""

        def deco(obj: T) -> T:
            for key in (name, *aliases):
                self.add(key, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise RegistryError(f"duplicate {self.kind} {name!r}: already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())
