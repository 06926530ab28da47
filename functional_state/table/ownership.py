"""Ownership epochs: which owner of a session is the current one, as a number that only a claim raises.

A session served by several replicas has one owner at a time. Each claim (a replica taking the session over:
after a move, a failover, a rebalance) raises the session's epoch by one, and the epoch travels with the
session: it is an attr (`EPOCH_ATTR`), so a checkpoint and a transfer blob hold it like any other attr and a
fork carries it. An owner that was superseded still holds the lower epoch; an export, an import or a save made
under an epoch that is not the session's is refused with `StaleEpochError` (`check_epoch`), and a save never
replaces a checkpoint holding a higher epoch of a session (`persist.fencing`).

A session also names the model it belongs to (`MODEL_ATTR`, a string the user chooses: a model name and
revision): an import into another model refuses it.

Example:
  >>> import functional_state as fs
  >>> from functional_state.table.ownership import claim, epoch_of
  >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
  >>> s = claim(s, "robot", model="dreamzero-14b@r1")
  >>> epoch_of(s, "robot")
  1
"""

from __future__ import annotations

from typing import Any

from ..core.session import SessionState
from ..errors import InvalidArgumentError, StaleEpochError
from .checks import locate
from .manager_state import ManagerState, node_session
from .session_edits import update_session

__all__ = [
    "EPOCH_ATTR",
    "MODEL_ATTR",
    "check_epoch",
    "claim",
    "claimed",
    "epoch_of",
    "model_of",
    "session_epoch",
]

EPOCH_ATTR = "functional_state.epoch"  # int: 0 until the first claim

MODEL_ATTR = "functional_state.model"  # str: the model the session belongs to; absent when never named


def session_epoch(attrs: Any) -> int:
    """The epoch recorded in a session's attrs (0 when never claimed)."""
    epoch = attrs.get(EPOCH_ATTR, 0)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0


def epoch_of(state: ManagerState, session_id: str | None) -> int:
    """The ownership epoch of a session (0 when never claimed); recency is unchanged.

    Raises:
      SessionStateLostError: no such session.
    """
    _, node = locate(state, session_id, "epoch_of")
    return session_epoch(node_session(node).attrs)


def model_of(state: ManagerState, session_id: str | None) -> str | None:
    """The model identity a session carries (None when never named)."""
    _, node = locate(state, session_id, "model_of")
    model = node_session(node).attrs.get(MODEL_ATTR)
    return model if isinstance(model, str) else None


def claim(state: ManagerState, session_id: str | None, *, model: str | None = None, above: int = 0) -> ManagerState:
    """``state`` with the session's epoch raised past both its own and ``above``: the caller is its owner now.

    Args:
      model: the model identity to record (refused if the session already names another one).
      above: an epoch the new one must exceed (the highest the caller knows of: a router's record, the
        epoch of the checkpoint the session was loaded from), so that a claim on a stale copy still wins.

    Returns:
      The new table; read the epoch with `epoch_of`.

    Raises:
      SessionStateLostError: no such session. InvalidArgumentError: ``above`` is not a count, or ``model``
        names another model than the one the session carries.

    Example:
      >>> import functional_state as fs
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
      >>> epoch_of(claim(s, "a", above=6), "a")
      7
    """
    sid, _ = locate(state, session_id, "claim")
    return update_session(state, sid, lambda session: claimed(session, model=model, above=above, sid=sid))


def claimed(session: SessionState, *, model: str | None = None, above: int = 0, sid: str = "") -> SessionState:
    """The session-level `claim` (what a shell handle's ``transact`` applies): ``session`` at its next epoch."""
    if not isinstance(above, int) or isinstance(above, bool) or above < 0:
        raise InvalidArgumentError(f"`claim`: above must be an epoch (an int >= 0), got {above!r}.")
    attrs = session.attrs
    if model is not None:
        if not isinstance(model, str) or not model:
            raise InvalidArgumentError(f"`claim`: model must be a non-empty str naming the model, got {model!r}.")
        held = attrs.get(MODEL_ATTR)
        if held is not None and held != model:
            raise InvalidArgumentError(
                f"`claim`: session {sid!r} belongs to model {held!r}, not {model!r}; a session cannot change model."
            )
        session = session.set_attr(MODEL_ATTR, model)
    return session.set_attr(EPOCH_ATTR, max(session_epoch(attrs), above) + 1)


def check_epoch(state: ManagerState, session_id: str | None, epoch: int | None, what: str) -> int:
    """The session's epoch, or `StaleEpochError` unless it is ``epoch`` (None: no check).

    Raises:
      StaleEpochError: the session was claimed at another epoch than the caller's.
    """
    sid, node = locate(state, session_id, what)
    held = session_epoch(node_session(node).attrs)
    if epoch is not None and held != epoch:
        raise StaleEpochError(
            f"`{what}`: session {sid!r} is at epoch {held}, not {epoch}: "
            + (
                "this replica's copy is stale (another owner claimed the session since); drop it and ask the "
                "router for the current owner."
                if held < epoch
                else "it was claimed again since the caller learned its epoch; ask the router for the current one."
            )
        )
    return held
