"""`SessionStateManager`: a thread-safe imperative shell over the pure `ManagerState` functions.

The shell holds one immutable `ManagerState` and swaps it under a lock. Every operation is one of the
public pure functions; the lock is held only while a new value is computed by library code and swapped
in, never while user code runs: a ``transact`` function or a ``get_or_create`` factory runs on the
immutable value outside the lock, and its result is swapped in only if the session did not change
meanwhile (compare and retry). So user code may read the manager, or write to *other* sessions, freely.

Session handles give the object API the bespoke caches had:

* writes through any handle of a session that is in the table are seen by every handle of it;
* a handle whose session left the table (LRU eviction, drop) keeps working on its own copy, so nothing is
  lost mid-generation, and its writes never resurrect the evicted entry. A session later re-created under
  the same id is a new incarnation that old handles never touch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, TypeVar

from ..core.pytree import MISSING
from ..core.session import ForkPolicy, SessionState
from ..core.state_object import StateObject
from ..engine.kv_handle import PagedKVHandle
from ..engine.paged_kv import POOLS
from ..errors import ObjectParkedError, SessionStateError, SessionStateLostError
from ..persist import checkpoint as _ckpt
from ..policy.enforce import attr_bytes, attr_surplus, enforce_budget, over_budget_objects
from ..policy.planner import LEVERS
from ..table import manager_state as ms
from ..table.engine_blocks import free_released
from ..table.manager_state import ManagerState
from ..table.parked import park as park_object
from ..table.parked import restore as restore_object
from ..table.session_edits import update_session
from ..table.step import step as _pure_step
from ..table.usage import stats as table_stats

__all__ = ["ReentrantWriteError", "SessionHandle", "SessionStateManager"]

ObjectT = TypeVar("ObjectT", bound=StateObject)
_Result = TypeVar("_Result")

_log = logging.getLogger("functional_state")
_DEPARTED_KEPT = 4096  # why the most recent departed ids left: named by errors about them


class ReentrantWriteError(SessionStateError, RuntimeError):
    """A ``transact`` function (or a factory) wrote to the very session it is computing a new state for."""


class _Cell:
    """The latest state of one session incarnation, shared by all of its handles.

    ``left`` says why the incarnation left the table (None while it is there); ``closed`` is True when it
    left because a caller removed it (a drop): its handles then refuse writes, which could reach no session.
    """

    __slots__ = ("__weakref__", "closed", "left", "session", "session_id", "uid")

    def __init__(self, uid: int, session_id: str, session: SessionState):
        self.uid = uid
        self.session_id = session_id
        self.session = session
        self.left: str | None = None
        self.closed = False


class _Departure(NamedTuple):
    """A session incarnation a write took out of the table, and the last state it had there."""

    sid: str
    uid: int
    session: SessionState
    reason: str  # "evicted (...)" or "dropped (...)", for logs and errors
    closed: bool  # a caller removed it: its handles refuse writes


def _holds(state: ManagerState, sid: str, uid: int) -> bool:
    """Whether ``state`` holds incarnation ``uid`` of ``sid``."""
    return ms.held_session(state, sid, uid) is not None


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
        byte_budget: Any = None,
        evict_when_full: bool = True,
        lock_factory: Callable[[], AbstractContextManager[Any]] = threading.Lock,
        release_levers: Iterable[str] = LEVERS,
    ):
        """
        Args:
          max_sessions: the count cap (see `ManagerState.create`).
          byte_budget: bytes per pool (see `ManagerState.create`). With a budget, every write that leaves a
            pool over it releases what `plan_release` chooses (parking, evicting, dropping least recently used
            sessions first), never touching the writing session or a pinned one (`pin`); a write that cannot
            fit even so raises `BudgetExceededError` and changes nothing.
          evict_when_full: LRU eviction at the count cap (True) or admission control (False).
          lock_factory: builds the lock the shell swaps states under.
          release_levers: the levers the budget may use, of ``("park", "evict", "drop")``.
        """
        self._state = ManagerState.create(max_sessions, byte_budget, evict_when_full)
        self._levers = tuple(release_levers)
        bad = [lever for lever in self._levers if lever not in LEVERS]
        if bad:
            raise ms.InvalidArgumentError(
                f"`SessionStateManager`: unknown release lever(s) {bad}; choose from {LEVERS}."
            )
        self._pins: Counter[str] = Counter()  # sessions the budget must not touch (requests in flight)
        self._attr_surplus: dict[str, int] | None = None  # attr bytes beyond the objects', at the last full check
        self._lock = lock_factory()
        # Cells of sessions in the table, by incarnation: kept while the session is in the table, so handles
        # made per call share one cell. A cell leaves this dict when its session leaves the table; handles
        # still holding it then work on its own copy (and `_detached` tracks it for `step`).
        self._cells: dict[int, _Cell] = {}
        self._detached: weakref.WeakSet[_Cell] = weakref.WeakSet()
        self._departed: OrderedDict[str, str] = OrderedDict()  # id -> why it last left (for errors)
        self._published: weakref.WeakSet[ManagerState] = weakref.WeakSet()
        self._writing = threading.local()  # uids whose transaction this thread is computing

    # --- the immutable value -----------------------------------------------------------------------
    @property
    def state(self) -> ManagerState:
        """The current immutable `ManagerState` (a snapshot: later calls never change it)."""
        state = self._state
        self._published.add(state)  # `step` never donates a buffer a snapshot handed out may still read
        return state

    def __bool__(self) -> bool:
        return True  # an empty manager is still a manager

    def _swap(
        self,
        op: Callable[[ManagerState], tuple[ManagerState, _Result]],
        writer: str | None = None,
        *,
        dropped: Callable[[ManagerState], Mapping[str, str]] | None = None,
        restoring: bool = False,
    ) -> _Result:
        """Apply library code ``op`` to the table under the lock (no user code may run inside), keeping the
        byte budget (``writer``, the session written, is never released to make room).

        ``dropped(before)`` names the sessions the op removes at a caller's request, with why (see `_settle`).
        ``restoring``: the op restores parked objects; if the write is refused, the engine blocks their
        ``reload`` took go back (`_hand_back`)."""
        with self._lock:
            return self._swap_locked(op, writer, dropped, restoring)

    def _swap_locked(
        self,
        op: Callable[[ManagerState], tuple[ManagerState, _Result]],
        writer: str | None,
        dropped: Callable[[ManagerState], Mapping[str, str]] | None,
        restoring: bool,
    ) -> _Result:
        before = self._state
        after, out = op(before)
        try:
            self._state = self._settle(before, after, writer, dropped=dropped(before) if dropped else None)
        except BaseException:
            if restoring and writer is not None:
                self._hand_back(before, after, writer)
            raise
        return out

    def _swap_cell(
        self,
        op: Callable[[ManagerState], ManagerState],
        sid: str,
        writer: str | None = None,
        dropped: Callable[[ManagerState], Mapping[str, str]] | None = None,
    ) -> _Cell:
        """`_swap`, then the cell of ``sid`` in the installed table (made only once the write is in: a cell
        made for a write that was refused would name an incarnation number the next insertion reuses)."""
        with self._lock:
            self._swap_locked(lambda state: (op(state), None), writer, dropped, False)
            return self._cell(self._state, sid)

    def _settle(
        self,
        before: ManagerState,
        after: ManagerState,
        writer: str | None,
        attrs_unchanged: bool = False,
        admit: bool = True,
        dropped: Mapping[str, str] | None = None,
    ) -> ManagerState:
        """Under the lock: the state a write installs, and the one place handles learn that sessions left.

        ``after`` is brought within the byte budget (`_admit`); then the sessions that left the table are
        found by comparing ``before`` with the result, by incarnation (an LRU eviction, a drop, a release by
        the budget: whatever the op did, never a prediction of it); the engine KV blocks no handle holds
        any more go back to their engines, each exactly once; and only then the handles of the sessions
        that left switch to their own copies. A refused budget or a failing engine callback (`KVFreeError`)
        raises before anything changed.

        ``dropped``: ids the op removes at a caller's request, with why (``"dropped (...)"``): these leave
        even if an id's incarnation number reappears (a table replaced by `load`), and their handles refuse
        writes. Other departures are evictions, whose handles keep working on their own copy."""
        final = self._admit(before, after, writer, attrs_unchanged) if admit else after
        if final is before:
            return final
        left = self._departures(before, after, final, dropped or {})
        # (A state a donating step consumed held no fewer blocks than its successor: a step changes one
        # object's arrays, never which handles the table holds.)
        released = free_released(before, final) if POOLS and type(before) is ManagerState else {}
        if left:
            self._detach(left)
        if released:
            self._evict_detached_handles(released)
        return final

    def _departures(
        self, before: ManagerState, after: ManagerState, final: ManagerState, dropped: Mapping[str, str]
    ) -> list[_Departure]:
        """The incarnations in ``before`` that ``final`` no longer holds: those ``op`` removed (``before`` to
        ``after``), then those the budget released (``after`` to ``final``)."""
        out: list[_Departure] = []
        # A table derived from `before` gained exactly one incarnation number per insertion, so the sessions
        # that left number `missing`; they are found from the least recent end (where an LRU eviction takes
        # them), stopping once all are found: a miss at a full table costs O(1), not a walk of the table.
        missing = len(before) + (after.issued - before.issued) - len(after)
        for sid, reason in dropped.items():
            uid = ms.incarnation_of(before, sid)
            if uid is not None:
                out.append(_Departure(sid, uid, ms.lookup(before, sid), reason, True))
                missing -= not _holds(after, sid, uid)
        if missing:
            exhaustive = missing < 0  # `after` was not derived from `before` (a load): look at every session
            evicted = f"evicted (LRU: the table holds at most max_sessions={before.max_sessions})"
            for sid, uid, session in ms.entries_lru(before):
                if sid not in dropped and not _holds(after, sid, uid):
                    out.append(_Departure(sid, uid, session, evicted, False))
                    missing -= 1
                    if not missing and not exhaustive:
                        break
        gone_by_budget = len(after) - len(final) if final is not after else 0
        if gone_by_budget > 0:
            gone = {d.uid for d in out}
            budget = "dropped by the byte budget (to make room; released like an LRU eviction)"
            for sid, uid, session in ms.entries_lru(after):
                if uid not in gone and not _holds(final, sid, uid):
                    out.append(_Departure(sid, uid, session, budget, False))
                    gone_by_budget -= 1
                    if not gone_by_budget:
                        break
        return out

    def _detach(self, left: list[_Departure]) -> None:
        """Under the lock, once a write that took sessions out of the table is certain to be installed: the
        live handles of each keep its last state as their own copy (handles of a session in the table read
        and write the table; only on leaving does the copy matter, so writes never pay for keeping it)."""
        for d in left:
            self._departed[d.sid] = d.reason
            self._departed.move_to_end(d.sid)
            if len(self._departed) > _DEPARTED_KEPT:
                self._departed.popitem(last=False)
            if d.closed or d.reason.startswith("dropped"):
                _log.info("session %r %s", d.sid, d.reason)
            else:
                _log.debug("session %r %s", d.sid, d.reason)
            cell = self._cells.pop(d.uid, None)
            if cell is not None:
                cell.session = d.session  # first: a lock-free reader that sees `left` must find the copy
                cell.closed = d.closed
                cell.left = d.reason
                self._detached.add(cell)

    def _evict_detached_handles(self, released: dict[Any, tuple[int, ...]]) -> None:
        """Handles of sessions that left the table keep their copy, minus the engine blocks just freed: a
        handle holding a block that went back to the engine is evicted there, so it never reads recycled
        memory."""
        freed = {pool.uid: set(ids) for pool, ids in released.items()}
        for cell in list(self._detached):
            session = cell.session
            for name, obj in session.objects.items():
                if isinstance(obj, PagedKVHandle) and freed.get(obj.pool.uid, set()) & set(obj.held_blocks()):
                    session = session.update(name, lambda o: o.evict()[0])
                    _log.debug(
                        "session %r: detached handle's KV %r evicted (its blocks went back)", cell.session_id, name
                    )
            cell.session = session

    def _hand_back(self, before: ManagerState, restored: ManagerState, sid: str) -> None:
        """Under the lock, when a write that restored parked objects of ``sid`` (``before`` to ``restored``)
        is refused: the engine blocks their ``reload`` took, which no state will hold, go back to their
        engines. The parked objects in the table keep their host copies, so they can be restored later."""
        if not POOLS or before is restored:
            return
        old, new = ms.lookup(before, sid, None), ms.lookup(restored, sid, None)
        if old is None or new is None:
            return
        reloaded: dict[Any, list[int]] = {}
        for name, obj in new.objects.items():
            prev = old.objects.get(name)
            if isinstance(obj, PagedKVHandle) and isinstance(prev, PagedKVHandle) and prev.parked and obj.resident:
                reloaded.setdefault(obj.pool, []).extend(obj.block_ids)  # fresh blocks: no one else holds them
        for pool, ids in reloaded.items():
            try:
                pool.free_fn(tuple(sorted(ids)))
            except Exception:
                _log.warning(
                    "KV pool %r: a refused restore could not hand its reloaded blocks back", pool.name, exc_info=True
                )

    def _admit(
        self, before: ManagerState, after: ManagerState, writer: str | None, attrs_unchanged: bool = False
    ) -> ManagerState:
        """Under the lock: ``after`` brought within the byte budget, or BudgetExceededError (nothing changes).
        Sessions the budget drops leave their handles working on their own copy, as an eviction does
        (`_settle` detaches them).

        The common case is a write that stays within budget: it is decided from the kept object totals plus
        an upper bound on the attr bytes beyond them, with no walk of the table. The bound is exact after a
        full check; a write that changes a session's attrs adds all its new attr bytes to it (reading only
        that session's attrs). A full check (which re-reads every attr, and plans a release when a pool is
        over) runs when that sum crosses a budget, and makes the bound exact again. An attr a model grows in
        place is therefore seen at the next full check (any pool near its budget), or by `stats()`."""
        if after is before or after.byte_budget is None:
            return after
        if self._within_budget_fast(before, after, writer, attrs_unchanged):
            return after
        protect = {sid for sid, n in self._pins.items() if n and sid in after}
        if writer is not None and writer in after:
            protect.add(writer)
        enforced = enforce_budget(after, protect, levers=self._levers)
        self._attr_surplus = attr_surplus(enforced)
        return enforced

    def _within_budget_fast(
        self, before: ManagerState, after: ManagerState, writer: str | None, attrs_unchanged: bool
    ) -> bool:
        if self._attr_surplus is None:
            return False
        bound = self._attr_surplus
        if not attrs_unchanged and writer is not None and writer in after:
            attrs = ms.lookup(after, writer).attrs
            if writer not in before or ms.lookup(before, writer).attrs is not attrs:
                extra = attr_bytes(attrs)
                if extra:
                    bound = {p: bound.get(p, 0) + extra.get(p, 0) for p in bound.keys() | extra.keys()}
        if over_budget_objects(after, bound):
            return False
        self._attr_surplus = bound
        return True

    @contextlib.contextmanager
    def pin(self, session_id: str | None) -> Iterator[None]:
        """Protect a session from the byte budget while the block runs (a request in flight): its objects are
        never parked, evicted or dropped to make room. Pins nest.

        Example:
          >>> manager = SessionStateManager(byte_budget="1GiB")
          >>> with manager.pin("req-1"):
          ...     _ = manager.get_or_create_session("req-1")
        """
        sid = ms.resolve_session_id(session_id)
        with self._lock:
            self._pins[sid] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[sid] -= 1
                if not self._pins[sid]:
                    del self._pins[sid]

    def _cell(self, state: ManagerState, sid: str) -> _Cell:
        uid = ms.incarnation(state, sid)
        assert uid is not None
        cell = self._cells.get(uid)
        if cell is None:
            cell = _Cell(uid, sid, ms.lookup(state, sid))
            self._cells[uid] = cell
        return cell

    def _require(self, state: ManagerState, sid: str, what: str) -> None:
        """Refuse an absent session that this shell saw leave, saying how it left (the pure functions can
        only say it is absent)."""
        if sid not in state and sid in self._departed:
            raise SessionStateLostError(
                f"`{what}`: session {sid!r} was {self._departed[sid]}, so a continuation cannot resume it. "
                f"Start a new session with `get_or_create_session`."
            )

    # --- sessions ----------------------------------------------------------------------------------
    def get_or_create_session(self, session_id: str | None = None) -> SessionHandle:
        """A handle on session ``session_id`` (None means ``"default"``), created on a miss.

        Raises:
          SessionAdmissionError: the table is full and ``evict_when_full=False``.
        """
        sid = ms.resolve_session_id(session_id)

        with self._lock:
            state = self._state
            uid = ms.incarnation_of(state, sid)
            if uid is not None:  # a hit: the common case, kept short (a hit adds no bytes: no budget check)
                self._state = state = ms.get_or_create(state, sid)[0]
                cell = self._cells.get(uid)
                if cell is None:
                    cell = self._cell(state, sid)
            else:  # a miss adds an empty session (no bytes), evicting the least recent one at the cap
                self._state = state = self._settle(state, ms.get_or_create(state, sid)[0], sid, admit=False)
                cell = self._cell(state, sid)
        return SessionHandle(self, cell)

    def get_session(self, session_id: str | None = None) -> SessionHandle:
        """A handle on an existing session, for continuations.

        Raises:
          SessionStateLostError: the session is unknown, evicted or dropped (the message says which, for a
            session this manager saw leave); nothing is created.
        """
        sid = ms.resolve_session_id(session_id)

        def op(state: ManagerState) -> ManagerState:
            self._require(state, sid, "get_session")
            return ms.get_session(state, sid)[0]

        return SessionHandle(self, self._swap_cell(op, sid))

    def fork_session(self, source_id: str | None, new_id: str | None) -> SessionHandle:
        """Fork a session (see `functional_state.fork_session`); returns a handle on the fork.

        Raises:
          SessionStateLostError, SessionExistsError, SessionAdmissionError: as the pure function; the
            table is unchanged then.
        """
        nid = ms.resolve_session_id(new_id)

        def op(state: ManagerState) -> ManagerState:
            if source_id is None or isinstance(source_id, str):
                self._require(state, ms.resolve_session_id(source_id), "fork_session")
            return ms.fork_session(state, source_id, nid)

        return SessionHandle(self, self._swap_cell(op, nid, writer=nid))

    # --- checkpoints -------------------------------------------------------------------------------
    def save_session(self, session_id: str | None, path: Any, *, asynchronous: bool = False, **hooks: Any) -> Any:
        """Write session ``session_id`` as it is now (a snapshot: the write never blocks other sessions); see
        `functional_state.save_session` for the arguments. Returns its `SaveHandle`."""
        return _ckpt.save_session(self.state, session_id, path, asynchronous=asynchronous, **hooks)

    def save(self, path: Any, *, asynchronous: bool = False, **hooks: Any) -> Any:
        """Write the whole table as it is now (see `functional_state.save`)."""
        return _ckpt.save(self.state, path, asynchronous=asynchronous, **hooks)

    def load_session(
        self,
        session_id: str | None,
        path: Any,
        *,
        as_id: str | None = None,
        replace: bool = False,
        placement: Any = None,
        torch_device: Any = None,
        **hooks: Any,
    ) -> SessionHandle:
        """Load session ``session_id`` from the checkpoint at ``path`` (under ``as_id`` if given) and return a
        handle on it. The checkpoint is read outside the lock; the table changes only if it loads fully.

        Raises:
          CheckpointError, SessionExistsError: see `functional_state.load_session`.
        """
        target = ms.resolve_session_id(as_id if as_id is not None else session_id)
        _ckpt.check_free(self._state, target, replace)  # fail before reading the checkpoint
        session = _ckpt.read_session(session_id, path, placement=placement, torch_device=torch_device, **hooks)

        def op(state: ManagerState) -> ManagerState:
            _ckpt.check_free(state, target, replace)
            return _ckpt.install_session(state, target, session, replace=replace)

        replaced = {target: "dropped (replaced by `load_session(..., replace=True)`)"}
        try:
            cell = self._swap_cell(op, target, writer=target, dropped=lambda state: replaced)
        except BaseException as e:  # not installed (the id was taken meanwhile, or it exceeds the budget)
            _ckpt.release_sessions([session], e)
            raise
        return SessionHandle(self, cell)

    def load(self, path: Any, *, placement: Any = None, torch_device: Any = None, **hooks: Any) -> None:
        """Replace the whole table by the one a `save` wrote (its sessions, recency, counters, config). Handles
        on the sessions it replaces keep their own copies, as after a drop."""
        table = _ckpt.load(path, placement=placement, torch_device=torch_device, **hooks)

        def replaced(state: ManagerState) -> dict[str, str]:
            return dict.fromkeys(state.session_ids, "dropped (the table was replaced by `load`)")

        try:
            self._swap(lambda state: (table, None), dropped=replaced)
        except BaseException as e:
            _ckpt.release_sessions(ms.sessions(table).values(), e)
            raise

    def drop_session(self, session_id: str | None) -> bool:
        """Remove a session from the table; True if it was there. Live handles keep their last state to
        read, and refuse writes (which could reach no session): `SessionStateLostError`."""
        sid = ms.resolve_session_id(session_id)
        return self._swap(
            lambda state: ms.drop_session(state, sid), dropped=lambda state: {sid: "dropped (`drop_session`)"}
        )

    def raise_max_sessions(self, n: int) -> None:
        """Raise the count cap (see `functional_state.raise_max_sessions`)."""
        self._swap(lambda state: (ms.raise_max_sessions(state, n), None))

    def stats(self, *, exact: bool = False) -> dict[str, Any]:
        """Counters and per-pool bytes of the current state (see `functional_state.stats`)."""
        return table_stats(self._state, exact=exact)

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes per device held by all sessions in the table, each allocation once."""
        return {k[len("nbytes:") :]: v for k, v in self.stats().items() if k.startswith("nbytes:")}

    def step(
        self,
        session_id: str | None,
        name: str,
        fn: Callable[..., StateObject],
        *args: Any,
        donate: bool = False,
        retained: Iterable[Any] = (),
    ) -> None:
        """Run ``jax.jit(fn)(object, *args)`` on object ``name`` and store the result (see
        `functional_state.step`). With ``donate=True`` a buffer is donated only if no other session, fork,
        snapshot this manager handed out (``.state``), detached handle or value in ``retained`` still
        references it; otherwise it is copied first. An object or array you took out (``handle.get``) and
        still read is yours, as with `functional_state.step`: pass it in ``retained``. The jitted call runs under the lock (it is library code over immutable values).
        """
        sid = ms.resolve_session_id(session_id)
        kept = list(retained)

        def op(state: ManagerState) -> tuple[ManagerState, None]:
            self._require(state, sid, "step")
            self._refuse_reentrant_table_write(state, sid, "step")
            if state in self._published:
                # A caller holds this very table: nothing in it may be donated, and it must stay usable.
                return _pure_step(state, sid, name, fn, *args, donate=False), None
            # Other snapshots handed out and detached handles may still read this table's buffers. The
            # donating step consumes `state`, which only this shell held.
            protected: list[Any] = [*self._published, *(c.session for c in list(self._detached)), *kept]
            return _pure_step(state, sid, name, fn, *args, donate=donate, retained=protected), None

        self._swap(op, writer=sid)

    def park(self, session_id: str | None, name: str, *, with_sharers: bool = False) -> dict[str, int]:
        """Park object ``name`` of a session in host memory (see `functional_state.park`); returns the bytes
        moved per pool. Handles restore it on their next access.

        Under a byte budget the session parked is the writer: a host pool the park would leave over its
        budget may release other sessions, never this one.

        Raises:
          BudgetExceededError: the host copy does not fit even so; nothing changed.
        """
        sid = ms.resolve_session_id(session_id)

        def op(state: ManagerState) -> tuple[ManagerState, dict[str, int]]:
            self._require(state, sid, "park")
            self._refuse_reentrant_table_write(state, sid, "park")
            return park_object(state, sid, name, with_sharers=with_sharers)

        return self._swap(op, writer=sid)

    def restore(self, session_id: str | None, name: str) -> dict[str, int]:
        """Restore a parked object (see `functional_state.restore`); returns the bytes moved per pool.

        Raises:
          BudgetExceededError: the restored object does not fit the budget; nothing changed (engine blocks a
            KV ``reload`` took go back, and the object stays parked, restorable later).
        """
        sid = ms.resolve_session_id(session_id)

        def op(state: ManagerState) -> tuple[ManagerState, dict[str, int]]:
            self._require(state, sid, "restore")
            self._refuse_reentrant_table_write(state, sid, "restore")
            return restore_object(state, sid, name)

        return self._swap(op, writer=sid, restoring=True)

    def _refuse_reentrant_table_write(self, state: ManagerState, sid: str, what: str) -> None:
        uid = ms.incarnation(state, sid)
        if uid is not None and uid in self._writing_set():
            raise ReentrantWriteError(f"session {sid!r}: `{what}` inside a transaction on the same session.")

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._state

    def __repr__(self) -> str:
        return f"SessionStateManager({self._state!r})"

    # --- handle plumbing ---------------------------------------------------------------------------
    @staticmethod
    def _in_table(state: ManagerState, cell: _Cell) -> bool:
        # (the cell's id was checked when it was made)
        return cell.left is None and ms.held_session(state, cell.session_id, cell.uid) is not None

    def _read(self, cell: _Cell) -> SessionState:
        if cell.left is None:
            held = ms.held_session(self._state, cell.session_id, cell.uid)  # one atomic read: a snapshot
            if held is not None:
                return held
        return cell.session

    def _closed(self, cell: _Cell, what: str) -> SessionStateLostError:
        return SessionStateLostError(
            f"`{what}`: session {cell.session_id!r} was {cell.left}; this handle is detached from the manager "
            f"and a write through it would reach no session, so it is refused. Its last state is still "
            f"readable (`handle.state`); start a new session with `get_or_create_session`."
        )

    def _store(self, state: ManagerState, cell: _Cell, session: SessionState) -> ManagerState:
        """Under the lock: make ``session`` the cell's state, in the table if the cell is still there."""
        if self._in_table(state, cell):
            return update_session(state, cell.session_id, lambda _: session)
        cell.session = session
        return state

    def _restore_locked(
        self, state: ManagerState, cell: _Cell, names: Iterable[str] | None
    ) -> tuple[ManagerState, SessionState, int]:
        """Under the lock: ``state`` with the cell's parked objects (``names``, or all) restored, not yet
        installed; for a detached cell its copy is restored instead (and ``state`` returned as it was).
        Returns ``(state, session as restored, how many were restored)``."""
        in_table = self._in_table(state, cell)
        session = ms.lookup(state, cell.session_id) if in_table else cell.session
        wanted = None if names is None else set(names)
        todo = [n for n, o in session.objects.items() if o.parked and (wanted is None or n in wanted)]
        start = state
        try:
            for name in todo:
                if in_table:
                    state, _ = restore_object(state, cell.session_id, name)
                else:
                    cell.session = session = session.update(name, lambda o: o.restore())
        except BaseException:
            self._hand_back(start, state, cell.session_id)  # the reloads that succeeded before one failed
            raise
        if in_table:
            session = ms.lookup(state, cell.session_id)
        return state, session, len(todo)

    def _restore_parked(self, cell: _Cell, names: Iterable[str] | None = None) -> tuple[SessionState, int]:
        """Restore parked objects of the cell's session (``names``, or all of them): what a handle does when
        it meets a parked object. Returns the session as restored (read under the same lock, so no other
        thread parked anything again in between) and how many it restored (each counted in
        ``stats()["restores"]``).

        Raises:
          BudgetExceededError: the restored objects do not fit the budget; nothing changed.
        """
        with self._lock:
            state = self._state
            new, session, n = self._restore_locked(state, cell, names)
            if new is not state:
                try:
                    self._state = self._settle(state, new, cell.session_id, attrs_unchanged=True)
                except BaseException:
                    self._hand_back(state, new, cell.session_id)
                    raise
                session = ms.lookup(self._state, cell.session_id)
            return session, n

    def _write(
        self,
        cell: _Cell,
        what: str,
        op: Callable[[SessionState], tuple[SessionState, _Result]],
        names: Iterable[str] | None = None,
        *,
        table_op: Callable[[ManagerState], ManagerState] | None = None,
        attrs_unchanged: bool = False,
    ) -> _Result:
        """The one write path of handles: library code ``op`` applied to the cell's session under the lock.

        A parked object ``op`` meets is restored first (``names``, or every parked object), under the same
        lock, and the restores land only with the write: no other thread can park it again in between, and
        a refused write (bad input, the budget) leaves the table as it was, handing back any engine blocks
        a KV restore took. ``table_op`` is the same write on the table, when a faster pure function exists.

        Raises:
          SessionStateLostError: the session was dropped (the handle refuses writes, which would be lost).
        """
        if cell.uid in self._writing_set():
            self._check_not_reentrant(cell)
        with self._lock:
            if cell.closed:
                raise self._closed(cell, what)
            start = state = self._state
            try:
                while True:
                    try:
                        if self._in_table(state, cell):
                            if table_op is not None:
                                new, out = table_op(state), None
                            else:
                                session, out = op(ms.lookup(state, cell.session_id))
                                new = self._store(state, cell, session)
                            self._state = self._settle(start, new, cell.session_id, attrs_unchanged=attrs_unchanged)
                        else:
                            cell.session, out = op(cell.session)
                        return out  # type: ignore[return-value]
                    except ObjectParkedError:
                        state, _, restored = self._restore_locked(state, cell, names)
                        if not restored:
                            raise
            except BaseException:
                if state is not start:
                    self._hand_back(start, state, cell.session_id)
                raise

    def _commit(self, cell: _Cell, name: str, payload: Any) -> None:
        """`SessionHandle.commit`: the per-step write, one pure call under the lock."""
        self._write(
            cell,
            "commit",
            lambda s: (s.update(name, lambda obj: obj.commit(payload)), None),
            (name,),
            table_op=lambda state: ms.commit(state, cell.session_id, name, payload),
            attrs_unchanged=True,
        )

    def _transact(self, cell: _Cell, fn: Callable[[SessionState], tuple[SessionState, _Result]]) -> _Result:
        """Run user code ``fn`` on the cell's session outside the lock; swap its result in if the session is
        unchanged, else run it again on the newer session (compare and retry). The session is pinned
        meanwhile: the byte budget never releases a session inside a transaction."""
        self._check_not_reentrant(cell)
        if cell.closed:
            raise self._closed(cell, "transact")
        with self.pin(cell.session_id):
            return self._transact_pinned(cell, fn)

    def _transact_pinned(self, cell: _Cell, fn: Callable[[SessionState], tuple[SessionState, _Result]]) -> _Result:
        writing = self._writing_set()
        while True:
            current = self._read(cell)
            writing.add(cell.uid)
            try:
                new, out = fn(current)
            except ObjectParkedError:
                writing.discard(cell.uid)
                if self._restore_parked(cell)[1]:  # fn met a parked object: restore and run it again
                    continue
                raise
            finally:
                writing.discard(cell.uid)
            if not isinstance(new, SessionState):
                raise ms.InvalidTypeError(f"a transaction must return a SessionState, got {type(new).__name__}.")
            with self._lock:
                if cell.closed:
                    raise self._closed(cell, "transact")
                state = self._state
                latest = ms.lookup(state, cell.session_id) if self._in_table(state, cell) else cell.session
                if latest is current:
                    self._state = self._settle(state, self._store(state, cell, new), cell.session_id)
                    return out

    def _writing_set(self) -> set[int]:
        writing = getattr(self._writing, "uids", None)
        if writing is None:
            writing = self._writing.uids = set()
        return writing

    def _check_not_reentrant(self, cell: _Cell) -> None:
        if cell.uid in self._writing_set():
            raise ReentrantWriteError(
                f"session {cell.session_id!r}: a transaction function (or get_or_create factory) wrote to the "
                f"session it is computing a new state for. Return the new state from the function instead "
                f"(e.g. `s.set_attr(...)` on the SessionState it receives); reads through handles are fine."
            )


class SessionHandle:
    """The object API on one session incarnation. Obtain it from `SessionStateManager`.

    Write methods return the handle, so calls chain: ``h.put("x", buf).commit("x", item)``.
    """

    __slots__ = ("_cell", "_manager")

    def __init__(self, manager: SessionStateManager, cell: _Cell):
        self._manager = manager
        self._cell = cell

    @property
    def session_id(self) -> str:
        return self._cell.session_id

    @property
    def in_table(self) -> bool:
        """False once this incarnation was evicted or dropped from the manager's table."""
        return self._manager._in_table(self._manager._state, self._cell)

    @property
    def state(self) -> SessionState:
        """The session's current immutable `SessionState`."""
        return self._manager._read(self._cell)

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
        self._manager._transact(self._cell, lambda s: (fn(s), None))
        return self

    def update(self, name: str, fn: Callable[[StateObject], StateObject]) -> SessionHandle:
        """Replace object ``name`` by ``fn(object)`` in one step (several commits, one swap)."""
        return self.transact(lambda s: s.update(name, fn))

    # objects
    def get(self, name: str, default: Any = MISSING) -> Any:
        """The state object ``name`` (immutable snapshot); a parked object is restored first."""
        obj = self.state.get(name, default)
        if isinstance(obj, StateObject) and obj.parked:
            obj = self._manager._restore_parked(self._cell, [name])[0].get(name, default)
        return obj

    def park(self, name: str, *, with_sharers: bool = False) -> dict[str, int]:
        """Park object ``name`` in host memory; the next access through any handle restores it. Returns the
        bytes moved per pool (see `functional_state.park`)."""
        self._manager._check_not_reentrant(self._cell)
        if self.in_table:
            return self._manager.park(self.session_id, name, with_sharers=with_sharers)
        return self._manager._write(self._cell, "park", lambda s: (s.update(name, lambda o: o.park()), {}), ())

    def restore(self, name: str) -> dict[str, int]:
        """Restore a parked object now (handles also do it on first access). Returns the bytes moved per pool."""
        self._manager._check_not_reentrant(self._cell)
        if self.in_table:
            return self._manager.restore(self.session_id, name)
        return self._manager._write(self._cell, "restore", lambda s: (s.update(name, lambda o: o.restore()), {}), ())

    def put(self, name: str, obj: StateObject) -> SessionHandle:
        self._manager._write(self._cell, "put", lambda s: (s.put(name, obj), None))
        return self

    def remove(self, name: str) -> SessionHandle:
        """Remove object ``name`` (a no-op if absent)."""
        self._manager._write(self._cell, "remove", lambda s: (s.remove(name), None))
        return self

    def get_or_create(self, name: str, factory: Callable[[], ObjectT], cls: type[ObjectT] | None = None) -> ObjectT:
        """The object ``name``, built with ``factory`` when absent, of the wrong type or not resident.

        The factory runs outside the manager's lock (it may use the manager); if two threads race, one
        object wins and both get it. A parked object is restored, never rebuilt.
        """
        try:
            obj = self.state._reusable(name, cls)
        except ObjectParkedError:  # restored and read under one lock: no other thread parks it in between
            obj = self._manager._restore_parked(self._cell, [name])[0]._reusable(name, cls)
        if obj is not None:
            return obj
        return self._manager._transact(self._cell, lambda s: s.get_or_create(name, factory, cls))

    def stage(self, name: str, payload: Any) -> SessionHandle:
        self._manager._write(self._cell, "stage", lambda s: (s.update(name, lambda o: o.stage(payload)), None), (name,))
        return self

    def commit(self, name: str, payload: Any = MISSING) -> SessionHandle:
        self._manager._commit(self._cell, name, payload)
        return self

    def append(self, name: str, payload: Any) -> SessionHandle:
        return self.commit(name, payload)

    def discard(self, name: str) -> SessionHandle:
        self._manager._write(self._cell, "discard", lambda s: (s.update(name, lambda o: o.discard()), None), (name,))
        return self

    def view(self, name: str, include_staged: bool = True) -> Any:
        return self.get(name).view(include_staged=include_staged)

    def evict(self, name: str) -> int:
        """Release object ``name``'s committed storage; returns the bytes that left the session's accounting."""
        return self._manager._write(self._cell, "evict", lambda s: s.evict(name), (name,))

    def step(
        self, name: str, fn: Callable[..., StateObject], *args: Any, donate: bool = False, retained: Iterable[Any] = ()
    ) -> SessionHandle:
        """`SessionStateManager.step` on this session (which must be in the table)."""
        self._manager.step(self.session_id, name, fn, *args, donate=donate, retained=retained)
        return self

    # attrs
    def get_attr(self, key: str, default: Any = MISSING) -> Any:
        return self.state.get_attr(key, default)

    def set_attr(self, key: str, value: Any, *, on_fork: ForkPolicy | None = None) -> SessionHandle:
        self._manager._write(self._cell, "set_attr", lambda s: (s.set_attr(key, value, on_fork=on_fork), None))
        return self

    def del_attr(self, key: str) -> SessionHandle:
        self._manager._write(self._cell, "del_attr", lambda s: (s.del_attr(key), None))
        return self

    def reset(self) -> SessionHandle:
        """Reset every object and clear the attrs."""
        self._manager._write(self._cell, "reset", lambda s: (s.reset(), None))
        return self

    def nbytes_by_device(self) -> dict[str, int]:
        return self.state.nbytes_by_device()

    def __repr__(self) -> str:
        where = "in table" if self.in_table else "detached"
        return f"SessionHandle({self.session_id!r}, {where}, {self.state!r})"
