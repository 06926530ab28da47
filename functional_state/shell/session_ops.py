"""What a `SessionHandle` asks of its manager: the table's own verbs, applied to its session wherever it is.

A handle's session is in the manager's table, or (once evicted or dropped) a copy the handle keeps. Either
way a write is the same pure table verb (`commit`, `park`, `set_attr` ...): on the table, or on a table of
just the copy, so refusals, returned values and counters are decided once, by the table. Every write goes
through the manager's one retry loop; user code (a ``transact`` function) runs outside its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .. import table as ms
from ..core.session import SessionState
from ..errors import InvalidTypeError, ObjectParkedError, SessionStateError, SessionStateLostError
from ..table.manager_state import ManagerState
from ..table.session_edits import update_session
from ..table.step import step as pure_step
from .cells import Cell, Undo, in_table
from .slot import NOT_INLINE, Slot
from .writes import Write, restore_parked, restoring

__all__ = ["ReentrantWriteError", "SessionOps", "check_incarnation", "locked_step"]

Verb = Callable[..., Any]  # a table verb: (table, session id, *args) -> table or (table, result)


class ReentrantWriteError(SessionStateError, RuntimeError):
    """A ``transact`` function (or a factory) wrote to the very session it is computing a new state for."""


def _pair(out: Any) -> tuple[ManagerState, Any]:
    return (out, None) if isinstance(out, ManagerState) else out


def _alone(cell: Cell) -> ManagerState:
    """A table of just the cell's copy: where a detached handle's writes run the table's verbs."""
    table, _ = ms.get_or_create(ManagerState.create(1), cell.session_id)
    return update_session(table, cell.session_id, lambda _: cell.session)


def _on_copy(cell: Cell, names: Iterable[str] | None, fn: Callable[[ManagerState], tuple[ManagerState, Any]]) -> Any:
    """``fn`` on a table of the cell's copy, restoring a parked object it meets first; returns
    ``(new copy, result)``."""
    _, table, out = restoring(fn, _alone(cell), cell.session_id, names)
    return ms.lookup(table, cell.session_id), out


def check_incarnation(state: ManagerState, sid: str, incarnation: int | None) -> None:
    """Refuse a `step` of session ``sid`` whose table holds another incarnation than ``incarnation`` (a
    handle's; None: any)."""
    if incarnation is not None and ms.incarnation(state, sid) != incarnation:
        raise SessionStateLostError(
            f"`step`: session {sid!r} in the table is a later incarnation than the handle's; the handle's "
            f"session left the table, so the step is refused. Get a handle on the session again."
        )


def locked_step(
    state: ManagerState,
    traced: ManagerState,
    keeps_bytes: bool,
    published: Any,
    others: Callable[[], list[Any]],
    call: Any,
) -> ManagerState:
    """Under the shell's lock: the table after the pure `step` ``call = (sid, name, fn, args, donate)`` on
    ``state`` (the installed table; ``traced``: the one its first trace ran on, finding ``keeps_bytes``).
    Donates only when nothing but the shell holds ``state``; ``published`` snapshots and ``others`` (detached
    handles' sessions, what the caller retained; built only to donate) keep every buffer they may still read."""
    sid, name, fn, args, donate = call
    # A refused result must leave the table as it was, which a donation would have consumed: under a
    # budget, donate only a step that keeps the object's bytes (checked on this very table).
    may_refuse = state.byte_budget is not None and not (keeps_bytes and state is traced)
    if state in published or may_refuse:
        # A caller holds this table, or the budget may refuse the result: donate nothing, keep it usable.
        return pure_step(state, sid, name, fn, *args, donate=False)
    # Other snapshots handed out and detached handles may still read this table's buffers. The donating
    # step consumes `state`, which only this shell held.
    return pure_step(state, sid, name, fn, *args, donate=donate, retained=[*published, *others()])


_NO_KW: dict[str, Any] = {}  # (never written)


def _replace(state: ManagerState, sid: str, old: SessionState, new: SessionState) -> ManagerState:
    """``state`` with session ``sid`` replaced by ``new`` if it still is ``old``, else ``state`` itself."""
    return update_session(state, sid, lambda _: new) if ms.lookup(state, sid) is old else state


class SessionOps:
    """The manager's side of its handles (made by `SessionStateManager`, one per manager).

    Args:
      slot: the manager's `Slot` (its installed table, lock and one-step installs).
      run: the manager's retry loop (`Writes.run`).
      pin: protects a session from the byte budget while a transaction runs.
      step: the manager's `SessionStateManager.step`.
    """

    def __init__(self, slot: Slot, run: Callable[..., Any], pin: Callable[[str], Any], step: Callable[..., None]):
        self.slot = slot
        self._run, self._pin, self._step = run, pin, step

    in_table = staticmethod(in_table)

    def read_table(self) -> ManagerState:
        return self.slot.table

    def step(
        self, cell: Cell, name: str, fn: Callable[..., Any], *args: Any, donate: bool = False, retained: Any = ()
    ) -> None:
        self._step(cell.session_id, name, fn, *args, donate=donate, retained=retained, incarnation=cell.uid)

    def read(self, cell: Cell) -> SessionState:
        """The cell's session now: one atomic read of the table, or the handle's copy."""
        held = self.slot.held(cell)
        return cell.session if held is None else held

    def apply(
        self,
        cell: Cell,
        what: str,
        verb: Verb,
        *args: Any,
        names: Iterable[str] | None = None,
        attrs_unchanged: bool = False,
        acquires: bool = False,
        inline: bool = False,
        table_only: bool = False,
        **kw: Any,
    ) -> Any:
        """Table verb ``verb(table, session id, *args, **kw)`` on the cell's session, in the table or on its copy.

        A parked object the verb meets is restored first (``names``, or every parked object), in the same
        install: no other thread can park it again in between, and a refused write leaves everything as it
        was (engine blocks a KV restore took go back).

        ``table_only``: refuse (`left_error`) rather than write the handle's copy once the session left the table.

        Raises:
          SessionStateLostError: the session was dropped (the handle refuses writes, which would be lost).
        """
        sid, uid = cell.session_id, cell.uid
        if inline:
            done = self.slot.inline(cell, verb, args, kw, attrs_unchanged)  # the common write: one lock, no closures
            if done is not NOT_INLINE:
                return done
        copy: list[SessionState] = []

        def plan(base: ManagerState) -> tuple[ManagerState, Any]:
            if cell.closed or self.slot.writing(uid):  # each attempt: a drop may land meanwhile
                self.check_writable(cell, what)
            if cell.left is None and ms.held_session(base, sid, uid) is not None:
                out = verb(base, sid, *args, **kw)
                return (out, None) if type(out) is ManagerState else out
            if table_only:  # (decided on the table this attempt installs on: a later eviction retries it)
                raise self.left_error(cell, what)
            new, out = _on_copy(cell, names, lambda t: _pair(verb(t, sid, *args, **kw)))
            copy[:] = [new]
            return base, out

        local = not kw.get("with_sharers")  # (a park with its sharers writes other sessions too)
        keep = self._keep(cell, copy)
        write = Write(sid, cell, names, acquires, then=keep, local=local, attrs_unchanged=attrs_unchanged)
        return self._run(plan, write)

    def restored(self, cell: Cell, names: Iterable[str] | None, *, table_only: bool = False) -> SessionState:
        """The cell's session with its parked objects (``names``, or all) restored and installed; read under
        the same lock as the install, so no other thread parked one again in between. ``table_only`` as for
        `apply`."""
        copy: list[SessionState] = []

        def plan(base: ManagerState) -> tuple[ManagerState, None]:
            if self.in_table(base, cell):
                return restore_parked(base, cell.session_id, names), None
            if table_only:  # (decided on the table this attempt installs on)
                raise self.left_error(cell, "get")
            copy[:] = [_on_copy(cell, names, lambda t: (restore_parked(t, cell.session_id, names), None))[0]]
            return base, None

        keep = self._keep(cell, copy)
        then = lambda state, undo: keep(state, undo) or self.read(cell)
        return self._run(plan, Write(cell.session_id, cell, acquires=True, then=then, local=True, attrs_unchanged=True))

    def transact(
        self, cell: Cell, fn: Callable[[SessionState], tuple[SessionState, Any]], *, table_only: bool = False
    ) -> Any:
        """User code ``fn`` on the cell's session, outside the lock, its new session installed by the retry
        loop; ``fn`` runs again only if its session changed meanwhile. The session is pinned meanwhile: the
        byte budget never releases a session inside a transaction. ``table_only`` as for `apply`."""
        self.check_writable(cell, "transact")
        sid, seen, copy = cell.session_id, list[Any](), list[SessionState]()

        def run_fn(session: SessionState) -> tuple[SessionState, Any]:
            if not seen or seen[0] is not session:
                new, out = self._computed(cell, fn, session)
                if not isinstance(new, SessionState):
                    raise InvalidTypeError(f"a transaction must return a SessionState, got {type(new).__name__}.")
                seen[:] = [session, new, out]
            return seen[1], seen[2]

        def plan(base: ManagerState) -> tuple[ManagerState, Any]:
            if cell.closed:
                self.check_writable(cell, "transact")
            if self.in_table(base, cell):
                new, out = run_fn(ms.lookup(base, sid))
                return update_session(base, sid, lambda _: new), out
            if table_only:  # (decided on the table this attempt installs on)
                raise self.left_error(cell, "transact")
            new, out = _on_copy(cell, None, lambda t: (t, run_fn(ms.lookup(t, sid))))
            copy[:] = [out[0]]
            return base, out[1]

        write = Write(sid, cell, then=self._keep(cell, copy), local=True)
        if cell.left is None and not self.slot.budgeted:
            # No budget: nothing to pin against. The common transaction runs ``fn`` on the session read
            # without the lock and installs the result under it if the session did not change meanwhile.
            session = self.read(cell)
            try:
                new, out = run_fn(session)
            except ObjectParkedError:
                new = None  # the retry loop restores what ``fn`` met, and runs it again
            if new is not None and self.slot.inline(cell, _replace, (session, new), _NO_KW, False) is not NOT_INLINE:
                return out
            return self._run(plan, write)
        with self._pin(sid):
            return self._run(plan, write)

    def create(
        self,
        cell: Cell,
        name: str,
        factory: Callable[[], Any],
        cls: type[Any] | None,
        *,
        table_only: bool = False,
        seen: ManagerState | None = None,
    ) -> Any:
        """`SessionHandle.get_or_create` once the object was found absent (in table ``seen``, if given):
        ``factory`` runs outside the lock and its object is put under it if the session still lacks one;
        else (another thread's object won, a budget to consult, a detached handle) the transaction puts it,
        or returns the winner."""
        slot = self.slot
        if cell.left is None and not slot.budgeted:
            if cell.closed or (slot.computing and slot.writing(cell.uid)):
                self.check_writable(cell, "transact")
            built = slot.computed(cell.uid, factory)
            # (A factory's object of the wrong class: the transaction refuses it, with `get_or_create`'s error.)
            if (cls is None or isinstance(built, cls)) and slot.put_absent(cell, name, built, seen) is not NOT_INLINE:
                return built
            factory = lambda: built  # (built once: the transaction reuses it)
        return self.transact(cell, lambda s: s.get_or_create(name, factory, cls), table_only=table_only)

    def _computed(self, cell: Cell, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``: user code computing a new state for the cell's session (a write to that session
        from inside it is refused, `check_not_reentrant`)."""
        return self.slot.computed(cell.uid, fn, *args)

    def _keep(self, cell: Cell, copy: list[SessionState]) -> Callable[[ManagerState, Undo], Any]:
        """A ``then``: under the lock, the new copy of a detached handle replaces the old (journaled)."""

        def keep(state: ManagerState, undo: Undo) -> None:
            if copy:
                old = cell.session
                cell.session = copy[0]
                undo.append(lambda: setattr(cell, "session", old))

        return keep

    def check_writable(self, cell: Cell, what: str) -> None:
        """Refuse a write through a dropped handle, or one from inside a transaction on the same session."""
        self.check_not_reentrant(cell)
        if cell.closed:
            raise SessionStateLostError(
                f"`{what}`: session {cell.session_id!r} was {cell.left}; this handle is detached from the manager "
                f"and a write through it would reach no session, so it is refused. Its last state is still "
                f"readable (`handle.state`); start a new session with `get_or_create_session`."
            )

    @staticmethod
    def left_error(cell: Cell, what: str) -> SessionStateLostError:
        """The error for a table-only read or write (`SessionHandle.held`) through a handle whose incarnation left."""
        return SessionStateLostError(
            f"`SessionHandle.{what}`: session {cell.session_id!r} was {cell.left or 'replaced in the table'}; "
            f"this handle is detached, and `{what}` reads and writes only the manager's table (`handle.state` still "
            f"reads its last state). Get a handle on the session again (`get_or_create_session`)."
        )

    def check_not_reentrant(self, cell: Cell) -> None:
        if self.slot.writing(cell.uid):
            raise ReentrantWriteError(
                f"session {cell.session_id!r}: a transaction function (or get_or_create factory) wrote to the "
                f"session it is computing a new state for. Return the new state from the function instead "
                f"(e.g. `s.set_attr(...)` on the SessionState it receives); reads through handles are fine."
            )

    def refuse_reentrant(self, state: ManagerState, sid: str, what: str) -> None:
        uid = ms.incarnation(state, sid)
        if uid is not None and self.slot.writing(uid):
            raise ReentrantWriteError(f"session {sid!r}: `{what}` inside a transaction on the same session.")
