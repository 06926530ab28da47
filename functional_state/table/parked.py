"""Parking in the table: move an object storage to host memory and back, refused while something else holds it, with its forks (with_sharers) as one host copy."""

from __future__ import annotations

import logging

from ..core.state_object import StateObject
from ..errors import (
    DeletedArrayError,
    SharedStorageError,
)
from ..memory import holders as _holders
from ..memory.holders import held_elsewhere
from .checks import find_object, locate
from .ledger import held_by
from .manager_state import ManagerState, ledger_of, session_map
from .object_verbs import replace_object
from .torch_writes import check_object, record, recorded

_log = logging.getLogger("functional_state")


def _holding(state: ManagerState, obj: StateObject) -> dict[str, list[str]]:
    """``{session id: names}`` under which the table holds this very object (forks, or a second name)."""
    out: dict[str, list[str]] = {}
    for sid, session in session_map(state).items():
        names = [n for n, o in session._objects.items() if o is obj]
        if names:
            out[sid] = names
    return out


def park(
    state: ManagerState, session_id: str | None, name: str, *, with_sharers: bool = False, copy: bool = False
) -> tuple[ManagerState, dict[str, int]]:
    """Move object ``name``'s committed storage to host memory (see `functional_state.memory.parking`).

    On a CPU device, whose memory is host memory, torch storages that nothing else holds (no tensor the
    user keeps, no view, no ``from_numpy`` or DLPack memory, no transfer blob) are taken as the host copy
    instead of copied: the bytes still move from the device pool to the host pool in the figures (what
    budgets read), though on the CPU both are the same memory. They stay shared with the restored tensors
    (and the resident object an older table holds) the way a fork's are: `writable` copies them before an
    in-place write while the parked copy lives. ``copy=True`` always makes a private host copy.

    Parking frees device memory only if nothing else holds the storage, so it is refused when something
    does: another object or an attr of the session, or another session. The very same object held
    elsewhere (by a fork, or under another name in any session) is the one exception that can be parked with
    it: ``with_sharers=True`` parks it wherever the table holds it, as one shared host copy (forks keep
    sharing, now in host memory, and `restore` gives them one device copy again).

    Returns:
      ``(state, moved)``: ``moved`` is the change in bytes per pool, e.g.
      ``{"cuda:0": -n, "cpu/pinned_host": n}`` (on the CPU backend, ``{"cpu": -n, "cpu/pinned_host": n}``),
      measured on the table's accounting: it equals the change in ``stats(exact=True)``.

    Raises:
      SharedStorageError: something else in the table holds the storage (the message says what), or the
        object's own staged payload does.
      DeletedArrayError: the object holds a JAX array that was deleted (donated); nothing changes.
      SharedStorageWrittenError: a torch storage it shares was written in place outside `writable`.
      ObjectParkedError, NotAllocatedError, NotResidentError: the object is not resident.
      SessionStateLostError, ObjectNotFoundError: no such session or object.

    Example:
      >>> import jax.numpy as jnp
      >>> from functional_state import ArrayRing, get_or_create, put
      >>> s, _ = get_or_create(ManagerState.create(), "a")
      >>> s = put(s, "a", "ring", ArrayRing.create(4, (256,)))
      >>> parked, moved = park(s, "a", "ring")
      >>> moved
      {'cpu': -4096, 'cpu/pinned_host': 4096}
      >>> restore(parked, "a", "ring")[1]
      {'cpu': 4096, 'cpu/pinned_host': -4096}
    """
    sid, node = locate(state, session_id, "park")
    obj = find_object(node, name, "park")
    obj._require_resident("park")
    check_object(state, sid, name, obj, "park")
    acct, own = ledger_of(state), held_by(obj)
    # An object whose storage is its leaves, with nothing staged, holds exactly its committed storage: its
    # ledger figures (the default walk, kept on it) are that storage's extents, not walked a second time.
    plain = type(obj).extents_from_leaves and obj.staged is None and obj.host_copy is None
    mine = own if plain else _holders.holder_extents(obj._committed_roots())
    # The common case, O(size of the object): nothing else holds the storage, and (for with_sharers) the
    # counts show this very object held once, so there are no sharers to find.
    alone = not with_sharers or (own and not held_elsewhere(acct, own, own))
    if alone and not held_elsewhere(acct, mine, own):
        targets, holders = {sid: [name]}, []
    else:  # something else holds part of it: find what (a walk), for the sharers to park or the message
        holding = _holding(state, obj)
        targets = holding if with_sharers else {sid: [name]}
        keys = {(p, s) for p, s, _ in mine}
        others = _holders.holders_except(session_map(state), targets)
        holders = sorted(s for s, values in others.items() if keys & _holders.buffer_keys(values))
    if holders:
        same = sorted(f"{s}/{n}" for s, names in holding.items() for n in names if (s, n) != (sid, name))
        hint = (
            f" {same[:5]} hold this very object: pass with_sharers=True to park it there too."
            if same and not with_sharers
            else ""
        )
        raise SharedStorageError(
            f"`park`: object {name!r} of session {sid!r} shares its storage with something else in session(s) "
            f"{holders[:5]}{' ...' if len(holders) > 5 else ''} (another object, an attr, or a fork): parking it "
            f"would copy it to host memory and free no device memory.{hint}"
        )
    try:
        # (the table's write record of the object holds one more reference to each of its tensors)
        parked = obj.park(copy=copy, held=1 if recorded(obj) else 0)
    except (DeletedArrayError, SharedStorageError) as e:  # the object's own refusal, told with its address
        raise type(e)(f"`park`: object {name!r} of session {sid!r}: {e}") from None
    new, moved = replace_object(state, obj, parked, targets, "parks")
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("park: %s, moved %s", sorted(f"{s}/{n}" for s, names in targets.items() for n in names), moved)
    return new, moved


def restore(state: ManagerState, session_id: str | None, name: str) -> tuple[ManagerState, dict[str, int]]:
    """Bring a parked object's storage back where it was, bit for bit, in this session.

    Forks parked together (``with_sharers``) restore to one device copy: restoring the object in a second
    session reuses the copy the first restore made (see `StateObject.restore`).

    Returns:
      ``(state, moved)``: the change in bytes per pool, measured as `park` measures it. The host copy is
      released only if no other session (a fork parked with ``with_sharers``) still holds the parked object.

    Raises:
      NotParkedError: the object is not parked.
      SessionStateLostError, ObjectNotFoundError: no such session or object.
    """
    sid, node = locate(state, session_id, "restore")
    obj = find_object(node, name, "restore")
    # A fork that still holds the parked object (parked with_sharers) would share a taken storage with this
    # session's restored one: copy it, so the restored storage is this session's own (as a copy's always was).
    own = held_by(obj)
    restored = obj.restore(copy=bool(own and held_elsewhere(ledger_of(state), own, own)))
    new, moved = replace_object(state, obj, restored, {sid: [name]}, "restores")
    if not recorded(restored):  # (forks parked together share the one restored copy: see `torch_writes`)
        record(restored)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("restore: object %r of session %r, moved %s", name, sid, moved)
    return new, moved
