"""Pins: sessions the byte budget must not release while a request on them is in flight."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["Pins"]


class Pins:
    """Nesting pin counts per session id, changed under the shell's lock; ``pinned`` is one immutable value
    (a frozenset) that a write reads outside the lock and compares by identity when it installs."""

    def __init__(self, lock: AbstractContextManager[Any]):
        self._lock = lock
        self._counts: Counter[str] = Counter()
        self.pinned: frozenset[str] = frozenset()

    @contextlib.contextmanager
    def pin(self, sid: str) -> Iterator[None]:
        """Pin ``sid`` while the block runs."""
        with self._lock:
            self._counts[sid] += 1
            self.pinned = frozenset(self._counts)
        try:
            yield
        finally:
            with self._lock:
                self._counts[sid] -= 1
                if not self._counts[sid]:
                    del self._counts[sid]
                self.pinned = frozenset(self._counts)
