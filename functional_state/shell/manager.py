"""`SessionStateManager`: a thread-safe imperative shell over the pure `ManagerState` functions.

The shell holds one immutable `ManagerState` and swaps it under a lock, nothing more. Every write that is
not installed in one step (a hit, a miss, a handle's commit or session-local verb within budget: `slot`)
goes through the one retry loop (`writes`): the new table is computed *outside* the lock and installed under
it if the table did not change meanwhile. Handles: `handle`; the installed table, and the writes a handle
installs in one step, live in the `Slot` they share (`slot`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import table as ms
from ..core.session import SessionState
from ..persist import checkpoint as _ckpt
from ..policy.planner import LEVERS
from ..table.lru import get_or_insert
from ..table.manager_state import ManagerState
from ..table.parked import park as park_object
from ..table.parked import restore as restore_object
from ..table.renumber import continued
from ..table.step import step as pure_step
from ..table.step import trace as trace_step
from ..table.usage import stats as table_stats
from .admission import checked_levers
from .cells import Cell, Cells, Undo
from .handle import SessionHandle
from .hints import manager_attribute_error
from .pins import Pins
from .session_ops import ReentrantWriteError, SessionOps, check_incarnation, locked_step
from .slot import Slot
from .spill import SpillCallback, checked_spill
from .writes import INSERT, STEP, Write, Writes

__all__ = ["ReentrantWriteError", "SessionHandle", "SessionStateManager"]


_LoadPlan = Callable[[ManagerState], tuple[ManagerState, None]]
_Dropped = Callable[[ManagerState], dict[str, str]]


def _session_load(
    current: ManagerState, session_id: str | None, path: Any, as_id: str | None, replace: bool, **read: Any
) -> tuple[str, SessionState, _LoadPlan, _Dropped]:
    """Read session ``session_id`` (refused first if its target id is taken); returns ``(target id, the
    session read, the plan installing it, the sessions it replaces)``."""
    target = ms.resolve_session_id(as_id if as_id is not None else session_id)
    _ckpt.check_free(current, target, replace)  # fail before reading the checkpoint
    session = _ckpt.read_session(session_id, path, **read)

    def plan(state: ManagerState) -> tuple[ManagerState, None]:
        _ckpt.check_free(state, target, replace)
        return _ckpt.install_session(state, target, session, replace=replace), None

    replaced = {target: "dropped (replaced by `load_session(..., replace=True)`)"}
    return target, session, plan, lambda state: replaced


def _table_load(path: Any, **read: Any) -> tuple[ManagerState, _LoadPlan, _Dropped]:
    """Read a whole table; returns ``(table, the plan installing it, the sessions it replaces)``.

    The plan installs the table read with its incarnations numbered on from the replaced table's
    (`continued`): a number the shell issued once (a handle's cell holds it) is never issued again."""
    table = _ckpt.load(path, **read)

    def replaced(state: ManagerState) -> dict[str, str]:
        return dict.fromkeys(state.session_ids, "dropped (the table was replaced by `load`)")

    return table, lambda state: (continued(table, state.issued), None), replaced


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
        spill: SpillCallback | None = None,
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
          spill: ``spill(table, session_id) -> bool``, offered each session the budget would drop, outside the
            lock, with a table holding it: True once it has it elsewhere (a peer replica, the object store:
            `functional_state.transfer.export_session`). A spilled session leaves the table without counting as
            an eviction, and its handles refuse writes. A spill that raises (logged) or declines leaves its
            session in place, dropped only if the budget cannot be met otherwise. See `shell.spill`.
        """
        self._slot = slot = Slot(ManagerState.create(max_sessions, byte_budget, evict_when_full), lock_factory())
        self._pins = Pins(slot.lock)  # sessions the budget must not touch (requests in flight)
        self._cells = Cells()
        self._live = self._cells.handles  # (read on every hit)
        self._writes = Writes(slot, self._pins, self._cells, checked_levers(release_levers), checked_spill(spill))
        self._run = self._writes.run  # the one retry loop
        self._published: weakref.WeakSet[ManagerState] = weakref.WeakSet()
        self._ops = SessionOps(slot, self._run, self.pin, self.step)
        self._make_handle: Callable[[Cell], SessionHandle] = partial(SessionHandle, self._ops)

    # --- the immutable value and the one retry loop ------------------------------------------------
    @property
    def state(self) -> ManagerState:
        """The current immutable `ManagerState` (a snapshot: later calls never change it)."""
        state = self._slot.table
        self._published.add(state)  # `step` never donates a buffer a snapshot handed out may still read
        return state

    def __bool__(self) -> bool:
        return True  # an empty manager is still a manager

    if not TYPE_CHECKING:  # (hidden from type checkers, which would otherwise accept any attribute)

        def __getattr__(self, name: str) -> Any:
            raise manager_attribute_error(self, name)

    def pin(self, session_id: str | None) -> AbstractContextManager[None]:
        """Protect a session from the byte budget while the block runs (a request in flight): its objects are
        never parked, evicted or dropped to make room. Pins nest.

        Example:
          >>> manager = SessionStateManager(byte_budget="1GiB")
          >>> with manager.pin("req-1"):
          ...     _ = manager.get_or_create_session("req-1")
        """
        return self._pins.pin(ms.resolve_session_id(session_id))

    def _new_handle(
        self, sid: str, state: ManagerState, undo: Undo | None, uid: int | None = None, created: bool = False
    ) -> SessionHandle:
        """A handle on ``sid`` in the installed ``state`` (with ``partial``, a ``then`` for `_run`; ``uid``: its
        incarnation, where the caller has it; ``created``: a session this very call inserted, `Cells.handle`)."""
        return self._cells.handle(state, sid, undo, self._make_handle, uid, created)

    def get_or_create_session(self, session_id: str | None = None) -> SessionHandle:
        """A handle on session ``session_id`` (None means ``"default"``), created on a miss.

        Raises:
          SessionAdmissionError: the table is full and ``evict_when_full=False``.
        """
        sid = session_id if type(session_id) is str and session_id else ms.resolve_session_id(session_id)
        slot = self._slot
        slot.acquire()  # (not `with`: see `Slot`)
        try:
            state = slot.table
            after, uid, evicted = get_or_insert(state, sid)
            if evicted is None:  # a hit, the common case: it adds no bytes and releases nothing
                slot.table = after
                ref = self._live.get(uid)  # (weak: an idle session keeps no handle)
                handle = None if ref is None else ref()
                return self._new_handle(sid, after, None, uid) if handle is None else handle
            # A miss inserts an empty session, which adds no bytes: its admission runs no user code, so it is
            # decided and installed here, in one acquisition; the blocks it releases go back after.
            decision = self._writes.admit(state, after, sid, self._pins.pinned, None, INSERT, evicted=evicted)
            undo, epoch = self._writes.install(decision), slot.epoch
            # (journaled only when blocks were released: only a failed ``free`` of them takes a write back)
            handle = self._new_handle(sid, decision.final, undo if decision.released else None, uid, True)
        finally:
            slot.release()
        self._writes.settle(state, decision, undo, epoch)
        return handle

    def get_session(self, session_id: str | None = None) -> SessionHandle:
        """A handle on an existing session, for continuations.

        Raises:
          SessionStateLostError: the session is unknown, evicted or dropped (the message says which, for a
            session this manager saw leave); nothing is created.
        """
        sid = ms.resolve_session_id(session_id)
        slot = self._slot
        slot.acquire()  # (not `with`: see `Slot`)
        try:
            state = slot.table
            if sid in state:  # a hit, the common case: a touch, which adds no bytes (`get_or_create_session`'s)
                after, uid, _ = get_or_insert(state, sid)
                slot.table = after
                ref = self._live.get(uid)  # (weak: an idle session keeps no handle)
                handle = None if ref is None else ref()
                return self._new_handle(sid, after, None, uid) if handle is None else handle
        finally:
            slot.release()

        def plan(state: ManagerState) -> tuple[ManagerState, None]:  # absent (or gone since): says why
            self._cells.require(state, sid, "get_session")
            return ms.get_session(state, sid)[0], None

        return self._run(plan, Write(then=partial(self._new_handle, sid)))

    def fork_session(self, source_id: str | None, new_id: str | None) -> SessionHandle:
        """Fork a session (see `functional_state.fork_session`); returns a handle on the fork.

        Raises:
          SessionStateLostError, SessionExistsError, SessionAdmissionError: as the pure function; the
            table is unchanged then.
        """
        nid = ms.resolve_session_id(new_id)

        def plan(state: ManagerState) -> tuple[ManagerState, None]:
            if source_id is None or isinstance(source_id, str):
                self._cells.require(state, ms.resolve_session_id(source_id), "fork_session")
            return ms.fork_session(state, source_id, nid), None

        return self._run(plan, Write(nid, then=partial(self._new_handle, nid)))

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
        target, session, plan, dropped = _session_load(
            self._slot.table, session_id, path, as_id, replace, placement=placement, torch_device=torch_device, **hooks
        )
        return self._installing([session], plan, Write(target, dropped=dropped, then=partial(self._new_handle, target)))

    def load(self, path: Any, *, placement: Any = None, torch_device: Any = None, **hooks: Any) -> None:
        """Replace the whole table by the one a `save` wrote (its sessions, recency, counters, config). Handles
        on the sessions it replaces keep their own copies, as after a drop."""
        table, plan, dropped = _table_load(path, placement=placement, torch_device=torch_device, **hooks)
        self._installing(ms.sessions(table).values(), plan, Write(dropped=dropped))

    def install_session(self, session_id: str, session: Any) -> SessionHandle:
        """Install a `SessionState` read elsewhere (`transfer.read_blob`) under the free id ``session_id``."""
        plan = partial(_ckpt.install_session, sid=session_id, session=session)
        then = partial(self._new_handle, session_id)
        return self._installing([session], lambda s: (plan(s), None), Write(session_id, then=then))

    def _installing(self, sessions: Any, plan: Any, write: Write) -> Any:
        """`_run` ``plan``, which installs ``sessions``; if it is not, their engine KV blocks go back."""
        try:
            return self._run(plan, write)
        except BaseException as e:
            _ckpt.release_sessions(sessions, e)
            raise

    def drop_session(self, session_id: str | None) -> bool:
        """Remove a session from the table; True if it was there. Live handles keep their last state to
        read, and refuse writes (which could reach no session): `SessionStateLostError`."""
        sid = ms.resolve_session_id(session_id)
        why = {sid: "dropped (`drop_session`)"}
        return bool(self._run(lambda s: ms.drop_session(s, sid), Write(dropped=lambda s: why)))

    def raise_max_sessions(self, n: int) -> None:
        """Raise the count cap (see `functional_state.raise_max_sessions`)."""
        self._run(lambda state: (ms.raise_max_sessions(state, n), None))

    def stats(self, *, exact: bool = False) -> dict[str, Any]:
        """Counters and per-pool bytes of the current state (see `functional_state.stats`)."""
        return table_stats(self._slot.table, exact=exact)

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes per device held by all sessions in the table, each allocation once."""
        return {k[len("nbytes:") :]: v for k, v in self.stats().items() if k.startswith("nbytes:")}

    def step(
        self,
        session_id: str | None,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        donate: bool = False,
        retained: Iterable[Any] = (),
        incarnation: int | None = None,
    ) -> None:
        """Run ``jax.jit(fn)(object, *args)`` on object ``name`` and store the result (see
        `functional_state.step`). With ``donate=True`` a buffer is donated only if no other session, fork,
        snapshot this manager handed out (``.state``), detached handle or value in ``retained`` still
        references it; otherwise it is copied first. An object or array you took out (``handle.get``) and
        still read is yours, as with `functional_state.step`: pass it in ``retained``. ``fn`` is traced
        outside the lock (user code); the compiled call runs under it, since a donating step consumes the
        table it reads. Under a byte budget a step that changes the object's shapes or dtypes is not
        donated: the budget could refuse its result after the donation had consumed the table.
        ``incarnation``: step only that incarnation of the session (`SessionStateLostError` if another is there,
        decided under the lock the step installs with): what a handle's `SessionHandle.step` passes.
        """
        sid = ms.resolve_session_id(session_id)
        kept = list(retained)
        traced = state = self._slot.table
        self._cells.require(state, sid, "step")
        self._ops.refuse_reentrant(state, sid, "step")
        if self._writes.spill is not None and state.byte_budget is not None:
            # The budget may drop sessions, which are offered to the spill outside the lock: the step is not
            # donated and installs through the retry loop.
            def plan(table: ManagerState) -> tuple[ManagerState, None]:
                self._cells.require(table, sid, "step")
                check_incarnation(table, sid, incarnation)
                return pure_step(table, sid, name, fn, *args, donate=False), None

            return self._run(plan, STEP._replace(writer=sid))
        keeps_bytes = trace_step(traced, sid, name, fn, *args, donate=donate)  # the first trace, outside the lock
        with self._slot.lock:
            state = self._slot.table
            self._cells.require(state, sid, "step")
            check_incarnation(state, sid, incarnation)
            others = lambda: [*(c.session for c in self._cells.detached()), *kept]
            after = locked_step(state, traced, keeps_bytes, self._published, others, (sid, name, fn, args, donate))
            self._writes.install(self._writes.admit(state, after, sid, self._pins.pinned, None, STEP))

    def park(
        self, session_id: str | None, name: str, *, with_sharers: bool = False, copy: bool = False
    ) -> dict[str, int]:
        """Park object ``name`` of a session in host memory (see `functional_state.park`: on a CPU device a
        storage nothing else holds is taken, not copied, unless ``copy``); returns the bytes moved per pool.
        Handles restore it on their next access.

        Under a byte budget the session parked is the writer: a host pool the park would leave over its
        budget may release other sessions, never this one.

        Raises:
          BudgetExceededError: the host copy does not fit even so; nothing changed.
        """
        sid = ms.resolve_session_id(session_id)
        plan = self._by_id("park", lambda s: park_object(s, sid, name, with_sharers=with_sharers, copy=copy), sid)
        return self._run(plan, Write(sid, local=not with_sharers))  # (with its sharers: other sessions too)

    def restore(self, session_id: str | None, name: str) -> dict[str, int]:
        """Restore a parked object (see `functional_state.restore`); returns the bytes moved per pool.

        Raises:
          BudgetExceededError: the restored object does not fit the budget; nothing changed (engine blocks a
            KV ``reload`` took go back, and the object stays parked, restorable later).
        """
        sid = ms.resolve_session_id(session_id)
        plan = self._by_id("restore", lambda s: restore_object(s, sid, name), sid)
        return self._run(plan, Write(sid, acquires=True, local=True))

    def _by_id(self, what: str, verb: Callable[[ManagerState], Any], sid: str) -> Callable[[ManagerState], Any]:
        """A plan running ``verb(table)`` on session ``sid`` named by id, refusing a session this manager saw
        leave (`Cells.require`) and a write from inside a transaction on it."""

        def plan(table: ManagerState) -> Any:
            self._cells.require(table, sid, what)
            self._ops.refuse_reentrant(table, sid, what)
            return verb(table)

        return plan

    def __len__(self) -> int:
        return len(self._slot.table)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._slot.table

    def __repr__(self) -> str:
        return f"SessionStateManager({self._slot.table!r})"
