"""The bodies of the table's two hottest verbs, `get_or_create` and `commit`, compiled with the recency order
and the session map (see `functional_state._compiled`).

The public verbs (`session_verbs.get_or_create`, `object_verbs.commit`) keep their typed signatures and
docstrings and call these. Their arguments are typed `Any` here on purpose: a compiled function checks its
annotated argument types on entry and would raise a bare `TypeError`, so the checks are made inside, by the
same `checks` functions every verb uses, and a bad argument gets the verb's own error.
"""

from __future__ import annotations

from typing import Any

from ..core.session import SessionState
from .checks import check_state, find_object, locate, resolve_id
from .lru import insert, touch
from .manager_state import ManagerState, make_state
from .records import Recency
from .reroot_map import RerootMap
from .torch_writes import RECORDS, check_object, record_commit

__all__ = ["commit_payload", "hit_or_insert"]


def hit_or_insert(state: Any, session_id: Any) -> tuple[Any, Any]:
    """`session_verbs.get_or_create`: ``(state, session)``, a hit made most recent, a miss inserted.

    Raises:
      InvalidTypeError: ``state`` is not a `ManagerState` or ``session_id`` is not a non-empty str or None.
      SessionAdmissionError: a miss on a full table with ``evict_when_full=False``.
    """
    if type(state) is not ManagerState:
        check_state(state, "get_or_create")
    sid: str = session_id if type(session_id) is str and session_id else resolve_id(session_id, "get_or_create")
    nodes: RerootMap = state._nodes
    stored: SessionState | None = nodes.get(sid)
    if stored is None:
        session = SessionState.empty()
        after = insert(state, sid, session, "get_or_create", 1)
        return after, after._nodes.get(sid)  # (the session as stored: it carries its tick and incarnation)
    return touch(state, sid, stored, 1), stored


def commit_payload(state: Any, session_id: Any, name: Any, payload: Any) -> Any:
    """`object_verbs.commit`: ``state`` with ``payload`` (or the staged payload) committed into object
    ``name`` of the session.

    Raises:
      InvalidTypeError: ``state`` is not a `ManagerState` or ``session_id`` is not a non-empty str or None.
      SessionStateLostError: the session is not in the table.
      ObjectNotFoundError: the session holds no object ``name``.
      SharedStorageWrittenError: a torch storage of the object that something else holds was written in place.
    """
    sid, stored = locate(state, session_id, "commit")
    obj = find_object(stored, name, "commit")
    if RECORDS:  # (a table that never held a torch tensor: no record to compare)
        check_object(state, sid, name, obj, "commit")
    new_obj = obj.commit(payload)
    record_commit(obj, new_obj, payload)
    acct = state._acct
    recency: Recency = state._recency
    nodes: RerootMap = state._nodes
    # A hit just before left this session pending (see `lru.touch`): it takes its tick in this one write.
    new = stored._with_object(name, new_obj, recency.tick_of(sid, stored), stored._uid)
    acct = None if acct is None else acct.swap(obj, new_obj)
    return make_state(nodes.set(sid, new), recency, state._hits, state._totals, state._config, acct)
