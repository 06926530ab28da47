"""The shell's record of handles: one `Cell` per session incarnation, and who left the table, and why.

A cell holds nothing while its session is in the table (handles read the table); when a write takes the
session out, the cell keeps the session's last state as the handles' own copy. Cells and the shell's handles
are kept weakly (but for the last `_RECENT` handles built for a session just created, or a second time within
a window of `_RECENT` builds: sessions in use): a session no handle holds (an idle one) has neither, so it costs a full collection
nothing over the table's own objects; its next handle gets a new cell, which no older handle can share. A
handle built once in a long while dies with its caller's reference, young, and the weak entries of a dead
handle leave at the next build (`Cells.handle`), so none pile up for a sweep. Every change the shell makes
to cells while installing a write is journaled, so a write that must be taken back (an engine ``free`` that
raised, with nothing installed on top of it) leaves the cells exactly as they were.

The invariant the shell's one-step writes rely on (`slot`): read under the lock, a cell whose ``left`` is
None names an incarnation the installed table holds. Every install that removes a session detaches its
cell before the table is replaced (`Cells.detach`: found by comparing tables by
incarnation, never predicted), and nothing else removes one.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from .. import table as ms
from ..core.session import SessionState
from ..errors import SessionStateLostError
from ..table.manager_state import ManagerState

__all__ = ["Cell", "Cells", "Departure", "departures", "evicted_reason", "in_table"]

_log = logging.getLogger("functional_state")
_DEPARTED_KEPT = 4096  # why the most recent departed ids left: named by errors about them
_SWEEP_FROM = 64  # detached cells (or live entries) kept before the first sweep of dead ones
_RECENT = 1024  # handles built again within this many builds, kept alive: a session in use keeps its handle
_NOT_LEFT = SessionState.empty()  # a live cell's session: never read while the cell is in the table


class Cell:
    """The latest state of one session incarnation, shared by all of its handles.

    ``left`` says why the incarnation left the table (None while it is there); ``closed`` is True when it
    left because a caller removed it (a drop): its handles then refuse writes, which could reach no session.
    """

    __slots__ = ("__weakref__", "closed", "left", "session", "session_id", "uid")

    def __init__(self, uid: int, session_id: str):
        self.uid = uid
        self.session_id = session_id
        # Read only once ``left`` is set (`Slot.held` reads the table first): holding the session it was made
        # with would keep that old version, and every object in it, alive as long as the cell.
        self.session: SessionState = _NOT_LEFT
        self.left: str | None = None
        self.closed = False


class Departure(NamedTuple):
    """A session incarnation a write took out of the table, and the last state it had there."""

    sid: str
    uid: int
    session: SessionState
    reason: str  # "evicted (...)" or "dropped (...)", for logs and errors
    closed: bool  # a caller removed it: its handles refuse writes


@functools.cache  # (one string per cap, not one per miss)
def evicted_reason(max_sessions: int) -> str:
    """Why a session an insertion evicted left (the reason its `Departure` carries)."""
    return f"evicted (LRU: the table holds at most max_sessions={max_sessions})"


def _log_detached(sid: str, reason: str) -> None:
    """Once per incarnation that leaves with live handles (the eviction itself is logged where it happens)."""
    _log.info(
        "session %r %s: its live handles keep their own copy; writes through them no longer reach the table "
        "(`handle.in_table` is False)",
        sid,
        reason,
    )


def in_table(state: ManagerState, cell: Cell) -> bool:
    """Whether ``state`` holds the cell's incarnation (and the cell has not left)."""
    return cell.left is None and ms.held_session(state, cell.session_id, cell.uid) is not None


def _holds(state: ManagerState, sid: str, uid: int) -> bool:
    return ms.held_session(state, sid, uid) is not None


def departures(
    before: ManagerState,
    after: ManagerState,
    final: ManagerState,
    dropped: Mapping[str, str],
    evicted: Iterable[tuple[str, int, SessionState]] | None = None,
) -> list[Departure]:
    """The incarnations in ``before`` that ``final`` no longer holds: those the op removed (``before`` to
    ``after``), then those the budget released (``after`` to ``final``). Pure: found by comparing tables by
    incarnation (whatever the op did, never a prediction of it).

    ``dropped``: ids the op removes at a caller's request, with why: these leave (their handles refuse
    writes) whatever ``after`` holds under the id (a table replaced by `load` holds new incarnations of them:
    the shell numbers a loaded table on from the installed one's counter, `table.renumber`).
    ``evicted``: for an insertion (``after`` is `lru.get_or_insert`'s table), the ``(id, incarnation,
    session)`` it reported evicting: the sessions the op removed, as the table itself reported them, so the
    least recent end of ``before`` is not walked to find them again."""
    if evicted is not None and not dropped:
        reason = evicted_reason(before.max_sessions)
        out = [Departure(sid, uid, session, reason, False) for sid, uid, session in evicted]
        return out if final is after else _budget_departures(out, after, final)
    out = []
    # A table derived from `before` gained exactly one incarnation number per insertion, so the sessions
    # that left number `missing`; they are found from the least recent end (where an LRU eviction takes
    # them), stopping once all are found: a miss at a full table costs O(1), not a walk of the table.
    missing = len(before) + (after.issued - before.issued) - len(after)
    for sid, reason in dropped.items():
        uid = ms.incarnation_of(before, sid)
        if uid is not None:
            out.append(Departure(sid, uid, ms.lookup(before, sid), reason, True))
            missing -= not _holds(after, sid, uid)
    if missing:
        exhaustive = missing < 0  # `after` was not derived from `before`: look at every session
        lru = evicted_reason(before.max_sessions)
        for sid, uid, session in ms.entries_lru(before):
            if sid not in dropped and not _holds(after, sid, uid):
                out.append(Departure(sid, uid, session, lru, False))
                missing -= 1
                if not missing and not exhaustive:
                    break
    return _budget_departures(out, after, final)


def _budget_departures(out: list[Departure], after: ManagerState, final: ManagerState) -> list[Departure]:
    """``out`` (the op's departures) and then the incarnations the budget released (``after`` to ``final``)."""
    gone_by_budget = len(after) - len(final) if final is not after else 0
    if gone_by_budget > 0:
        gone = {d.uid for d in out}
        budget = "dropped by the byte budget (to make room; released like an LRU eviction)"
        for sid, uid, session in ms.entries_lru(after):
            if uid not in gone and not _holds(final, sid, uid):
                out.append(Departure(sid, uid, session, budget, False))
                gone_by_budget -= 1
                if not gone_by_budget:
                    break
    return out


Undo = list[Callable[[], None]]


class Cells:
    """Cells by incarnation while their session is in the table; detached cells (weakly); why ids left.

    Every method here runs under the shell's lock. ``undo`` lists, newest last, how to take back what the
    mutating methods did (see `take_back`)."""

    def __init__(self) -> None:
        # The cell of each incarnation in the table that some handle holds, weakly, so handles made per call
        # share one cell while any lives. An entry leaves when its session leaves the table (handles still
        # holding the cell then work on its own copy), or in a sweep once dead (`_keep_live`): no callback,
        # so every change to these dicts is made under the shell's lock.
        self.live: dict[int, weakref.ref[Cell]] = {}
        # The shell's handle on each live cell, weakly: a hit returns it while it lives instead of building
        # one. Kept here, not on the cell, so a detached cell is freed with its last handle.
        self.handles: dict[int, weakref.ref[Any]] = {}
        self._live_sweep_at = _SWEEP_FROM
        # The last `_RECENT` handles built for a session just created or built a second time (see `_built`) on
        # sessions still in the table, strongly, by incarnation: a caller that drops its handle after each call (one `get_or_create_session` per request)
        # gets the same one back instead of a new cell and handle per hit, while a full collection pays for at
        # most `_RECENT` of them whatever the table holds. A session leaving the table leaves this too: a
        # detached handle keeps its session's last state, which only a caller's own handle may keep alive.
        self._recent: OrderedDict[int, Any] = OrderedDict()
        # The incarnations the last `_RECENT` handles were built for (numbers only): a handle is kept in
        # `_recent` when it is built again within that window, so a session in use keeps one, while the handle
        # of a session met once in a long while (uniform hits over a large table) dies young, in the
        # collector's youngest generation, instead of surviving in the ring into the oldest, which makes
        # every later collection longer and triggers full ones sooner.
        self._built: OrderedDict[int, None] = OrderedDict()
        self._unkept: deque[int] = deque()  # the incarnations of the last handles built and not kept
        # Detached cells, weakly: a plain weak reference per cell in a list (no callback, no WeakSet or dict
        # bookkeeping on the miss path: one append); the dead ones are swept when the list has doubled since
        # the last sweep. A cell is in it at most once: it is appended when it leaves the live dict, and
        # `relive` takes it out before it can leave again.
        self._detached: list[weakref.ref[Cell]] = []
        self._sweep_at = _SWEEP_FROM
        # Why the most recent departures left, oldest first: read only to word an error about an absent id.
        self._departed: deque[tuple[str, str]] = deque(maxlen=_DEPARTED_KEPT)

    def cell(self, state: ManagerState, sid: str, undo: Undo | None = None, uid: int | None = None) -> Cell:
        """The cell of ``sid``'s incarnation in ``state`` (installed), made on first use (``uid``: that
        incarnation, where the caller has it from the table's own answer)."""
        if uid is None:
            uid = ms.incarnation_of(state, sid)  # (``sid`` resolved by the caller, and in ``state``)
            assert uid is not None
        cell = self._live_cell(uid)
        if cell is None:
            cell = Cell(uid, sid)
            self._keep_live(cell)
            if undo is not None:  # a cell of an insertion taken back would name an incarnation reused next
                session = ms.held_session(state, sid, uid)
                assert session is not None
                undo.append(lambda: self._forget(uid, session))
        return cell

    def handle(
        self,
        state: ManagerState,
        sid: str,
        undo: Undo | None,
        make: Callable[[Cell], Any],
        uid: int | None = None,
        created: bool = False,
    ) -> Any:
        """The shell's handle on the cell of ``sid`` in ``state`` (installed): the one a hit returns while it
        lives, built by ``make(cell)`` when none does. A handle built for a session just ``created``, or built
        within the last `_RECENT` builds too, is kept for reuse (see `Cells`). ``uid`` as for `cell`."""
        cell = self.cell(state, sid, undo, uid)
        uid = cell.uid
        ref = self.handles.get(uid)
        handle = None if ref is None else ref()
        if handle is None:
            handle = make(cell)
            self.handles[uid] = weakref.ref(handle)
            built = self._built
            if created or uid in built:  # a session in use: it keeps its handle between calls
                recent = self._recent
                recent[uid] = handle
                if len(recent) > _RECENT:
                    self._unless_held(recent.popitem(last=False)[0])
            else:
                built[uid] = None
                if len(built) > _RECENT:
                    built.popitem(last=False)
                # The handles built before this one and not kept: their callers have usually dropped them by
                # now (a caller's loop still holds the last one while it asks for the next).
                unkept = self._unkept
                unkept.append(uid)
                if len(unkept) > 2:
                    self._unless_held(unkept.popleft())
        return handle

    def _unless_held(self, uid: int) -> None:
        """Once nothing of the shell holds incarnation ``uid``'s handle (the ring let go of it, or it was never
        kept): its entries leave now if nothing else holds the handle or its cell (the common case: a caller
        that takes a handle per request), so dead entries never pile up for a sweep, which would walk every
        entry inside one caller's op."""
        ref = self.handles.get(uid)
        if ref is not None and ref() is None:
            del self.handles[uid]
            cell_ref = self.live.get(uid)
            if cell_ref is not None and cell_ref() is None:
                del self.live[uid]

    def _live_cell(self, uid: int) -> Cell | None:
        ref = self.live.get(uid)
        return None if ref is None else ref()

    def _keep_live(self, cell: Cell) -> None:
        live = self.live
        live[cell.uid] = weakref.ref(cell)
        if len(live) >= self._live_sweep_at:  # amortized O(1), as `_keep_detached`
            for uid in [uid for uid, ref in live.items() if ref() is None]:
                del live[uid]
            handles = self.handles
            for uid in [uid for uid, ref in handles.items() if ref() is None]:
                del handles[uid]
            self._live_sweep_at = max(_SWEEP_FROM, 2 * len(live))

    def _forget(self, uid: int, session: SessionState) -> None:
        ref = self.live.pop(uid, None)
        self.handles.pop(uid, None)
        self._recent.pop(uid, None)
        cell = None if ref is None else ref()
        if cell is not None:  # (its incarnation was never kept: no cell that has not left may name it)
            cell.session = session  # first: a lock-free reader that sees `left` must find the copy
            cell.left = "not kept (the write that made it was taken back)"

    def detached(self) -> list[Cell]:
        """The detached cells some handle still holds."""
        return [cell for ref in list(self._detached) if (cell := ref()) is not None]

    def _keep_detached(self, cell: Cell) -> None:
        detached = self._detached
        detached.append(weakref.ref(cell))
        if len(detached) >= self._sweep_at:  # amortized O(1): each sweep at least halves what it finds
            detached[:] = [ref for ref in detached if ref() is not None]
            self._sweep_at = max(_SWEEP_FROM, 2 * len(detached))

    def why_left(self, sid: str) -> str | None:
        """How ``sid`` last left the table, if it did among the recent departures."""
        return next((why for gone, why in reversed(self._departed) if gone == sid), None)

    def require(self, state: ManagerState, sid: str, what: str) -> None:
        """Refuse an absent session that this shell saw leave, saying how it left (the pure functions can
        only say it is absent)."""
        if sid not in state and (why := self.why_left(sid)) is not None:
            raise SessionStateLostError(
                f"`{what}`: session {sid!r} was {why}, so a continuation cannot resume it. "
                f"Start a new session with `get_or_create_session`."
            )

    def detach(self, left: list[Departure], undo: Undo | None) -> None:
        """Once a write that took sessions out of the table is decided, before it is installed: the live
        handles of each keep its last state as their own copy (only on leaving does the copy matter, so
        writes never pay for it)."""
        for d in left:
            self._departed.append((d.sid, d.reason))
            self.handles.pop(d.uid, None)
            # First: a handle only the ring kept (no caller holds one) dies here, its cell with it, and there is
            # nothing to detach.
            self._recent.pop(d.uid, None)
            ref = self.live.pop(d.uid, None)
            cell = None if ref is None else ref()
            # Once per incarnation: the eviction itself is logged where it happens (the LRU, the budget plan), so
            # a session that leaves with no live handle has nothing more to log.
            if d.closed:  # a caller's drop: its handles refuse writes from now on
                _log.info("session %r %s", d.sid, d.reason)
            elif cell is not None:
                _log_detached(d.sid, d.reason)
            if cell is not None:
                if undo is not None:  # (None: nothing can take this write back)
                    undo.append(_restorer(self, cell, True))
                cell.session = d.session  # first: a lock-free reader that sees `left` must find the copy
                cell.closed = d.closed
                cell.left = d.reason
                self._keep_detached(cell)

    def evict_freed(self, released: Mapping[Any, tuple[int, ...]], undo: Undo) -> None:
        """Handles of sessions that left the table keep their copy, minus the engine blocks a write releases:
        a handle holding a block that goes back to the engine is evicted there, so it never reads recycled
        memory."""
        freed = {(pool.uid, i) for pool, ids in released.items() for i in ids}
        for cell in self.detached():
            session = cell.session
            for name, obj in session.objects.items():
                if not freed.isdisjoint(obj.ledger_blocks()):
                    session = session.update(name, lambda o: o.evict()[0])
                    _log.debug(
                        "session %r: detached handle's KV %r evicted (its blocks went back)", cell.session_id, name
                    )
            if session is not cell.session:
                undo.append(_restorer(self, cell, False))
                cell.session = session

    def relive(self, cell: Cell) -> None:
        """Undo `detach` of ``cell`` (see `take_back`)."""
        # (O(detached cells), on the rare path of a write taken back)
        self._detached[:] = [ref for ref in self._detached if ref() is not cell]
        self._keep_live(cell)

    @staticmethod
    def take_back(undo: Undo) -> None:
        """Undo what was journaled in ``undo``, newest first."""
        for step in reversed(undo):
            step()


def _restorer(cells: Cells, cell: Cell, was_live: bool) -> Callable[[], None]:
    session, closed, left = cell.session, cell.closed, cell.left

    def restore() -> None:
        cell.session, cell.closed, cell.left = session, closed, left
        if was_live:
            cells.relive(cell)

    return restore
