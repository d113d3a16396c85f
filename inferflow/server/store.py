"""The in-memory store of the Responses API: responses by id, for ``previous_response_id`` and
``GET /v1/responses/{id}``, bounded by a number of responses, a total size and an age; the
oldest go first. (No web imports: the CLI reads the defaults.)"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoreLimits:
    """How many responses the server keeps for ``previous_response_id`` and ``GET``, their
    total size (characters of their conversations and objects) and how long (seconds)."""

    items: int = 256
    chars: int = 32 << 20
    seconds: float = 3600.0


@dataclass
class Stored:
    conversation: tuple[dict[str, Any], ...]  # the messages it continues (no instructions)
    obj: dict[str, Any]  # the response object
    size: int
    at: float  # time.monotonic() when stored


class ResponseStore:
    """Responses by id, oldest first out (by count, total size and age). Thread-safe (handlers
    run on the event loop; tests may read it from another thread)."""

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def put(self, rid: str, conversation: list[dict[str, Any]], obj: dict[str, Any]) -> None:
        size = sum(len(m["content"]) for m in conversation) + len(json.dumps(obj))
        with self.lock:
            self._expire()
            if size > self.limits.chars or self.limits.items < 1:
                return  # (larger than the whole store: a later previous_response_id gets 400)
            self.items[rid] = Stored(tuple(conversation), obj, size, time.monotonic())
            self.size += size
            while len(self.items) > self.limits.items or self.size > self.limits.chars:
                self._drop(next(iter(self.items)))

    def get(self, rid: str) -> Stored | None:
        with self.lock:
            self._expire()
            return self.items.get(rid)

    def delete(self, rid: str) -> bool:
        with self.lock:
            self._expire()
            if rid not in self.items:
                return False
            self._drop(rid)
            return True

    def _expire(self) -> None:
        old = time.monotonic() - self.limits.seconds
        while self.items and next(iter(self.items.values())).at < old:
            self._drop(next(iter(self.items)))

    def _drop(self, rid: str) -> None:
        self.size -= self.items.pop(rid).size

    def missing(self, rid: str) -> str:
        lim = self.limits
        return (
            f"no stored response {rid!r}: responses are kept when sent with store true, at most "
            f"{lim.items} of them ({lim.chars} characters in all) for {lim.seconds:g} s"
        )
