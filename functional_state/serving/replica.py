"""`SessionReplica`: what one serving replica does with its sessions, as plain methods a Ray actor exposes.

A replica owns one `SessionStateManager` and the model's step. Every call that reads or writes a session
names the epoch the caller holds it at (a router's record, `SessionCluster`), and a replica whose copy is at
another epoch refuses (`StaleEpochError`): a superseded owner cannot step, export or save. Sessions leave as
transfer blobs (`export`: the manifest as JSON text and the buffers as numpy arrays, which Ray's object
store carries without pickling the bytes and reads in place on the receiving node) and arrive through
`accept`, which checks the blob whole before it builds anything and claims the session at the next epoch.

With ``spill=True`` its manager's byte budget hands a session it would drop to a peer with headroom, else
to Ray's object store (`serving.spill`), and records where it went (`spilled`, `where`); tell it its peers
with `connect`.

Run it as an actor: ``ray.remote(SessionReplica).remote("r0", model="wm@1", step=my_step)``; the class
itself imports no Ray, so the same object is tested in-process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import StaleEpochError, TransferError
from ..persist.info import checkpoint_info
from ..shell.manager import SessionStateManager
from ..table.ownership import check_epoch, claimed, session_epoch
from ..transfer.blob import SessionBlob
from ..transfer.exporting import export_session
from ..transfer.importing import read_blob
from ..transfer.placement import Placement, placement
from .spill import ActorPeers, Peers, ReplicaSpill, Spilled, Store, object_store

__all__ = ["STEP_ATTR", "SessionReplica"]

STEP_ATTR = "step"  # the attr a replica counts each session's steps in (what a checkpoint's metadata names)

Step = Callable[..., Any]  # step(handle, *args) -> output: one model step of one session, through its handle


class SessionReplica:
    """One replica: a manager, the model's step, and the verbs a router calls on it.

    Args:
      name: the replica's name (in errors and figures).
      model: the model identity its sessions carry; a blob of another model is refused.
      step: ``step(handle, *args) -> output``, one step of a session through its `SessionHandle`; the replica
        counts steps in the session's ``"step"`` attr around it.
      init: ``init(handle)``, what a new session holds before its first step.
      hooks: ``attr_hooks`` / ``object_hooks`` for saves and transfers (engine KV, say).
      spill: under budget pressure, hand a session the budget would drop to a peer (`connect`) with headroom,
        else to ``spill_store`` (Ray's object store; None: none), before it is dropped (`serving.spill`).
      **manager: `SessionStateManager` arguments (``byte_budget``, ``max_sessions``).

    Example (in-process; ``ray.remote(SessionReplica)`` makes the same class an actor):
      >>> import numpy as np, functional_state as fs
      >>> def init(h): h.put("ring", fs.LatentBuffer.create(maxlen=2))
      >>> def step(h, x): h.commit("ring", np.full(2, x)); return x
      >>> a, b = (SessionReplica(n, model="wm@1", step=step, init=init) for n in ("a", "b"))
      >>> epoch = a.open("s"); a.step("s", epoch, 1.0)
      1.0
      >>> moved = b.accept(*a.export("s", epoch), epoch); a.release("s", epoch)
      True
      >>> moved, b.steps("s"), [x.tolist() for x in fs.view(b.manager.state, "s", "ring")]
      (2, 1, [[1.0, 1.0]])
    """

    def __init__(
        self,
        name: str,
        *,
        model: str,
        step: Step,
        init: Callable[[Any], Any] | None = None,
        hooks: dict[str, Any] | None = None,
        spill: bool = False,
        spill_store: Store | None = object_store,
        **manager: Any,
    ):
        self.name, self.model, self._step, self._init = name, model, step, init
        self.hooks = dict(hooks or {})
        self.peers: Peers | None = None
        self.spilled: dict[str, Spilled] = {}  # session id -> where the budget's spill lever sent it
        self.manager = SessionStateManager(**manager, spill=ReplicaSpill(self, spill_store) if spill else None)
        self.saved: dict[str, int] = {}  # session id -> the step of its last save from here

    def connect(self, peers: Mapping[str, Any] | Peers, timeout_s: float = 30.0) -> None:
        """The replicas a spill may hand sessions to: ``{name: actor handle}`` (`ActorPeers`) or any `Peers`
        (this replica's own name among them is skipped)."""
        self.peers = ActorPeers(peers, timeout_s) if isinstance(peers, Mapping) else peers

    def note_spilled(self, sid: str, where: Spilled) -> None:
        """Record that the spill lever sent ``sid`` ``where`` (its copy here leaves with the write)."""
        self.spilled[sid] = where
        self.saved.pop(sid, None)

    def where(self, sid: str) -> Spilled | None:
        """Where the spill lever sent ``sid`` (None: it did not, or the session came back since)."""
        return None if sid in self.manager else self.spilled.get(sid)

    def _arrived(self, sid: str) -> None:
        self.spilled.pop(sid, None)

    def _owned(self, sid: str, epoch: int | None, what: str) -> Any:
        gone = self.where(sid)
        if gone is not None:
            raise StaleEpochError(
                f"{self.name}: `{what}`: session {sid!r} was spilled under budget pressure to {gone.to!r} at epoch "
                f"{gone.epoch}; ask `where` (or the router) and send it there."
            )
        check_epoch(self.manager.state, sid, epoch, f"{self.name}: {what}")
        return self.manager.get_session(sid)

    def open(self, sid: str, above: int = 0) -> int:
        """Create session ``sid`` here and claim it; returns its epoch."""
        handle = self.manager.get_or_create_session(sid)
        self._arrived(sid)
        if self._init is not None:
            self._init(handle)
        handle.transact(lambda s: claimed(s, model=self.model, above=above, sid=sid).set_attr(STEP_ATTR, 0))
        return int(session_epoch(handle.state.attrs))

    def step(self, sid: str, epoch: int, *args: Any) -> Any:
        """One step of ``sid`` (owned at ``epoch``): the model's output."""
        handle = self._owned(sid, epoch, "step")
        out = self._step(handle, *args)
        handle.set_attr(STEP_ATTR, handle.get_attr(STEP_ATTR, 0) + 1)
        return out

    def epoch(self, sid: str) -> int:
        """The epoch this replica holds ``sid`` at."""
        return int(session_epoch(self.manager.get_session(sid).state.attrs))

    def steps(self, sid: str) -> int:
        """How many steps ``sid`` has taken (its ``"step"`` attr)."""
        return int(self.manager.get_session(sid).get_attr(STEP_ATTR, 0))

    def save(self, sid: str, epoch: int, path: Any) -> int:
        """Checkpoint ``sid`` to ``path`` (refused if this copy is stale, or the checkpoint there is newer);
        returns the step saved."""
        handle = self._owned(sid, epoch, "save")
        step = int(handle.get_attr(STEP_ATTR, 0))
        self.manager.save_session(sid, path, **self.hooks)
        self.saved[sid] = step
        return step

    def export(self, sid: str, epoch: int) -> tuple[bytes, list[Any]]:
        """``(manifest JSON, buffers)`` of ``sid``: what `accept` takes on another replica."""
        blob = export_session(self.manager.state, sid, epoch=epoch, **self.hooks)
        return blob.manifest_bytes(), list(blob.buffers)

    def accept(self, manifest: bytes, buffers: list[Any], epoch: int, expect: str | None = None) -> int:
        """Import a session another replica exported at ``epoch`` and claim it here; returns its new epoch.
        ``expect``: the session id the caller means to move (a blob of another session is refused)."""
        blob = SessionBlob.from_parts(manifest, buffers)
        if expect is not None and blob.session_id != expect:
            raise TransferError(
                f"{self.name}: `accept` was asked for session {expect!r} and given a blob of {blob.session_id!r}; "
                f"nothing was imported. Pass the blob `export` gave for {expect!r}."
            )
        sid, session = read_blob(
            blob,
            epoch=epoch,
            model=self.model,
            free_in=self.manager.state,
            **self.hooks,
        )
        handle = self.manager.install_session(sid, session)
        self._arrived(sid)
        handle.transact(lambda s: claimed(s, model=self.model, above=epoch, sid=sid))
        return int(session_epoch(handle.state.attrs))

    def release(self, sid: str, epoch: int) -> bool:
        """Drop this replica's copy of ``sid`` (after a move: it is at ``epoch``, the one it was exported at)."""
        if sid not in self.manager:
            return False
        self._owned(sid, epoch, "release")
        self.saved.pop(sid, None)
        return self.manager.drop_session(sid)

    def resume(self, sid: str, path: Any, above: int = 0) -> tuple[int, int]:
        """Load ``sid`` from its checkpoint at ``path`` (a failover) and claim it past both the checkpoint's
        epoch and ``above``; returns ``(epoch, the step it resumes from)``."""
        info = checkpoint_info(path).sessions.get(sid)
        if info is None:
            raise StaleEpochError(f"{self.name}: {path} holds no session {sid!r} to resume.")
        handle = self.manager.load_session(sid, path, **self.hooks)
        self._arrived(sid)
        top = max(above, info.epoch)
        handle.transact(lambda s: claimed(s, model=self.model, above=top, sid=sid))
        step = int(handle.get_attr(STEP_ATTR, 0))
        self.saved[sid] = step
        return int(session_epoch(handle.state.attrs)), step

    def placement(self) -> Placement:
        """This replica's placement figures (`transfer.placement`), with its last saved steps."""
        return placement(self.manager.state, saved=self.saved)

    def session_ids(self) -> list[str]:
        return list(self.manager.state.session_ids)
