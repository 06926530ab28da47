"""`BatchedSessions`: the sessions of one model in the slots of stacked arrays that stay stacked between calls.

The batch is one session of the table (``batch_id``): its object ``name`` is a `PytreeValue` whose every leaf
has a leading ``capacity`` axis (a slot per session), and its attr ``"slots"`` is the `SlotMap`. A step over
any subset of the sessions is one jitted, donated call on the stacked state, the active slots passed as data,
so sessions join and leave without a retrace. Join, fork and restore write one slot's rows in place (donated);
leave frees a slot; park copies a slot's rows into an ordinary session of the table, parked on the host, so a
parked session *is* the unbatched path's session: checkpoint it, export it, import it, and `restore` it into
any free slot, bit for bit.

Accounting: the stacked buffers are one object of the table, counted once (``stats()``); each session's own
rows are ``row_nbytes`` of them (`usage`); parked rows are the parked objects' host copies. A free slot's rows
are left as they were (never read: a join or restore writes them whole), so parking or leaving frees a slot,
not device memory; `fit` parks sessions to keep the occupied rows within a byte figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..core.pytree_value import PytreeValue, check_layout
from ..errors import (
    InvalidArgumentError,
    ObjectNotFoundError,
    ObjectParkedError,
    SessionAdmissionError,
    SessionExistsError,
    SessionStateLostError,
    StateShapeError,
)
from ..memory.accounting import total_nbytes
from ..memory.budget import parse_bytes
from ..table import drop_session, get_or_create, lookup, put
from ..table.manager_state import ManagerState
from ..table.parked import park as _park_object
from ..table.session_edits import set_attr
from ..table.step import step as _step
from .kernels import Apply, make_kernels
from .slot_map import SlotMap

__all__ = ["BatchUsage", "BatchedSessions"]

SLOTS = "slots"  # the batch session's attr holding its `SlotMap`


def _device_of(leaves: tuple[Any, ...]) -> Any:
    """The device of the first JAX array of ``leaves`` (the default device if none is one)."""
    for x in leaves:
        if isinstance(x, jax.Array):
            return next(iter(x.devices()))
    return jax.devices()[0]


class BatchUsage(NamedTuple):
    """What a batch holds, in bytes."""

    capacity: int  # slots, free or taken
    row_nbytes: int  # one session's rows
    stacked_nbytes: int  # the stacked buffers (capacity x row_nbytes), one object of the table
    sessions: Mapping[str, int]  # per session in a slot: its rows (row_nbytes each)
    parked: Mapping[str, int]  # per parked session: the host bytes of its parked rows


class BatchedSessions:
    """The sessions of one model, batched in ``capacity`` slots of one table session ``batch_id``.

    Args:
      initial: one session's starting state (a pytree of arrays, or a `PytreeValue`): a joining session's rows.
      params: the model's shared inputs (parameters), passed to every step, never donated.
      apply: ``apply(state, params, *args) -> (new_state, output)`` for one session, pure.
      capacity: the number of slots (fixed: it is the stacked arrays' leading axis).
      name: the object name of the state, in the batch session and in a parked session.
      batch_id: the table session that holds the batch.
      exact: step with a loop over the active slots, bit-identical to a session stepped alone (default); False:
        one `jax.vmap` over every slot, faster with many active sessions, the last bits may differ.

    Raises:
      InvalidArgumentError: ``capacity`` is not a positive int, or ``name`` / ``batch_id`` is not a non-empty str.

    Example:
      >>> import jax.numpy as jnp, functional_state as fs
      >>> def count(n, step_by, x):                     # one session: a counter, and x times its new value
      ...     return n + step_by, x * (n + step_by)
      >>> batch = BatchedSessions(jnp.zeros((), jnp.int32), 1, count, capacity=4)
      >>> s = batch.join(batch.join(batch.create(fs.ManagerState.create()), "a"), "b")
      >>> x = batch.inputs(s, {"a": 10, "b": 20})        # one row per slot
      >>> s, out = batch.step(s, ["a", "b"], x)
      >>> s, out = batch.step(s, ["a"], x)
      >>> int(out[batch.slot(s, "a")]), int(batch.session_state(s, "b").view())
      (20, 1)
    """

    def __init__(
        self,
        initial: Any,
        params: Any,
        apply: Apply,
        capacity: int,
        *,
        name: str = "kv",
        batch_id: str = "batch",
        exact: bool = True,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgumentError(f"`BatchedSessions`: capacity must be a positive int, got {capacity!r}.")
        for what, value in (("name", name), ("batch_id", batch_id)):
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(f"`BatchedSessions`: {what} must be a non-empty str, got {value!r}.")
        self.initial = initial if isinstance(initial, PytreeValue) else PytreeValue.create(initial)
        self.params, self.capacity, self.name, self.batch_id, self.exact = params, capacity, name, batch_id, exact
        self.row_nbytes = total_nbytes(self.initial.leaves)
        # Every array the kernels take is committed to one device: jit compiles anew for an argument whose
        # placement changes (committed or not), and a restored row arrives committed.
        self._device = _device_of(self.initial.leaves)
        self._initial_row = jax.device_put(self.initial.leaves, self._device)
        self._stacked_avals = tuple(((capacity, *shape), dtype) for shape, dtype in self.initial.avals)
        self._kernels = make_kernels(self.initial.treedef, apply, capacity, exact)
        self._index: tuple[Any, ...] = ((), None, None, None)  # (ids, slot map, index, count) of the last step

    # --- reading -----------------------------------------------------------------------------------
    def _batch(self, state: ManagerState, what: str) -> tuple[PytreeValue, SlotMap]:
        """The stacked object and the slot map, checked to be this model's batch."""
        session = lookup(state, self.batch_id, None)
        stacked = None if session is None else session.get(self.name, None)
        if stacked is None:
            raise SessionStateLostError(
                f"`BatchedSessions.{what}`: the table holds no batch {self.batch_id!r} (object {self.name!r}); "
                f"call `create(state)` first."
            )
        slots = session.get_attr(SLOTS, None)
        if (
            not isinstance(stacked, PytreeValue)
            or stacked.structure != self.initial.structure
            or stacked.avals != self._stacked_avals
            or not isinstance(slots, SlotMap)
        ):
            raise InvalidArgumentError(
                f"`BatchedSessions.{what}`: batch {self.batch_id!r} holds another model's state or cache shape "
                f"(expected {len(self._stacked_avals)} leaves shaped {self._stacked_avals[:2]}...); use the "
                f"`BatchedSessions` that created it, or another batch_id."
            )
        if stacked.parked:
            raise ObjectParkedError(
                f"`BatchedSessions.{what}`: batch {self.batch_id!r} is parked whole; "
                f"`functional_state.restore(state, {self.batch_id!r}, {self.name!r})` first."
            )
        return stacked, slots

    def slot_map(self, state: ManagerState) -> SlotMap:
        """The batch's `SlotMap`: which session is in which slot."""
        return self._batch(state, "slot_map")[1]

    def slot(self, state: ManagerState, session_id: str) -> int:
        """The slot of a session in the batch (the row of its inputs and outputs).

        Raises:
          ObjectParkedError: the session is parked. SessionStateLostError: it is not in the batch.
        """
        return self._slot_of(state, self._batch(state, "slot")[1], session_id, "slot")

    def _slot_of(self, state: ManagerState, slots: SlotMap, session_id: str, what: str) -> int:
        try:
            return slots.slot_of(session_id, f"BatchedSessions.{what}")
        except KeyError:
            if self._parked_object(state, session_id) is not None:
                raise ObjectParkedError(
                    f"`BatchedSessions.{what}({session_id!r})`: the session is parked (its rows are on the host); "
                    f"`restore(state, {session_id!r})` it into a free slot first."
                ) from None
            raise SessionStateLostError(
                f"`BatchedSessions.{what}({session_id!r})`: no such session in batch {self.batch_id!r} (in slots: "
                f"{len(slots.slots)}); `join` it first."
            ) from None

    def _parked_object(self, state: ManagerState, session_id: str) -> PytreeValue | None:
        session = lookup(state, session_id, None) if session_id != self.batch_id else None
        obj = None if session is None else session.get(self.name, None)
        return obj if isinstance(obj, PytreeValue) else None

    def session_state(self, state: ManagerState, session_id: str) -> PytreeValue:
        """One session's state, as the unbatched path holds it: a `PytreeValue` of one session's tree (new
        buffers, read from its slot), or the parked object of a parked session.

        Raises:
          SessionStateLostError: no such session in the batch, nor parked.
        """
        stacked, slots = self._batch(state, "session_state")
        if session_id not in slots.slots:
            parked = self._parked_object(state, session_id)
            if parked is not None:
                return parked
        row = self._kernels.read(stacked.leaves, np.int32(self._slot_of(state, slots, session_id, "session_state")))
        return PytreeValue.create(self.initial.treedef.unflatten(row))

    def inputs(self, state: ManagerState, per_session: Mapping[str, Any], fill: Any = 0) -> np.ndarray:
        """One input per slot, for `step`: ``per_session[sid]`` in the slot of ``sid``, ``fill`` elsewhere.

        Raises:
          SessionStateLostError, ObjectParkedError: a session is not in a slot.
        """
        _, slots = self._batch(state, "inputs")
        values = {self._slot_of(state, slots, sid, "inputs"): np.asarray(x) for sid, x in per_session.items()}
        like = next(iter(values.values()), np.asarray(fill))
        out = np.full((self.capacity, *like.shape), fill, like.dtype)
        for slot, x in values.items():
            out[slot] = x
        return out

    def usage(self, state: ManagerState) -> BatchUsage:
        """Bytes of the batch: the stacked buffers, each session's rows, and the parked sessions' host copies
        (those the table holds under ``name`` in the model's layout)."""
        _, slots = self._batch(state, "usage")
        parked = {}
        for sid in state.session_ids:
            obj = self._parked_object(state, sid)
            if obj is not None and obj.parked and obj.structure == self.initial.structure:
                parked[sid] = total_nbytes(obj.host_copy)
        return BatchUsage(
            self.capacity,
            self.row_nbytes,
            self.capacity * self.row_nbytes,
            dict.fromkeys(slots.slots, self.row_nbytes),
            parked,
        )

    # --- verbs -------------------------------------------------------------------------------------
    def create(self, state: ManagerState) -> ManagerState:
        """The table with an empty batch (session ``batch_id``): ``capacity`` free slots of stacked zeros.

        Raises:
          SessionExistsError: the table already has a session ``batch_id``.
        """
        if self.batch_id in state:
            raise SessionExistsError(
                f"`BatchedSessions.create`: the table already has a session {self.batch_id!r}; pass another "
                f"batch_id, or drop that session first."
            )
        stacked = jax.tree_util.tree_map(
            lambda x: jax.device_put(jnp.zeros((self.capacity, *x.shape), x.dtype), self._device),
            self.initial.treedef.unflatten(self.initial.leaves),
        )
        state, _ = get_or_create(state, self.batch_id)
        state = put(state, self.batch_id, self.name, PytreeValue.create(stacked))
        return set_attr(state, self.batch_id, SLOTS, SlotMap.empty(self.capacity))

    def _write(self, state: ManagerState, slots: SlotMap, fn: Any, *args: Any) -> ManagerState:
        state = _step(state, self.batch_id, self.name, fn, *args, donate=True)
        return set_attr(state, self.batch_id, SLOTS, slots)

    def _check_new(self, state: ManagerState, session_id: str, what: str) -> None:
        if not isinstance(session_id, str):
            raise InvalidArgumentError(
                f"`BatchedSessions.{what}`: session ids are str, got {type(session_id).__name__}."
            )
        if session_id == self.batch_id or self._parked_object(state, session_id) is not None:
            raise SessionExistsError(
                f"`BatchedSessions.{what}({session_id!r})`: the table holds a session {session_id!r} with "
                f"{self.name!r} already (a parked session, or the batch itself); `restore` a parked one instead, "
                f"or use another id."
            )

    def join(self, state: ManagerState, session_id: str) -> ManagerState:
        """The table with ``session_id`` in the lowest free slot, its rows the initial state (one slot written,
        donated: the input ``state`` is consumed, as by `functional_state.step`).

        Raises:
          SessionExistsError: the session is in the batch, or parked. SessionAdmissionError: no slot is free.
        """
        _, slots = self._batch(state, "join")
        self._check_new(state, session_id, "join")
        slots = slots.taken(session_id, "BatchedSessions.join", self.batch_id)
        slot = np.int32(slots.slots[session_id])
        return self._write(state, slots, self._kernels.write, self._initial_row, slot)

    def leave(self, state: ManagerState, session_id: str) -> ManagerState:
        """The table with ``session_id``'s slot free (its rows are dropped, never read again).

        Raises:
          SessionStateLostError, ObjectParkedError: the session is not in a slot.
        """
        _, slots = self._batch(state, "leave")
        self._slot_of(state, slots, session_id, "leave")
        return set_attr(state, self.batch_id, SLOTS, slots.without(session_id))

    def fork(self, state: ManagerState, source_id: str, new_id: str) -> ManagerState:
        """The table with ``new_id`` in a free slot, its rows a copy of ``source_id``'s (donated write).

        Raises:
          SessionStateLostError, ObjectParkedError: the source is not in a slot.
          SessionExistsError: ``new_id`` exists. SessionAdmissionError: no slot is free.
        """
        _, slots = self._batch(state, "fork")
        source = self._slot_of(state, slots, source_id, "fork")
        self._check_new(state, new_id, "fork")
        slots = slots.taken(new_id, "BatchedSessions.fork", self.batch_id)
        return self._write(state, slots, self._kernels.copy, np.int32(source), np.int32(slots.slots[new_id]))

    def park(self, state: ManagerState, session_id: str) -> ManagerState:
        """The table with ``session_id``'s rows copied into a session of its own, parked on the host (as the
        unbatched path parks a session's `PytreeValue`), and its slot free.

        Raises:
          SessionStateLostError, ObjectParkedError: the session is not in a slot.
          SessionAdmissionError: the table has no room for one more session (it would evict one).
          SessionExistsError: the table has a session ``session_id`` already (holding other state).
        """
        stacked, slots = self._batch(state, "park")
        slot = self._slot_of(state, slots, session_id, "park")
        if session_id in state:
            raise SessionExistsError(
                f"`BatchedSessions.park({session_id!r})`: the table has another session {session_id!r}; the "
                f"parked rows need a session of their own. Drop that session, or `leave` this one."
            )
        if len(state) >= state.max_sessions:
            raise SessionAdmissionError(
                f"`BatchedSessions.park({session_id!r})`: the table is full ({len(state)} of "
                f"{state.max_sessions} sessions), and a parked session is a session of its own; raise the cap "
                f"(`raise_max_sessions`) or drop a session first."
            )
        row = self._kernels.read(stacked.leaves, np.int32(slot))
        state, _ = get_or_create(state, session_id)
        state = put(state, session_id, self.name, PytreeValue.create(self.initial.treedef.unflatten(row)))
        state, _ = _park_object(state, session_id, self.name)
        return set_attr(state, self.batch_id, SLOTS, slots.without(session_id))

    def restore(self, state: ManagerState, session_id: str) -> ManagerState:
        """The table with session ``session_id`` of the table (parked by `park`, or any session holding this
        model's state under ``name``: loaded from a checkpoint, imported) moved into the lowest free slot, bit
        for bit, and dropped as a session of its own (its attrs with it). Donated write: ``state`` is consumed.

        Raises:
          SessionStateLostError, ObjectNotFoundError: no such session, or it holds no ``name``.
          InvalidArgumentError: its state has another layout than this model's, or it holds other objects.
          SessionExistsError: it is in the batch already. SessionAdmissionError: no slot is free.
        """
        _, slots = self._batch(state, "restore")
        if session_id in slots.slots:
            slots.taken(session_id, "BatchedSessions.restore", self.batch_id)  # raises: in the batch already
        session = lookup(state, session_id)
        obj = session.get(self.name, None)
        if obj is None or session_id == self.batch_id:
            raise ObjectNotFoundError(
                f"`BatchedSessions.restore({session_id!r})`: the session holds no {self.name!r} to restore."
            )
        check_layout(obj, self.initial, "BatchedSessions.restore")
        if len(session.names) != 1:
            raise InvalidArgumentError(
                f"`BatchedSessions.restore({session_id!r})`: the session holds {session.names}, not only "
                f"{self.name!r}; a batch slot holds {self.name!r} alone. Move the other objects out first."
            )
        slots = slots.taken(session_id, "BatchedSessions.restore", self.batch_id)
        row = jax.device_put((obj.restore() if obj.parked else obj).leaves, self._device)
        state, _ = drop_session(state, session_id)
        return self._write(state, slots, self._kernels.write, row, np.int32(slots.slots[session_id]))

    def step(self, state: ManagerState, session_ids: Sequence[str], *args: Any) -> tuple[ManagerState, Any]:
        """Step the sessions ``session_ids`` in one jitted, donated call; returns ``(state, outputs)``.

        Every argument and output has a leading ``capacity`` axis, one row per slot (`inputs` lays them out;
        `slot` finds a session's row); rows of slots not stepped are ignored on input and zero on output.
        The input ``state`` is consumed (see `functional_state.step`). Which slots step is data: any subset,
        any order, one trace.

        Raises:
          InvalidArgumentError: an id repeats. SessionStateLostError: a session is not in the batch.
          ObjectParkedError: a session is parked. StateShapeError: an argument's leading axis is not capacity.
        """
        _, slots = self._batch(state, "step")
        ids = tuple(session_ids)
        cached_ids, cached_slots, index, count = self._index
        if ids != cached_ids or slots is not cached_slots:
            if len(set(ids)) != len(ids):
                raise InvalidArgumentError(f"`BatchedSessions.step`: session_ids repeat an id: {list(ids)!r}.")
            taken = [self._slot_of(state, slots, sid, "step") for sid in ids]
            host = np.zeros(self.capacity, np.int32)
            host[: len(taken)] = taken
            index, count = jnp.asarray(host), jnp.asarray(np.int32(len(taken)))
            self._index = (ids, slots, index, count)
        for leaf in jax.tree_util.tree_leaves(args):
            if np.shape(leaf)[:1] != (self.capacity,):
                raise StateShapeError(
                    f"`BatchedSessions.step`: every argument has a leading axis of {self.capacity} (one row per "
                    f"slot), got shape {np.shape(leaf)}; lay inputs out with `inputs(state, {{sid: x}})`."
                )
        return _step(
            state,
            self.batch_id,
            self.name,
            self._kernels.step,
            self.params,
            index,
            count,
            *args,
            donate=True,
            has_aux=True,
        )

    def fit(self, state: ManagerState, max_nbytes: int | str) -> tuple[ManagerState, list[str]]:
        """Park sessions, the earliest to have come in first, until the rows in slots hold at most
        ``max_nbytes`` (an int, or a size such as ``"2 MiB"``); returns ``(state, parked ids)``. Parking frees
        slots, not device memory: the stacked buffers keep their size.

        Raises:
          InvalidArgumentError: ``max_nbytes`` is not a size. And as `park`.
        """
        _, slots = self._batch(state, "fit")
        max_nbytes = parse_bytes(max_nbytes, "BatchedSessions.fit: max_nbytes")
        parked: list[str] = []
        for sid in list(slots.slots):
            if (len(slots.slots) - len(parked)) * self.row_nbytes <= max_nbytes:
                break
            state = self.park(state, sid)
            parked.append(sid)
        return state, parked
