"""The spill lever in the shell: a session the byte budget would drop is first handed to a callback.

Protocol, per write (`Writes.run`), all of it outside the shell's lock:

1. **plan**: `admit` decides the write with the sessions handed over so far; a decision that drops a session
   whose value (as the write's table holds it) was not handed over names it in `Decision.spill`;
2. **spill**: each named session is offered, ``spill(table, session_id)`` with that table; True means the
   callback has it (exported to a peer replica, put in an object store);
3. **plan again** with what was handed over, until the decision names none; then **install** it under the
   lock if the table did not change meanwhile, as every write is. If it did change, the write is decided
   again: a session written meanwhile is a new value, offered again (the callback then receives the newer
   value), so a write that landed between the plan and the spill is never lost; an unchanged one is not
   offered twice.

A spilled session leaves the table as spilled, not evicted (no eviction counted); its handles refuse writes
(`SessionStateLostError`), which would reach a copy nobody reads. A callback that raises, or returns anything
but True, leaves its session in place: what happens to it then is `enforce_budget`'s policy (one home for the
answer), which the shell's lever only reports to: the budget is planned again with that session protected,
and only if it cannot be met otherwise is it dropped as an eviction, with a warning; its handles then keep
its last state, as after any eviction. The error is logged (``WARNING``, with its traceback) and never
raised to the writer, whose write is not at fault.

A session spilled whose write is then decided again without dropping it (another write freed room
meanwhile) stays in the table: the copy where it went is then stale, and the table's is the live one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import table as ms
from ..core.session import SessionState
from ..errors import InvalidTypeError
from ..table.manager_state import ManagerState
from .admission import Decision

__all__ = ["SpillCallback", "Spills", "checked_spill"]

_log = logging.getLogger("functional_state")

SpillCallback = Callable[[ManagerState, str], Any]  # ``(table, session id) -> True`` once it has the session


def checked_spill(spill: Any) -> SpillCallback | None:
    """``spill`` if it is None or callable, else an `InvalidTypeError` saying what is expected."""
    if spill is not None and not callable(spill):
        raise InvalidTypeError(
            f"`SessionStateManager`: spill must be a callable `spill(table, session_id) -> bool` (or None), got "
            f"{type(spill).__name__}. Pass a function that hands the session elsewhere, e.g. with `export_session`."
        )
    return spill


class Spills:
    """What one write handed to the spill callback: ``{session id: the value handed over}``, None for a
    session whose spill failed (not offered again by this write). One per write, kept across its attempts."""

    __slots__ = ("callback", "handed")

    def __init__(self, callback: SpillCallback):
        self.callback = callback
        self.handed: dict[str, SessionState | None] = {}

    def decide(self, after: ManagerState, pinned: frozenset[str], admit: Callable[..., Decision]) -> Decision:
        """The decision for the write whose table is ``after``: ``admit(pinned, spilled)`` (`admit` with the
        pins and what was handed over), with every session it drops handed to the callback first.

        Raises:
          BudgetExceededError: the budget cannot be met even by dropping the sessions whose spill failed
            (`enforce_budget` drops those only as a last resort).
        """
        while True:
            decision = admit(pinned, self.handed)
            if not decision.spill:
                return decision
            for sid in decision.spill:
                self.handed[sid] = self._offer(after, sid)

    def _offer(self, after: ManagerState, sid: str) -> SessionState | None:
        """Hand session ``sid`` of ``after`` to the callback: its value there if taken, else None."""
        value = ms.lookup(after, sid)
        try:
            taken = self.callback(after, sid) is True
        except Exception:
            _log.warning("spilling session %r raised; it stays in the table", sid, exc_info=True)
            return None
        if not taken:
            _log.info("spilling session %r was declined; it stays in the table", sid)
            return None
        return value
