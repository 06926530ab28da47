"""The object verbs of the table: store, stage, commit, discard and read one state object of a session,
and replace one object wherever the table holds it (what `park` and `restore` do).

Every function takes a `ManagerState` and returns a new one; the input is never changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.pytree import MISSING
from ..core.state_object import StateObject
from ..memory.holders import totals_with_attrs
from .checks import find_object, locate
from .lru import replace_session, replace_sessions
from .manager_state import ManagerState, add_to_counter, ledger_of, with_nodes
from .torch_writes import check_object, record, record_commit, recorded
from .verb_core import commit_payload

__all__ = ["commit", "discard", "put", "replace_object", "stage", "view"]

_new = object.__new__


def put(state: ManagerState, session_id: str | None, name: str, obj: StateObject) -> ManagerState:
    """Store state object ``obj`` under ``name`` in a session (see `SessionState.put`)."""
    sid, session = locate(state, session_id, "put")
    if recorded(obj):  # the very object held elsewhere: a write in place it already shares is refused here
        check_object(state, sid, name, obj, "put")
    out = replace_session(state, sid, session, session.put(name, obj))
    if not recorded(obj):
        record(obj)
    return out


def _object_op(
    state: ManagerState, session_id: Any, name: str, what: str, op: Callable[[StateObject], StateObject]
) -> ManagerState:
    sid, session = locate(state, session_id, what)
    return replace_session(state, sid, session, session._with_object(name, op(find_object(session, name, what))))


def stage(state: ManagerState, session_id: str | None, name: str, payload: Any) -> ManagerState:
    """Stage ``payload`` in object ``name`` of a session (see `StateObject.stage`)."""
    sid, session = locate(state, session_id, "stage")
    obj = find_object(session, name, "stage")
    check_object(state, sid, name, obj, "stage")
    new = obj.stage(payload)
    record_commit(obj, new, payload)
    return replace_session(state, sid, session, session._with_object(name, new))


def commit(state: ManagerState, session_id: str | None, name: str, payload: Any = MISSING) -> ManagerState:
    """Commit ``payload`` (or the staged payload) into object ``name`` of a session.

    Example:
      >>> from functional_state import LatentBuffer, ManagerState, get_or_create
      >>> s, _ = get_or_create(ManagerState.create(), "a")
      >>> s = put(s, "a", "frames", LatentBuffer.create(maxlen=2))
      >>> s = commit(commit(commit(s, "a", "frames", 1), "a", "frames", 2), "a", "frames", 3)
      >>> view(s, "a", "frames")
      (2, 3)
    """
    return commit_payload(state, session_id, name, payload)


def discard(state: ManagerState, session_id: str | None, name: str) -> ManagerState:
    """Drop the staged payload of object ``name`` in a session."""
    return _object_op(state, session_id, name, "discard", lambda o: o.discard())


def view(state: ManagerState, session_id: str | None, name: str, include_staged: bool = True) -> Any:
    """Read object ``name`` of a session (see `StateObject.view`). Recency is unchanged."""
    sid, session = locate(state, session_id, "view")
    obj = find_object(session, name, "view")
    check_object(state, sid, name, obj, "view")
    return obj.view(include_staged=include_staged)


def _pool_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in sorted({*before, *after}) if after.get(k, 0) != before.get(k, 0)
    }


def replace_object(
    state: ManagerState, old: StateObject, new: StateObject, targets: dict[str, list[str]], counter: str
) -> tuple[ManagerState, dict[str, int]]:
    """``state`` with object ``old`` replaced by ``new`` under ``targets`` (session -> names), the named
    counter (``"parks"`` or ``"restores"``) raised by the names replaced, and the change in bytes per pool
    that makes, measured: the table's accounting (objects, and attrs re-read) before and after, each buffer
    counted once, exactly as `stats` counts it."""
    tracked = state._acct is not None
    before = ledger_of(state)  # (the attr index in it answers for the attrs: no walk of the table)
    after = before
    changed = {}
    for target, names in targets.items():
        session = state._nodes[target]
        for name in names:
            session = session._with_object(name, new)
            after = after.swap(old, new)
        changed[target] = session
    moved = _pool_delta(totals_with_attrs(before)[0], totals_with_attrs(after)[0])
    count = sum(len(names) for names in targets.values())
    replaced = with_nodes(state, replace_sessions(state, changed), after if tracked else None)
    return add_to_counter(replaced, counter, count), moved
