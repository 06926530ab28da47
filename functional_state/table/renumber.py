"""`continued`: a table whose session incarnations continue another table's numbering (a `load` installed).

Incarnation numbers tell one life of a session id from the next: the shell keys its handles' cells by them
and asks "does the installed table still hold incarnation ``uid`` of ``sid``?" on every lock-free read. A
table derived from the installed one (by the verbs) only ever issues new numbers, but a table read from a
checkpoint was built from an empty one and numbers its sessions from 0 again, so it can hold another
incarnation under an id and number a handle already has. The shell installs `continued(loaded,
installed.issued)` instead: the same sessions, recency, counters and configuration, numbered from the
installed table's counter on, so no number is ever issued twice by one shell.

Built over `state`'s records (`Recency`, `Totals`; each session stored carrying its tick and incarnation), `make_state`, and the reads `entries_lru`,
`counters` and `ledger_of`. The recency log is rebuilt
compacted (one entry per session, in LRU order): the order is what a table means, not its ticks.
"""

from __future__ import annotations

from ..core.session import SessionState
from ..errors import InvalidArgumentError
from .manager_state import COMPACT_AT, Config, ManagerState, Recency, Totals, entries_lru, ledger_of, make_state
from .recency_log import Log
from .reroot_map import RerootMap

__all__ = ["continued"]


def continued(table: ManagerState, first: int) -> ManagerState:
    """``table`` with its sessions numbered ``first, first + 1, ...`` (least recently used first) and its
    incarnation counter at ``first + len(table)``; sessions, recency order, counters and configuration kept.

    Pure: ``table`` is unchanged. O(sessions).

    Args:
      table: the table to renumber (a loaded one).
      first: the first number to issue: the ``issued`` counter of the table it replaces.

    Raises:
      InvalidArgumentError: ``first`` is not a non-negative int.

    Example:
      >>> import functional_state as fs
      >>> loaded, _ = fs.get_or_create(fs.ManagerState.create(), "a")
      >>> moved = continued(loaded, 7)
      >>> fs.incarnation(loaded, "a"), fs.incarnation(moved, "a"), moved.issued, moved.session_ids
      (0, 7, 8, ('a',))
    """
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise InvalidArgumentError(f"`continued`: first must be a non-negative int, got {first!r}.")
    sids: list[str] = []
    nodes: dict[str, SessionState] = {}
    for tick, (sid, _, session) in enumerate(entries_lru(table)):
        nodes[sid] = session._stamped(tick, first + tick)
        sids.append(sid)
    n = len(sids)
    c = table.counters
    recency = Recency(n, Log(sids, list(range(n))), 0, n, None, 0, COMPACT_AT * n)
    totals = Totals(first + n, c.misses, c.evictions, c.parks, c.restores)
    # The ledger depends on the sessions only. A budgeted table tracks from its creation (so `ledger_of` reads
    # it, builds nothing); an unbudgeted one starts untracked, as a table nobody asked about pays nothing.
    acct = ledger_of(table) if table.byte_budget is not None else None
    config = Config(table.max_sessions, table.byte_budget, table.evict_when_full)
    return make_state(RerootMap(nodes), recency, c.hits, totals, config, acct)
