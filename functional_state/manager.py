"""`SessionStateManager`: a thread-safe imperative shell over the pure `ManagerState` functions.

The shell holds one immutable `ManagerState` and swaps it under a lock; every operation is one of the pure
functions. Session handles give the object API the bespoke caches had:

* writes through any handle of a session that is in the table are seen by every handle of it;
* a handle whose session left the table (LRU eviction, drop) keeps working on its own copy, so nothing is
  lost mid-generation, and its writes never resurrect the evicted entry. A session later re-created under
  the same id is a new incarnation that old handles never touch.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, ContextManager, TypeVar

from . import accounting
from . import manager_state as ms
from ._pytree import MISSING
from .manager_state import ManagerState
from .session import SessionState
from .state_object import StateObject

__all__ = ["SessionStateManager", "SessionHandle"]

O = TypeVar("O", bound=StateObject)


class _Cell:
    """The latest state of one session incarnation, shared by all of its handles."""

    __slots__ = ("uid", "session_id", "session", "__weakref__")

    def __init__(self, uid: int, session_id: str, session: SessionState):
        self.uid = uid
        self.session_id = session_id
        self.session = session


class SessionStateManager:
    """Maps session ids to sessions with a count-capped LRU table; safe to call from several threads.

    Example:
      >>> from functional_state import LatentBuffer
      >>> manager = SessionStateManager(max_sessions=2)
      >>> h = manager.get_or_create_session("req-1")
      >>> _ = h.put("frames", LatentBuffer.create(maxlen=4)).commit("frames", 1.0)
      >>> manager.get_or_create_session("req-1").view("frames")
      (1.0,)
      >>> manager.stats()["hits"], manager.stats()["misses"]
      (1, 1)
    """

    def __init__(
        self,
        max_sessions: int = ms.DEFAULT_MAX_SESSIONS,
        byte_budget: int | None = None,
        evict_when_full: bool = True,
        lock_factory: Callable[[], ContextManager[Any]] = threading.Lock,
    ):
        self._state = ManagerState.create(max_sessions, byte_budget, evict_when_full)
        self._lock = lock_factory()
        self._cells: weakref.WeakValueDictionary[int, _Cell] = weakref.WeakValueDictionary()

    # --- the immutable value -----------------------------------------------------------------------
    @property
    def state(self) -> ManagerState:
        """The current immutable `ManagerState` (a snapshot: later calls never change it)."""
        return self._state

    def _cell(self, session_id: str, session: SessionState) -> _Cell:
        uid = ms._entry_uid(self._state, session_id)
        cell = self._cells.get(uid)
        if cell is None:
            cell = _Cell(uid, session_id, session)
            self._cells[uid] = cell
        return cell

    # --- sessions ----------------------------------------------------------------------------------
    def get_or_create_session(self, session_id: str | None = None) -> "SessionHandle":
        """A handle on session ``session_id`` (None means ``"default"``), created on a miss.

        Raises:
          SessionAdmissionError: the table is full and ``evict_when_full=False``.
        """
        with self._lock:
            self._state, session = ms.get_or_create(self._state, session_id)
            return SessionHandle(self, self._cell(ms._resolve_id(session_id), session))

    def get_session(self, session_id: str | None = None) -> "SessionHandle":
        """A handle on an existing session, for continuations.

        Raises:
          SessionStateLostError: the session is unknown, evicted or dropped; nothing is created.
        """
        with self._lock:
            self._state, session = ms.get_session(self._state, session_id)
            return SessionHandle(self, self._cell(ms._resolve_id(session_id), session))

    def fork_session(self, source_id: str | None, new_id: str) -> "SessionHandle":
        """Copy-on-write fork (see `functional_state.fork_session`); returns a handle on the fork."""
        with self._lock:
            self._state = ms.fork_session(self._state, source_id, new_id)
            return SessionHandle(self, self._cell(new_id, self._state._entries[new_id].session))

    def drop_session(self, session_id: str | None) -> bool:
        """Remove a session from the table; True if it was there. Live handles keep their state."""
        with self._lock:
            self._state, existed = ms.drop_session(self._state, session_id)
            return existed

    def raise_max_sessions(self, n: int) -> None:
        """Raise the count cap (see `functional_state.raise_max_sessions`)."""
        with self._lock:
            self._state = ms.raise_max_sessions(self._state, n)

    def stats(self) -> dict[str, Any]:
        """Counters and per-device bytes of the current state (see `functional_state.stats`)."""
        return ms.stats(self._state)

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes per device held by all sessions in the table, each allocation once."""
        return accounting.nbytes_by_device(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, session_id: Any) -> bool:
        return session_id in self._state

    def __repr__(self) -> str:
        return f"SessionStateManager({self._state!r})"

    # --- handle plumbing ---------------------------------------------------------------------------
    def _in_table(self, cell: _Cell) -> bool:
        return ms._entry_uid(self._state, cell.session_id) == cell.uid

    def _read(self, cell: _Cell) -> SessionState:
        with self._lock:
            if self._in_table(cell):
                return self._state._entries[cell.session_id].session
            return cell.session

    def _write(self, cell: _Cell, fn: Callable[[SessionState], tuple[SessionState, Any]]) -> Any:
        with self._lock:
            if self._in_table(cell):
                result: list[Any] = []

                def apply(session: SessionState) -> SessionState:
                    new, out = fn(session)
                    result.append(out)
                    return new

                self._state = ms.update_session(self._state, cell.session_id, apply)
                cell.session = self._state._entries[cell.session_id].session
                return result[0]
            cell.session, out = fn(cell.session)
            return out


class SessionHandle:
    """The object API on one session incarnation. Obtain it from `SessionStateManager`.

    Write methods return the handle, so calls chain: ``h.put("x", buf).commit("x", item)``.
    """

    __slots__ = ("_manager", "_cell")

    def __init__(self, manager: SessionStateManager, cell: _Cell):
        self._manager = manager
        self._cell = cell

    @property
    def session_id(self) -> str:
        return self._cell.session_id

    @property
    def in_table(self) -> bool:
        """False once this incarnation was evicted or dropped from the manager's table."""
        with self._manager._lock:
            return self._manager._in_table(self._cell)

    @property
    def state(self) -> SessionState:
        """The session's current immutable `SessionState`."""
        return self._manager._read(self._cell)

    def transact(self, fn: Callable[[SessionState], SessionState]) -> "SessionHandle":
        """Replace the session by ``fn(session)`` in one locked step: all of fn's changes land, or none
        (if fn raises, the session is unchanged)."""
        self._manager._write(self._cell, lambda s: (fn(s), None))
        return self

    def update(self, name: str, fn: Callable[[StateObject], StateObject]) -> "SessionHandle":
        """Replace object ``name`` by ``fn(object)`` in one locked step (several commits, one swap)."""
        return self.transact(lambda s: s.update(name, fn))

    # objects
    def get(self, name: str, default: Any = MISSING) -> Any:
        """The state object ``name`` (immutable snapshot)."""
        return self.state.get(name, default)

    def put(self, name: str, obj: StateObject) -> "SessionHandle":
        return self.transact(lambda s: s.put(name, obj))

    def remove(self, name: str) -> "SessionHandle":
        """Remove object ``name`` (a no-op if absent)."""
        return self.transact(lambda s: s.remove(name))

    def get_or_create(self, name: str, factory: Callable[[], O], cls: type[O] | None = None) -> O:
        """The object ``name``, built with ``factory`` when absent, of the wrong type or not resident."""
        obj = self.state._reusable(name, cls)
        if obj is not None:
            return obj  # the common case reads without taking the write path
        return self._manager._write(self._cell, lambda s: s.get_or_create(name, factory, cls))

    def stage(self, name: str, payload: Any) -> "SessionHandle":
        return self.update(name, lambda o: o.stage(payload))

    def commit(self, name: str, payload: Any = MISSING) -> "SessionHandle":
        return self.update(name, lambda o: o.commit(payload))

    def append(self, name: str, payload: Any) -> "SessionHandle":
        return self.update(name, lambda o: o.append(payload))

    def discard(self, name: str) -> "SessionHandle":
        return self.update(name, lambda o: o.discard())

    def view(self, name: str, include_staged: bool = True) -> Any:
        return self.state.get(name).view(include_staged=include_staged)

    def evict(self, name: str) -> int:
        """Release object ``name``'s committed storage; returns the bytes that left the session's accounting."""
        return self._manager._write(self._cell, lambda s: ms._evict_object(s, name))

    # attrs
    def get_attr(self, key: str, default: Any = MISSING) -> Any:
        return self.state.get_attr(key, default)

    def set_attr(self, key: str, value: Any) -> "SessionHandle":
        return self.transact(lambda s: s.set_attr(key, value))

    def del_attr(self, key: str) -> "SessionHandle":
        return self.transact(lambda s: s.del_attr(key))

    def reset(self) -> "SessionHandle":
        """Reset every object and clear the attrs."""
        return self.transact(SessionState.reset)

    def nbytes_by_device(self) -> dict[str, int]:
        return self.state.nbytes_by_device()

    def __repr__(self) -> str:
        where = "in table" if self.in_table else "detached"
        return f"SessionHandle({self.session_id!r}, {where}, {self.state!r})"
