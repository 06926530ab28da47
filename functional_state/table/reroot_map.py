"""`RerootMap`: a persistent map whose newest version is a plain dict and whose older versions are diffs.

Every version of a map is a value: `set` and `delete` return a new version and leave the one they were
called on reading exactly as before. The versions derived from one another form a *family* that shares one
mutable dict, owned by one version, the *root*; every other version holds one diff (a key and the value it
had there, or that it was absent) and a link one step toward the root. A write to the root mutates the dict
in place and makes the new version the root: the old one keeps the key's previous value as its diff. Reading
any other version first *reroots* the family at it (Baker's trick): the diffs on its path to the root are
applied to the dict and inverted, so that the path points the other way and every version still reads the
same. One key of a version a few diffs from the root (`WALK`) is read along its path instead, without moving
the root. Reads and writes of the newest version therefore cost a dict operation, and the garbage collector sees
one dict and one small object per live version, not the nodes of a tree.

A version farther from the root than half the map's size is not rerooted but copied: it gets a dict of its
own, built from a copy of the root's with its diffs applied, and becomes a root itself (the family is then a
tree with two roots, each owning a dict). The copy costs at most a few times the reroot it replaces, and it
ends the back-and-forth: a snapshot read while its family keeps being written (a checkpoint saving an old
table while the shell serves) would otherwise reroot the whole distance on every switch between the two.

Rerooting mutates structure that all the family's versions share, so every write and every reroot holds the
family's lock. A read of the root takes no lock: it reads the family's sequence number (odd while the dict
changes), reads the dict, and keeps the value only if the sequence number is unchanged and its version still
owns the dict; otherwise it reads again under the lock. Reading an old version costs the diffs between it and
the root, and the next read of the newest version pays them back: code that alternates between two distant
versions of one family should keep a copy (`RerootMap(old.items())`) instead.

A version is freed when nothing references it; the links point toward the root, so an old version keeps the
newer ones it needs alive but not the reverse. (An unreachable version that is the root at the time, after a
read of an old version, keeps its contents in the dict until the family is rerooted away from it.) Pickling or copying a version takes only its own contents: a
fresh family, none of the history.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, Final

__all__ = ["RerootMap"]

# The diff value of a key a version does not hold.
_ABSENT: Final = object()
# A version more than this many diffs plus half the map's size from its root is copied, not rerooted.
COPY_AFTER: Final = 16
# A key of a version at most this many diffs from its root is read along the path, without a reroot.
WALK: Final = 8


class _Family:
    """What a family of versions shares: its lock and the sequence number a lock-free read checks."""

    __slots__ = ("lock", "seq")

    def __init__(self) -> None:
        self.lock: Any = threading.Lock()
        self.seq: int = 0  # odd while the shared dict is being changed


class RerootMap:
    """A persistent map (``set`` and ``delete`` return new versions) with dict-speed access to its newest version.

    Keys are hashable, values anything. ``m.get(k)``, ``m[k]``, ``k in m``, ``len(m)``, iteration, `keys`,
    `values` and `items` read the version ``m`` whatever was derived from it since.

    Args:
      items: the first version's contents, a mapping or ``(key, value)`` pairs; empty by default. Each call
        starts a new family.

    Example (not a doctest: the module runs compiled; tests/test_reroot_map.py runs it)::

        a = RerootMap({"x": 1})
        b = a.set("y", 2).delete("x")
        sorted(a.items()), sorted(b.items())  # ([('x', 1)], [('y', 2)])
    """

    __slots__ = ("_data", "_family", "_key", "_len", "_next", "_value")
    _family: _Family
    _data: dict[Any, Any] | None  # the family's dict while this version is a root, else None
    _next: RerootMap | None  # one step toward the root (None for a root)
    _key: Any  # this version's diff: the key, and its value here (`_ABSENT`: not held)
    _value: Any
    _len: int

    def __init__(self, items: Any = None, *, _family: _Family | None = None) -> None:
        # ``_family`` (the module's own writes, `_new_version`): a new root of that family owning ``items``,
        # a dict, as is. A plain call builds the first version of a new family from a copy of ``items``.
        if _family is None:
            data: dict[Any, Any] = {} if items is None else dict(items)
            _family = _Family()
        else:
            data = items
        self._family = _family
        self._data = data
        self._next = None
        self._key = None
        self._value = None
        self._len = len(data)

    # --- reads -------------------------------------------------------------------------------------------
    def get(self, key: Any, default: Any = None) -> Any:
        """The value of ``key`` in this version, or ``default``."""
        family = self._family
        seq = family.seq
        data = self._data
        if data is not None:
            value = data.get(key, default)
            # Kept only if no write or reroot ran meanwhile (the dict was this version's throughout).
            if family.seq == seq and not seq & 1 and self._data is data:
                return value
        lock = family.lock
        lock.acquire()
        try:
            # A version a few diffs from its root is read along its path, leaving the root where it is: a
            # caller that compares a new table with the one it came from must not make the old one the
            # root (it would then hold the old values alive, and the next write would reroot back).
            node = self
            for _ in range(WALK):
                data = node._data
                if data is not None:
                    return data.get(key, default)
                diff_key = node._key
                if diff_key is key or diff_key == key:
                    value = node._value
                    return default if value is _ABSENT else value
                nxt = node._next
                assert nxt is not None  # (a version without a dict has a link toward its root)
                node = nxt
            return self._rooted().get(key, default)
        finally:
            lock.release()

    def __getitem__(self, key: Any) -> Any:
        value = self.get(key, _ABSENT)
        if value is _ABSENT:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return self.get(key, _ABSENT) is not _ABSENT

    def __len__(self) -> int:
        return self._len

    def items(self) -> list[tuple[Any, Any]]:
        """This version's ``(key, value)`` pairs (a list: the shared dict changes under a lazy view)."""
        with self._family.lock:
            return list(self._rooted().items())

    def keys(self) -> list[Any]:
        """This version's keys (a list, as `items`)."""
        with self._family.lock:
            return list(self._rooted())

    def values(self) -> list[Any]:
        """This version's values (a list, as `items`)."""
        with self._family.lock:
            return list(self._rooted().values())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())

    # --- writes ------------------------------------------------------------------------------------------
    def set(self, key: Any, value: Any) -> RerootMap:
        """A new version with ``key`` mapped to ``value``; this one unchanged.

        Raises:
          TypeError: ``key`` is not hashable (no version changed).
        """
        family = self._family
        lock = family.lock
        lock.acquire()  # (acquire/release: cheaper than `with` in the compiled build)
        try:
            data = self._rooted()
            old = data.get(key, _ABSENT)  # (an unhashable key raises here, before anything changed)
            family.seq += 1
            data[key] = value
            new = self._derived(data, key, old)
            family.seq += 1
        finally:
            lock.release()
        return new

    def delete(self, key: Any) -> RerootMap:
        """A new version without ``key``; this one unchanged.

        Raises:
          KeyError: this version does not hold ``key`` (no version changed).
        """
        family = self._family
        lock = family.lock
        lock.acquire()
        try:
            data = self._rooted()
            old = data.get(key, _ABSENT)
            if old is _ABSENT:
                raise KeyError(key)
            family.seq += 1
            del data[key]
            new = self._derived(data, key, old)
            family.seq += 1
        finally:
            lock.release()
        return new

    def updated(self, pairs: Iterable[tuple[Any, Any]]) -> RerootMap:
        """A new version with each ``(key, value)`` of ``pairs`` set in turn; this one unchanged."""
        new = self
        for key, value in pairs:
            new = new.set(key, value)
        return new

    def __reduce__(self) -> tuple[type[RerootMap], tuple[dict[Any, Any]]]:
        # Only this version's contents: a copy or an unpickled map starts a family of its own.
        return RerootMap, (dict(self.items()),)

    def __repr__(self) -> str:
        return f"RerootMap({dict(self.items())!r})"

    # --- the family's structure (callers hold the lock) --------------------------------------------------
    def _derived(self, data: dict[Any, Any], key: Any, old: Any) -> RerootMap:
        """The new root owning ``data`` (already changed at ``key``); this version becomes its diff."""
        new = _new_version(self._family, data)
        self._data = None
        self._next = new
        self._key = key
        self._value = old
        return new

    def _rooted(self) -> dict[Any, Any]:
        """The dict holding this version's contents: the family rerooted here if it was not, or, if this
        version is far from the root, a copy of its own (see the module's docstring)."""
        data = self._data
        if data is not None:
            return data
        path: list[RerootMap] = []
        node: RerootMap | None = self
        while node is not None and node._data is None:
            path.append(node)
            node = node._next
        assert node is not None  # (every chain of diffs ends at the family's root)
        data = node._data
        assert data is not None
        if len(path) > len(data) // 2 + COPY_AFTER:
            return self._detached(path, data)
        family = self._family
        family.seq += 1
        root = node
        # From the root back to this version: apply each diff to the dict and store its inverse on the
        # version that was the root a step before, which now points the other way.
        for k in range(len(path) - 1, -1, -1):
            step = path[k]
            key, old = step._key, step._value
            current = data.get(key, _ABSENT)
            if old is _ABSENT:
                del data[key]
            else:
                data[key] = old
            root._data = None
            root._next = step
            root._key = key
            root._value = current
            step._data = data
            step._next = None
            step._key = None
            step._value = None
            root = step
        family.seq += 1
        return data

    def _detached(self, path: list[RerootMap], root_data: dict[Any, Any]) -> dict[Any, Any]:
        """This version made a root of its own: a copy of ``root_data`` with the diffs of ``path`` (this
        version to the root) applied. Nothing shared changes: the versions on the path still lead to the
        old root, those that led here still do."""
        data = dict(root_data)
        for k in range(len(path) - 1, -1, -1):
            step = path[k]
            if step._value is _ABSENT:
                del data[step._key]
            else:
                data[step._key] = step._value
        self._data = data
        self._next = None  # (the newer versions it read through are freed if nothing else holds them)
        self._key = None
        self._value = None
        return data


def _new_version(family: _Family, data: dict[Any, Any]) -> RerootMap:
    """A root version of ``family`` owning ``data`` (no new family, no copy)."""
    return RerootMap(data, _family=family)
