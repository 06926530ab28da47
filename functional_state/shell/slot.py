"""`Slot`: the shell's one mutable place, the installed `ManagerState`, and the writes installed in one step.

The manager and every handle share one `Slot`: a handle reads the table as ``slot.table`` (one attribute,
no call) and its common writes (a commit, a session-local verb, putting a factory's object) are installed
here under the lock in one acquisition, straight from the handle: no retry loop, no closures, no layers
between the handle and the pure verb. Each returns `NOT_INLINE` where it does not apply (the session left
the table, a transaction on it is being computed, an engine pool or the byte budget to consult); the
caller then takes the manager's retry loop, which decides everything these skip.

A lock-free read of a handle's session reads ``slot.table`` *before* it asks whether the cell left
(`Slot.held`): every install that removes a session detaches its cell first, so a table read before
``cell.left`` was seen None holds the cell's incarnation. The other order may read a table installed in
between. That is now harmless: no table the shell installs holds a number under another incarnation (a
loaded table is numbered on from the installed one's counter, `table.renumber`; a taken-back write,
`Writes.take_back`, reinstalls the older table with the counter the taken-back one reached,
`table.manager_state.with_issued`); the order stays, as a second line of defence that costs nothing.
"""

from __future__ import annotations

from _thread import get_ident
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .. import table as ms
from ..core.session import SessionState
from ..errors import ObjectParkedError
from ..table.manager_state import ManagerState, held_object, held_session
from .admission import LIVE_POOLS, LastPass, Recheck, Surplus, within_budget_fast, within_budget_in_place
from .cells import Cell

__all__ = ["LIVE_POOLS", "NOT_INLINE", "Slot"]

NOT_INLINE = object()  # a `Slot` write did not apply: take the manager's retry loop


class Slot:
    """The installed table (``table``) and what changes with it, under ``lock``.

    ``epoch`` changes with every install of the manager's retry loop (and `Writes.take_back`): a write is taken
    back only if none landed since, which the epoch and the table's identity tell together (the installs
    here always install a new table object, so they need not count it); ``surplus`` is
    the attr bound the budget's fast check starts from (`admit`), ``recheck`` what a budgeted commit
    following one of the same session re-reads (`Recheck`), ``last`` the last object check that passed
    (`LastPass`); ``budgeted``: the table has a byte
    budget. ``computing``: ``(thread, incarnation)`` for each transaction (or factory) being computed, in
    any thread; while it is empty no write can be a reentrant one, and the common write tests only that. A
    list, not a locked set: its append, remove and membership test are atomic, and it holds one entry per
    transaction in flight.
    """

    __slots__ = (
        "acquire",
        "budgeted",
        "computing",
        "epoch",
        "last",
        "lock",
        "recheck",
        "release",
        "surplus",
        "table",
    )

    def __init__(self, table: ManagerState, lock: AbstractContextManager[Any]):
        self.table = table
        self.lock = lock
        # The one-step installs take the lock through its bound methods (see BENCHMARKS.md, the shell's notes);
        # a lock without ``acquire`` is entered as a context.
        self.acquire, self.release = _lock_methods(lock)
        self.epoch = 0
        self.surplus: Surplus | None = None  # attr bytes (aliases of objects too), at the last full check
        self.budgeted = table.byte_budget is not None  # (changes only with an installed `load`)
        self.computing: list[tuple[int, int]] = []
        self.recheck = Recheck()  # what the next budgeted commit of the last session re-reads (see `Recheck`)
        self.last = LastPass()  # the last object check that passed (see `LastPass`)

    def writing(self, uid: int) -> bool:
        """Whether this thread is computing a transaction (or a factory's object) for incarnation ``uid``."""
        return bool(self.computing) and (get_ident(), uid) in self.computing

    def computed(self, uid: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, user code computing a new state for incarnation ``uid``: meanwhile `writing` is
        True for it in this thread (a write to it from inside is reentrant)."""
        entry = (get_ident(), uid)
        self.computing.append(entry)
        try:
            return fn(*args)
        finally:
            self.computing.remove(entry)  # (an equal entry: any of them)

    def held(self, cell: Cell) -> SessionState | None:
        """Without the lock: the cell's session as the installed table holds it, or None once it left."""
        table = self.table  # (first: see the module's docstring)
        return held_session(table, cell.session_id, cell.uid) if cell.left is None else None

    def commit(self, cell: Cell, name: str, payload: Any) -> Any:
        """`commit` of ``payload`` into object ``name`` of the cell's session, installed at once; None, or
        `NOT_INLINE`. The per-step write: one lock, one pure verb.

        Under the lock a cell that has not left names an incarnation the installed table holds (every install
        that removes a session detaches its cell first, `Cells`), so the table's own lookup by id finds it."""
        if self.computing and self.writing(cell.uid):
            return NOT_INLINE
        sid = cell.session_id
        self.acquire()
        try:
            if cell.left is not None or cell.closed or LIVE_POOLS:  # (a commit never makes an engine pool)
                return NOT_INLINE
            base = self.table
            try:
                after = ms.commit(base, sid, name, payload)
            except ObjectParkedError:  # its restore calls the engine: not under the lock
                return NOT_INLINE
            # (A commit changes sessions in place, `in_place`: it replaces one object of a session it found.)
            recheck = self.recheck
            if self.budgeted and (recheck.writer != sid or not recheck.within(base, after, sid, self.surplus)):
                again: list[Any] | None = [] if recheck.writer == sid else None  # (see `Recheck`)
                bound = within_budget_fast(base, after, sid, True, self.surplus, again, self.last)
                if bound is None:
                    return NOT_INLINE
                self.surplus = bound
                if again is None:
                    recheck.table, recheck.writer = None, sid
                else:
                    recheck.passed(after, sid, bound, again)
            self.table = after
            return None
        finally:
            self.release()

    def _within_budget(self, base: ManagerState, after: ManagerState, sid: str, attrs_unchanged: bool) -> bool:
        """Under the lock: whether ``after`` stays within the budget by the kept totals (`admit`'s first check;
        else the write takes `admit`), keeping the attr bound it leaves."""
        bound = within_budget_in_place(base, after, sid, self.surplus, attrs_unchanged, self.last)
        if bound is None:
            return False
        self.surplus = bound
        return True

    def inline(self, cell: Cell, verb: Callable[..., Any], args: tuple[Any, ...], kw: Any, same: bool) -> Any:
        """A session-local table verb ``verb(table, sid, *args, **kw)`` (replacing one session; no engine, no
        user code), installed at once where `admit` would only install it (no pools; within budget;
        ``same``: it never changes attrs). Its result, or `NOT_INLINE`."""
        if self.computing and self.writing(cell.uid):
            return NOT_INLINE
        sid = cell.session_id
        self.acquire()
        try:
            if cell.left is not None or cell.closed:  # (the cell's incarnation is in the table: see `commit`)
                return NOT_INLINE
            base = self.table
            try:
                out = verb(base, sid, *args, **kw) if kw else verb(base, sid, *args)
            except ObjectParkedError:
                return NOT_INLINE
            after, result = (out, None) if type(out) is ManagerState else out
            if after is base or LIVE_POOLS:
                return NOT_INLINE
            if self.budgeted and not self._within_budget(base, after, sid, same):
                return NOT_INLINE
            self.table = after
            return result
        finally:
            self.release()

    def put_absent(self, cell: Cell, name: str, obj: Any, seen: ManagerState | None = None) -> Any:
        """``obj`` put under ``name`` (`put`) if the cell's session still holds no usable object there, with
        no budget to consult: None once installed, else `NOT_INLINE` (another thread's object won meanwhile,
        or a parked one is there: the caller's transaction decides). ``seen``: a table in which the caller
        found the cell's session without the object (read before ``cell.left`` was seen None, `held`)."""
        sid = cell.session_id
        self.acquire()
        try:
            base = self.table
            # (`held_object` is None only for a session the table holds with no object ``name``; the cell's
            # ``left`` first: a left cell's number is no proof, see the module's docstring. A table is
            # immutable: while ``seen`` is still the installed one (as after a miss, when no other write
            # landed since), the answer found in it stands, so it is not asked again.)
            if (
                cell.left is not None
                or LIVE_POOLS
                or self.budgeted
                or (base is not seen and held_object(base, sid, cell.uid, name) is not None)
            ):
                return NOT_INLINE
            self.table = ms.put(base, sid, name, obj)
            return None
        finally:
            self.release()


def _lock_methods(lock: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(acquire, release)`` of ``lock``: its own, or entering and leaving it as a context manager."""
    acquire, release = getattr(lock, "acquire", None), getattr(lock, "release", None)
    if callable(acquire) and callable(release):
        return acquire, release
    enter, leave = lock.__enter__, lock.__exit__
    return enter, lambda: leave(None, None, None)
