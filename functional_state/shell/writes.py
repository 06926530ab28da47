"""The shell's one write path: every write not installed in one step (`slot`) goes through `Writes.run`.

The new table (the pure verb, user code, the engine's ``offload``/``reload``, the byte budget's decision, the
spill callback: `spill`) is computed *outside* the lock and installed under it if the table did not change
meanwhile, else computed again; the blocks it released go back to their engines after the lock is released
(`Debts`: an engine ``free`` that raises takes the write back, or leaves a debt paid later; `hand_back`: the
blocks of an attempt that is not installed). A write's options are one record, `Write`; a parked object a plan meets is restored first, by
`restoring`, in the same attempt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, NamedTuple, TypeVar

from .. import table as ms
from ..errors import KVFreeError, ObjectParkedError
from ..table.engine_blocks import free_acquired, free_released
from ..table.manager_state import ManagerState, with_issued
from ..table.parked import restore as restore_object
from .admission import Decision, admit, rebase
from .cells import Cell, Cells, Undo, in_table
from .pins import Pins
from .slot import Slot
from .spill import SpillCallback, Spills

__all__ = ["INSERT", "PLAIN", "STEP", "Debts", "Write", "Writes", "hand_back", "restore_parked", "restoring"]

_log = logging.getLogger("functional_state")


def hand_back(base: ManagerState, grabbed: ManagerState) -> None:
    """The engine blocks the library took for ``grabbed`` (a restore's ``reload``), which will not be
    installed, go back (`free_acquired`); the parked copies in ``base`` stay restorable. A failing ``free``
    is logged: the caller is already raising the reason the change was refused."""
    if grabbed is not base:
        try:
            free_acquired(base, grabbed)
        except KVFreeError:
            _log.warning("a refused restore could not hand its reloaded blocks back", exc_info=True)


class Debts:
    """Installed changes whose blocks an engine did not take back yet; each retry frees only what is still
    owed (`free_released` keeps that per pool). Its own small lock guards only the list: no callback runs
    under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owed: list[tuple[ManagerState, ManagerState]] = []  # (read without the lock: truthiness only)

    def settle(
        self, before: ManagerState, after: ManagerState, released: object, take_back: Callable[[], bool]
    ) -> None:
        """Outside the lock, after installing ``before`` -> ``after``: pay earlier debts, then hand the blocks
        it ``released`` back to their engines, each once. If an engine's ``free`` raises, ``take_back()``
        reinstalls ``before`` when nothing was built on the change (then `KVFreeError` propagates: a retry
        frees only what is still owed); otherwise the change stays and its blocks become a debt."""
        if self.owed:
            self.pay()
        if not released:
            return
        try:
            free_released(before, after)
        except KVFreeError:
            if take_back():
                raise
            self.owe(before, after)

    def owe(self, before: ManagerState, after: ManagerState) -> None:
        """Free what ``before`` -> ``after`` released, keeping the change as a debt if an engine refuses."""
        try:
            free_released(before, after)
        except KVFreeError:
            _log.warning("an installed change could not hand its engine blocks back yet; retried later", exc_info=True)
            with self._lock:
                self.owed.append((before, after))

    def pay(self) -> None:
        """Retry every debt (outside any lock)."""
        with self._lock:
            owed, self.owed = self.owed, []
        for before, after in owed:
            self.owe(before, after)


_Result = TypeVar("_Result")
Plan = Callable[[ManagerState], tuple[ManagerState, _Result]]


def restore_parked(state: ManagerState, cell: Cell | str | None, names: Iterable[str] | None) -> ManagerState:
    """``state`` with the parked objects (``names``, or all) of ``cell``'s session restored, if the table holds
    it (a cell, or a session id): what a handle does when it meets a parked object. The engine blocks a KV
    ``reload`` takes are the library's (see `free_acquired`)."""
    if (isinstance(cell, Cell) and not in_table(state, cell)) or cell is None:
        return state
    sid = cell.session_id if isinstance(cell, Cell) else cell
    session = ms.lookup(state, sid)
    wanted = None if names is None else set(names)
    for name, obj in session.objects.items():
        if obj.parked and (wanted is None or name in wanted):
            state, _ = restore_object(state, sid, name)
    return state


def restoring(
    plan: Callable[[ManagerState], tuple[ManagerState, Any]],
    table: ManagerState,
    where: Cell | str | None,
    names: Iterable[str] | None,
) -> tuple[ManagerState, ManagerState, Any]:
    """``plan(table)``, restoring first each parked object it meets (of ``where``'s session: `restore_parked`)
    and running it again; returns ``(table with the restores made, plan's new table, plan's result)``.

    A parked object it cannot restore (another session's, or ``where`` None) raises `ObjectParkedError`. If
    ``plan`` raises, the engine blocks the restores took go back (`hand_back`) and the error propagates."""
    work = table
    try:
        while True:
            try:
                after, out = plan(work)
                return work, after, out
            except ObjectParkedError:
                restored = restore_parked(work, where, names)
                if restored is work:
                    raise
                work = restored
    except BaseException:
        hand_back(table, work)
        raise


class Write(NamedTuple):
    """How the manager's retry loop (`Writes.run`) installs one write: its options, each with
    the default a plain table write takes."""

    writer: str | None = None  # the session written: never released to make room, rebased by ``local``
    cell: Cell | None = None  # a handle's cell: its parked objects are restored when met; its copy must not change
    names: Iterable[str] | None = None  # which parked objects of ``cell``'s session to restore (None: any met)
    acquires: bool = False  # the plan takes engine blocks (a restore): they go back if it is not installed
    dropped: Callable[[ManagerState], Mapping[str, str]] | None = None  # ids the plan removes on request, and why
    then: Callable[[ManagerState, Undo], Any] | None = None  # under the lock after the install; its result wins
    local: bool = False  # the plan changes only ``writer``'s session: replayed onto other sessions' writes
    attrs_unchanged: bool = False  # the plan sets no attr (a commit): the budget's fast check reads less
    budget: bool = True  # False: the plan adds no bytes (an empty session inserted); the budget is not checked


PLAIN = Write()  # a table write with every default
INSERT = Write(budget=False)  # a miss: an empty session inserted adds no bytes
STEP = Write(attrs_unchanged=True)  # a step changes one object's arrays, never an attr


class Writes:
    """One manager's retry loop and what it installs with: its `Slot`, `Pins`, `Cells`, the debts of engine
    frees that failed (`Debts`), the budget's release levers and the spill callback (None: none)."""

    def __init__(
        self, slot: Slot, pins: Pins, cells: Cells, levers: tuple[str, ...], spill: SpillCallback | None
    ) -> None:
        self.slot, self.pins, self.cells, self.levers, self.spill = slot, pins, cells, levers, spill
        self.debts = Debts()  # installed changes whose engine free failed

    def run(self, plan: Plan[_Result], write: Write = PLAIN) -> Any:
        """The one write loop: ``plan(table) -> (new table, result)`` and its admission (`admit`) computed
        outside the lock, installed under it if the table (and ``write.cell``'s copy) did not change, else again.

        ``write`` (`Write`) holds the options. A parked object ``plan`` meets is restored first in the same
        attempt (`restoring`), so the restores land only with the write. Blocks the library took for an
        attempt that is not installed (restores; with ``acquires``, ``plan``'s own) go back. ``then(installed
        table, undo)`` runs under the lock after the install (journaling in ``undo``); its result, unless None,
        replaces ``plan``'s. A ``local`` write lands on writes to other sessions made meanwhile (`rebase`)
        without being computed again (an engine callback, user code run once)."""
        cell, writer, then = write.cell, write.writer, write.then
        spills = Spills(self.spill) if self.spill is not None else None  # (kept across attempts)
        while True:
            base, pinned, seen = self.slot.table, self.pins.pinned, cell.session if cell else None
            work, after, out = restoring(plan, base, cell, write.names)  # ``work``: ``base`` with its restores
            grabbed = (base, after if write.acquires else work)  # (what the library took for this attempt)
            try:
                gone = write.dropped(base) if write.dropped is not None else None
                decision = self.admit(base, after, writer, pinned, gone, write, spills)
            except BaseException:
                hand_back(*grabbed)
                raise
            installed = False
            while True:  # install; a session-local write is replayed onto writes to other sessions meanwhile
                with self.slot.lock:
                    current = self.slot.table
                    if current is base and self.pins.pinned is pinned and (cell is None or cell.session is seen):
                        undo, epoch, installed = self.install(decision), self.slot.epoch, True
                        if then is not None:
                            kept = then(decision.final, undo)
                            out = out if kept is None else kept
                        break
                moved = rebase(base, after, current, writer) if write.local and writer else None
                if moved is None or (cell is not None and cell.session is not seen):
                    break
                base, after, pinned = current, moved, self.pins.pinned
                try:
                    decision = self.admit(base, after, writer, pinned, None, write, spills)
                except BaseException:
                    hand_back(*grabbed)
                    raise
            if installed:
                break
            hand_back(*grabbed)  # its session changed meanwhile: compute it again
        self.settle(base, decision, undo, epoch)
        return out

    def settle(self, base: ManagerState, decision: Decision, undo: Undo, epoch: int) -> None:
        """Outside the lock, after installing ``decision`` on ``base``: hand back the blocks it released."""
        if decision.released or self.debts.owed:
            final = decision.final
            self.debts.settle(base, final, decision.released, lambda: self.take_back(base, final, undo, epoch))

    def admit(
        self,
        before: ManagerState,
        after: ManagerState,
        writer: Any,
        pinned: Any,
        gone: Any,
        write: Write,
        spills: Spills | None = None,
        evicted: Any = None,
    ) -> Decision:
        """`admit` the write ``before`` -> ``after``; with a spill lever, the sessions it drops are offered
        first (`Spills.decide`: never under the lock). ``evicted``: an insertion's evictions, as the table
        reported them (see `departures`)."""
        if spills is None:
            return self._decide(before, after, writer, gone, write, evicted, pinned)
        return spills.decide(after, pinned, partial(self._decide, before, after, writer, gone, write, evicted))

    def _decide(
        self,
        before: ManagerState,
        after: ManagerState,
        writer: Any,
        gone: Any,
        write: Write,
        evicted: Any,
        pinned: Any,
        spilled: Any = None,
    ) -> Decision:
        """`admit` with this manager's levers and the budget's memos (``pinned``, ``spilled``: `Spills.decide`'s)."""
        slot = self.slot
        return admit(
            before,
            after,
            writer,
            pinned=pinned,
            levers=self.levers,
            surplus=slot.surplus,
            attrs_unchanged=write.attrs_unchanged,
            budget=write.budget,
            dropped=gone,
            last=slot.last,
            spilled=spilled,
            evicted=evicted,
        )

    def install(self, decision: Decision) -> Undo:
        """Under the lock: install ``decision``; the handles of sessions that left keep their own copies."""
        undo: Undo = []
        if decision.left:  # journaled only for a write a failed engine ``free`` may take back
            self.cells.detach(decision.left, undo if decision.released else None)  # (first: see `cells`)
        slot = self.slot
        slot.table, slot.surplus, slot.epoch = decision.final, decision.surplus, slot.epoch + 1
        slot.budgeted = decision.final.byte_budget is not None
        if decision.released:
            self.cells.evict_freed(decision.released, undo)
        return undo

    def take_back(self, base: ManagerState, final: ManagerState, undo: Undo, epoch: int) -> bool:
        """After a failed ``free``: reinstall ``base`` and the handles, unless a write landed on ``final``
        since (the retry loop's installs change ``epoch``; every install puts a new table in place)."""
        slot = self.slot
        with slot.lock:
            if slot.epoch != epoch or slot.table is not final:
                return False
            # The counter stays where ``final`` took it: a number the taken-back write issued is never issued again
            # (a cell may have been made for it meanwhile, read lock-free from ``final``).
            slot.table = with_issued(base, max(base.issued, final.issued))
            slot.surplus = None  # (the next write checks the budget in full)
            slot.budgeted = base.byte_budget is not None
            slot.epoch += 1
            Cells.take_back(undo)
            return True
