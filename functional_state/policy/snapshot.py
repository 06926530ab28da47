"""What a release plan reads of the table, once: the sessions in recency order (lazily) and the attr holders."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ..memory import accounting
from ..memory.extents import Extent
from ..memory.pools import Pool
from ..table.ledger import Acct
from ..table.manager_state import ManagerState, entries_lru, session_map
from ..table.usage import pool_bytes

__all__ = ["AttrHolders", "Recency", "Snapshot"]

_NO_HOLDERS: Counter[Extent] = Counter()  # a table whose attrs hold no buffer


class Recency:
    """The table's sessions, least recently used first, read from the table's recency log as a pass needs
    them and kept in two flat lists (100k new tuples would trigger full garbage collections), so a later
    pass reads the same order again without a second walk of the log."""

    def __init__(self, state: ManagerState):
        self._entries = entries_lru(state)
        self.sids: list[str] = []
        self.objs: list[Any] = []

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        sids, objs, i = self.sids, self.objs, 0
        while True:
            if i == len(sids):
                entry = next(self._entries, None)
                if entry is None:
                    return
                sids.append(entry[0])
                objs.append(entry[2])
            yield sids[i], objs[i]
            i += 1


class AttrHolders:
    """How many attr values hold each extent, from the ledger's attr index (recorded on write: no walk of the
    sessions): the closed values' counts and the containers' extents read now. Like `stats`, it does not
    look for arrays deleted behind the table's back (``stats(exact=True)`` does): it prices what the table
    holds by its own operations, the figure `enforce_budget` measures with."""

    def __init__(self, closed: Any, open_extents: Counter[Extent], loose: Any = (), pools: Any = None):
        self.closed, self.open = closed, open_extents
        self.loose = loose  # pools where ``closed`` holds a `Loose` extent (the attr index's kept mark)
        self.pools = pools  # pools ``closed`` holds extents in (the index's per-pool totals); None: unknown

    def __getitem__(self, e: Extent) -> int:
        return self.closed.get(e, 0) + self.open.get(e, 0)


class Snapshot:
    """What the table holds, read once per plan: which extents attrs hold, bytes per pool (attrs included),
    and who holds an object the ledger says is shared.

    Parks and evictions ask only whether attrs hold an extent, which the ledger's attr index answers (it
    records every attr value on write; only containers are read now): no walk of the sessions. A drop lets
    go of one session's attrs, so the drop pass asks `exact_attrs` (one walk of the sessions' attrs)."""

    def __init__(self, acct: Acct, state: ManagerState, lru: Recency):
        self.refs = acct.refs
        self.lru = lru
        self._state = state
        index = self._attrs = acct.attrs
        self._open: list[Extent] = []  # what the attr containers hold now (closed values: the index's counts)
        self.attr_holders: Any = _NO_HOLDERS
        if len(index.memo):  # some attr holds a buffer
            out: accounting.Extents = []
            for value in index.open_values():
                accounting.collect_extents(value, out, {}, accounting.WalkReport())
            self.attr_holders = AttrHolders(index.refs, Counter(out), index.loose, index.totals)
            self._open = out
        self._slots: dict[int, list[tuple[str, str]]] | None = None

    def attr_nbytes(self, pool: Pool) -> int:
        """Bytes the attrs hold in ``pool``, each allocation once, whether or not objects hold it too (what
        no park or eviction frees): the index's kept total of closed values plus what containers hold beyond
        them. O(container extents), not O(attr values)."""
        name = str(pool)
        refs = self._attrs.refs
        extra = [e for e in self._open if e.pool == name and e not in refs]
        return self._attrs.totals.get(name, 0) + (accounting.union_by_device(extra).get(name, 0) if extra else 0)

    @functools.cached_property
    def held(self) -> dict[Pool, int]:
        """Bytes per pool, attrs included: what stats() reports, the answer enforce_budget measures with."""
        return pool_bytes(self._state)

    def exact_attrs(self) -> tuple[dict[str, frozenset[Extent]], Counter[Extent]]:
        """Each session's attr extents, and how many sessions' attrs hold each extent: a walk of the attrs."""
        sets: dict[str, frozenset[Extent]] = {}
        holders: Counter[Extent] = Counter()
        if self.attr_holders is _NO_HOLDERS:
            return sets, holders
        for sid, session in session_map(self._state).items():
            if not session._attrs:
                continue
            out: accounting.Extents = []
            for value in session._attrs.values():
                accounting.collect_extents(value, out, {}, accounting.WalkReport())
            if out:  # (one container per session would trigger full garbage collections at 100k sessions)
                sets[sid] = extents = frozenset(out)
                for e in extents:  # (not Counter.update: its Mapping check costs more than the loop)
                    holders[e] += 1
        return sets, holders

    def holders(self, obj: Any, sid: str, name: str, extents: frozenset[Extent]) -> list[tuple[str, str]]:
        """Every (session, name) holding this very object (forks, or one cache put under two names), as
        `park(with_sharers=True)` parks them, least recent first.

        The ledger answers the common case: when no extent of the object has a second holder, ``(sid,
        name)`` is the only slot. Otherwise one pass over the table names the slots (built once per plan).
        """
        refs = self.refs
        if all(refs.get(e, 0) <= 1 for e in extents):
            return [(sid, name)]
        if self._slots is None:
            self._slots = {}
            for s, session in self.lru:
                for n, o in sorted(session._objects.items()):
                    self._slots.setdefault(id(o), []).append((s, n))
        return self._slots[id(obj)]
