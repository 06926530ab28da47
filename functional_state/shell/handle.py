"""`SessionHandle`: the object API on one session incarnation, each write one table verb.

Every write method is one line: the same pure verb the table offers (`commit`, `park`, `set_attr` ...),
applied by the manager to the session wherever it is (in the table, or a detached handle's own copy), so a
verb's semantics (its refusals, what it returns) are decided once, by the table. Handles give the object
API the bespoke caches had:

* writes through any handle of a session that is in the table are seen by every handle of it;
* a handle whose session left the table (LRU eviction, drop) keeps working on its own copy, so nothing is
  lost mid-generation, and its writes never resurrect the evicted entry. A session later re-created under
  the same id is a new incarnation that old handles never touch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from .. import table as ms
from ..core.pytree import MISSING
from ..core.session import ForkPolicy, SessionState
from ..core.state_object import RESIDENT, StateObject
from ..errors import InvalidTypeError, ObjectParkedError
from ..table import parked, session_edits
from ..table.manager_state import held_object
from ..table.torch_writes import RECORDS, check_object, writable
from .cells import Cell
from .session_ops import SessionOps

__all__ = ["SessionHandle"]

ObjectT = TypeVar("ObjectT", bound=StateObject)


def _remove(state: ms.ManagerState, sid: str, name: str) -> ms.ManagerState:
    return session_edits.update_session(state, sid, lambda s: s.remove(name))


class SessionHandle:
    """The object API on one session incarnation. Obtain it from `SessionStateManager`.

    Write methods return the handle, so calls chain: ``h.put("x", buf).commit("x", item)``.

    ``table_only`` (see `table_only`): every read and write refuses once the incarnation left the table.
    """

    __slots__ = ("__weakref__", "_cell", "_only", "_ops", "_slot")

    def __init__(self, ops: SessionOps, cell: Cell, *, table_only: bool = False):
        self._ops = ops
        self._cell = cell
        self._slot = ops.slot  # (the hot paths read the table and install through it directly)
        self._only = bool(table_only)

    def table_only(self) -> SessionHandle:
        """A handle on the same incarnation that reads and writes only the manager's table: once the incarnation
        left it (evicted, dropped, replaced), every read and write raises `SessionStateLostError`, decided by each
        write under the lock it installs with (as `commit_held` does), so no write reaches a detached copy.

        Example:
          >>> from functional_state import LatentBuffer, SessionStateManager
          >>> manager = SessionStateManager(max_sessions=1)
          >>> h = manager.get_or_create_session("a").table_only().put("x", LatentBuffer.create(maxlen=2))
          >>> _ = manager.get_or_create_session("b")  # the count cap evicts "a"
          >>> h.commit("x", 1.0)
          Traceback (most recent call last):
          ...
          functional_state.errors.SessionStateLostError: `SessionHandle.commit_held`: session 'a' was evicted ...
        """
        return SessionHandle(self._ops, self._cell, table_only=True)

    @property
    def session_id(self) -> str:
        return self._cell.session_id

    @property
    def in_table(self) -> bool:
        """False once this incarnation was evicted or dropped from the manager's table."""
        return self._slot.held(self._cell) is not None

    @property
    def state(self) -> SessionState:
        """The session's current immutable `SessionState` (a table-only handle: refused once it left)."""
        if self._only:
            held = self._slot.held(self._cell)
            if held is None:
                raise self._ops.left_error(self._cell, "state")
            return held
        return self._ops.read(self._cell)

    def __bool__(self) -> bool:
        return True

    def transact(self, fn: Callable[[SessionState], SessionState]) -> SessionHandle:
        """Replace the session by ``fn(session)``: all of fn's changes land, or none (if fn raises, the
        session is unchanged).

        ``fn`` runs outside the manager's lock, so it may read through handles and use the manager; if
        another thread changed the session meanwhile, ``fn`` runs again on the newer session. So ``fn`` must
        be a function of the session it receives (no side effects it cannot repeat), and must not write
        to this session through a handle (`ReentrantWriteError`).
        """
        self._ops.transact(self._cell, lambda s: (fn(s), None), table_only=self._only)
        return self

    def update(self, name: str, fn: Callable[[StateObject], StateObject]) -> SessionHandle:
        """Replace object ``name`` by ``fn(object)`` in one step (several commits, one swap)."""
        return self.transact(lambda s: s.update(name, fn))

    # objects
    @overload
    def get(self, name: str, default: Any = ..., *, cls: type[ObjectT]) -> ObjectT: ...
    @overload
    def get(self, name: str, default: Any = ...) -> Any: ...
    def get(self, name: str, default: Any = MISSING, *, cls: type[Any] | None = None) -> Any:
        """The state object ``name`` (immutable snapshot); a parked object is restored first.

        ``cls`` names the type expected (checked, and seen by type checkers: ``h.get("x", cls=LatentBuffer)``
        is a `LatentBuffer`)."""
        return _typed(self._get(name, default, "SessionHandle.get"), cls, name)

    def _get(self, name: str, default: Any, what: str) -> Any:
        obj = self.state.get(name, default)
        if isinstance(obj, StateObject) and obj.parked:
            obj = self._ops.restored(self._cell, [name], table_only=self._only).get(name, default)
        if RECORDS and isinstance(obj, StateObject):  # (a snapshot: never one a sharer wrote in place, unseen)
            check_object(self._slot.table, self._cell.session_id, name, obj, what)
        return obj

    def park(self, name: str, *, with_sharers: bool = False, copy: bool = False) -> dict[str, int]:
        """Park object ``name`` in host memory; the next access through any handle restores it. Returns the
        bytes moved per pool (see `functional_state.park`; ``copy``: a private host copy even on the CPU)."""
        return self._ops.apply(
            self._cell,
            "park",
            parked.park,
            name,
            names=(),
            with_sharers=with_sharers,
            copy=copy,
            table_only=self._only,
        )

    def restore(self, name: str) -> dict[str, int]:
        """Restore a parked object now (handles also do it on first access). Returns the bytes moved per pool."""
        return self._ops.apply(
            self._cell, "restore", parked.restore, name, names=(), acquires=True, table_only=self._only
        )

    def put(self, name: str, obj: StateObject) -> SessionHandle:
        return self._ops.apply(self._cell, "put", ms.put, name, obj, inline=True, table_only=self._only) or self

    def remove(self, name: str) -> SessionHandle:
        """Remove object ``name`` (a no-op if absent)."""
        return self._ops.apply(self._cell, "remove", _remove, name, inline=True, table_only=self._only) or self

    def get_or_create(self, name: str, factory: Callable[[], ObjectT], cls: type[ObjectT] | None = None) -> ObjectT:
        """The object ``name``, built with ``factory`` when absent, of the wrong type or not resident.

        The factory runs outside the manager's lock (it may use the manager); if two threads race, one
        object wins and both get it. A parked object is restored, never rebuilt.
        """
        cell, table = self._cell, self._slot.table  # (the table first, then ``left``: see `Slot.held`)
        if cell.left is None:  # the per-step read: one lookup of the object in the installed table
            obj = held_object(table, cell.session_id, cell.uid, name)  # (MISSING: not in the table)
            if obj is None:
                return self._ops.create(cell, name, factory, cls, table_only=self._only, seen=table)
            if obj is not MISSING and obj.status == RESIDENT and (cls is None or isinstance(obj, cls)):
                return obj  # (what `_reusable` returns; every other case is decided below, as before)
        session = self._slot.held(cell)
        if session is None and self._only:
            raise self._ops.left_error(cell, "get_or_create")
        try:
            obj = (cell.session if session is None else session)._reusable(name, cls)
        except ObjectParkedError:  # restored and read under one lock: no other thread parks it in between
            obj = self._ops.restored(self._cell, [name], table_only=self._only)._reusable(name, cls)
        if obj is not None:
            return obj
        return self._ops.create(self._cell, name, factory, cls, table_only=self._only)

    def held(self, name: str) -> Any:
        """Object ``name`` as the manager's table holds it now (one lock-free read; a parked object is returned
        parked), or None if the session has none: for a caller that must never read a detached copy.

        Raises:
          SessionStateLostError: this incarnation is no longer in the table (evicted, dropped or replaced).
        """
        cell, table = self._cell, self._slot.table  # (the table first, then ``left``: see `Slot.held`)
        if cell.left is None:
            obj = held_object(table, cell.session_id, cell.uid, name)
            if obj is not MISSING:
                return obj
        raise self._ops.left_error(cell, "held")

    def commit_held(self, name: str, payload: Any = MISSING) -> SessionHandle:
        """`commit`, only into the table: refused, with nothing written, once this incarnation left it (the
        one-step commit decides that under the same lock as the write).

        Raises:
          SessionStateLostError: this incarnation is no longer in the table (evicted, dropped or replaced).
        """
        done = self._slot.commit(self._cell, name, payload)
        return self if done is None else self._commit("commit_held", name, payload, True)

    def stage(self, name: str, payload: Any) -> SessionHandle:
        ops, only = self._ops, self._only
        return (
            ops.apply(self._cell, "stage", ms.stage, name, payload, names=(name,), inline=True, table_only=only) or self
        )

    def commit(self, name: str, payload: Any = MISSING) -> SessionHandle:
        done = self._slot.commit(self._cell, name, payload)  # the per-step write: one lock, one pure verb
        if done is None:
            return self
        only = self._only
        return self._commit("commit_held" if only else "commit", name, payload, only)

    def _commit(self, what: str, name: str, payload: Any, only: bool) -> SessionHandle:
        """A commit `Slot.commit` declined, by the retry loop, which decides on the very table it installs on
        (``only``: refused once the incarnation left it)."""
        out = self._ops.apply(
            self._cell, what, ms.commit, name, payload, names=(name,), attrs_unchanged=True, table_only=only
        )
        return out or self

    def append(self, name: str, payload: Any) -> SessionHandle:
        return self.commit(name, payload)

    def discard(self, name: str) -> SessionHandle:
        ops, only = self._ops, self._only
        return ops.apply(self._cell, "discard", ms.discard, name, names=(name,), inline=True, table_only=only) or self

    def view(self, name: str, include_staged: bool = True) -> Any:
        return self._get(name, MISSING, "SessionHandle.view").view(include_staged=include_staged)

    def writable(self, name: str) -> Any:
        """Object ``name``'s view to write in place: its torch storages that a fork (or anything else) shares
        are copied into this session first (see `functional_state.writable`); `commit` it afterwards."""
        return self._ops.apply(self._cell, "writable", writable, name, names=(name,), table_only=self._only)

    def evict(self, name: str) -> int:
        """Release object ``name``'s committed storage; returns the bytes that left the session's accounting."""
        return self._ops.apply(self._cell, "evict", session_edits.evict, name, names=(name,), table_only=self._only)

    def step(
        self, name: str, fn: Callable[..., StateObject], *args: Any, donate: bool = False, retained: Iterable[Any] = ()
    ) -> SessionHandle:
        """`SessionStateManager.step` on this session (which must be in the table)."""
        self._ops.step(self._cell, name, fn, *args, donate=donate, retained=retained)
        return self

    # attrs
    def get_attr(self, key: str, default: Any = MISSING) -> Any:
        return self.state.get_attr(key, default)

    def set_attr(self, key: str, value: Any, *, on_fork: ForkPolicy | None = None) -> SessionHandle:
        return (
            self._ops.apply(
                self._cell,
                "set_attr",
                session_edits.set_attr,
                key,
                value,
                on_fork=on_fork,
                inline=True,
                table_only=self._only,
            )
            or self
        )

    def del_attr(self, key: str) -> SessionHandle:
        ops, only = self._ops, self._only
        return ops.apply(self._cell, "del_attr", session_edits.del_attr, key, inline=True, table_only=only) or self

    def reset(self) -> SessionHandle:
        """Reset every object and clear the attrs."""
        ops, only = self._ops, self._only
        return ops.apply(self._cell, "reset", session_edits.reset_session, inline=True, table_only=only) or self

    def nbytes_by_device(self) -> dict[str, int]:
        return self.state.nbytes_by_device()

    def __repr__(self) -> str:
        where = "in table" if self.in_table else "detached"
        only = ", table only" if self._only else ""
        return f"SessionHandle({self.session_id!r}, {where}{only}, {self._ops.read(self._cell)!r})"


def _typed(obj: Any, cls: type[Any] | None, name: str) -> Any:
    if cls is not None and not isinstance(obj, cls):
        raise InvalidTypeError(f"`SessionHandle.get`: object {name!r} is a {type(obj).__name__}, not a {cls.__name__}.")
    return obj
