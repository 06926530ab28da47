"""The writes a checkpoint load makes: read outside the lock, installed by the shell's retry loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import table as ms
from ..core.session import SessionState
from ..persist import checkpoint as ckpt
from ..table.manager_state import ManagerState
from ..table.renumber import continued

__all__ = ["session_load", "table_load"]

Plan = Callable[[ManagerState], tuple[ManagerState, None]]
Dropped = Callable[[ManagerState], dict[str, str]]


def session_load(
    current: ManagerState, session_id: str | None, path: Any, as_id: str | None, replace: bool, **read: Any
) -> tuple[str, SessionState, Plan, Dropped]:
    """Read session ``session_id`` (refused first if its target id is taken); returns ``(target id, the
    session read, the plan installing it, the sessions it replaces)``."""
    target = ms.resolve_session_id(as_id if as_id is not None else session_id)
    ckpt.check_free(current, target, replace)  # fail before reading the checkpoint
    session = ckpt.read_session(session_id, path, **read)

    def plan(state: ManagerState) -> tuple[ManagerState, None]:
        ckpt.check_free(state, target, replace)
        return ckpt.install_session(state, target, session, replace=replace), None

    replaced = {target: "dropped (replaced by `load_session(..., replace=True)`)"}
    return target, session, plan, lambda state: replaced


def table_load(path: Any, **read: Any) -> tuple[ManagerState, Plan, Dropped]:
    """Read a whole table; returns ``(table, the plan installing it, the sessions it replaces)``.

    The plan installs the table read with its incarnations numbered on from the replaced table's
    (`continued`): a number the shell issued once (a handle's cell holds it) is never issued again."""
    table = ckpt.load(path, **read)

    def replaced(state: ManagerState) -> dict[str, str]:
        return dict.fromkeys(state.session_ids, "dropped (the table was replaced by `load`)")

    return table, lambda state: (continued(table, state.issued), None), replaced
