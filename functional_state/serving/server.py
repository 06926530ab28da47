"""`SessionServer`: the class a Ray Serve deployment of session-holding replicas runs.

Each Serve replica owns one `SessionReplica` (a manager and the model's step). Serve's router
(`SessionAffinityRouter`) sends every request for a session to the replica that holds it; a replica asked for
a session it does not hold was chosen by placement, so it takes the session up itself: from the session's last
checkpoint when there is one (a failover: the replay hook brings it from the checkpoint's step to the step the
request is for), else as a new session. Every ``save_every`` steps it checkpoints the session, so a failover
replays at most that many steps. It publishes what it holds to the routers (``record_routing_stats``).

Moves (drain, rebalance: `SessionFleet`) go through the same deployment handle: ``export`` on the holder
(which then refuses steps of that session until the move ends), ``accept`` on the target (the blob's buffers
come through Ray's object store, never through the driver), ``release`` on the source.

A session leaving a replica (moved, or spilled under budget pressure with ``spill=True``: to a peer with
headroom, through ``accept``) leaves a tombstone: for ``tombstone_s`` the replica publishes it (so every router
follows the move at its next figures, `routing.choose`) and refuses a request for that session with
`StaleEpochError` (retry) rather than taking it up from an older checkpoint beside its new holder.

The class imports no Ray: the same object serves in-process in tests (``name=`` stands for the replica id
Serve gives it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from ..errors import InvalidArgumentError, StaleEpochError
from ..persist.directory import has_checkpoint
from ..persist.paths import child
from .replica import SessionReplica, Step
from .routing import published
from .spill import ServePeers

__all__ = ["Reply", "SessionServer"]

Replay = Callable[[str, int, int], Iterable[Sequence[Any]]]  # replay(sid, from, to) -> the args of steps from..to-1


class Reply(NamedTuple):
    """A step's answer: the model's output, the replica that served it and the session's step count after it."""

    output: Any
    replica: str
    step: int


class SessionServer:
    """One Serve replica's sessions (see the module docstring).

    Args:
      model: the model identity sessions carry; a blob or checkpoint of another model is refused.
      step: ``step(handle, *args) -> output``, one model step of one session through its handle.
      checkpoints: a directory or a URL (anything ``etils.epath`` opens) under which each session's
        checkpoint lives, at ``<checkpoints>/<session id>``.
      init: ``init(handle)``, what a new session holds before its first step.
      replay: ``replay(session_id, from_step, to_step)``: after a failover resumed a session at ``from_step``
        and a request for step ``to_step`` arrives, the arguments of the steps in between (one sequence per
        step, from the caller's request log), which the server steps again; without it such a request is
        refused.
      save_every: checkpoint a session every this many steps (0: only on `save`).
      name: the replica's id when not run by Serve.
      spill: under budget pressure, hand a session the budget would drop to another replica of the deployment
        with headroom (`serving.spill.ServePeers`) before it is dropped; one no replica takes stays while
        anything else can go (`enforce_budget`). A session spilled, or dropped as the last resort, resumes
        from its checkpoint where a request for it is placed next.
      tombstone_s: for how long a session that left is published as gone and refused here.
      hooks, **manager: as `SessionReplica` (``byte_budget``, ``attr_hooks``, ``object_hooks``).

    Example (in-process; ``serve.deployment(SessionServer, request_router_config=session_router_config())``
    runs it as replicas):
      >>> import numpy as np, tempfile, functional_state as fs
      >>> def init(h): h.put("ring", fs.LatentBuffer.create(maxlen=2))
      >>> def step(h, x): h.commit("ring", np.full(2, x)); return x
      >>> server = SessionServer(model="wm@1", step=step, init=init, checkpoints=tempfile.mkdtemp(), name="r0")
      >>> server.step("robot", 1.0), server.step("robot", 2.0, at=1).step
      (Reply(output=1.0, replica='r0', step=1), 2)
    """

    def __init__(
        self,
        *,
        model: str,
        step: Step,
        checkpoints: Any,
        init: Callable[[Any], Any] | None = None,
        replay: Replay | None = None,
        save_every: int = 0,
        name: str | None = None,
        spill: bool = False,
        tombstone_s: float = 10.0,
        hooks: dict[str, Any] | None = None,
        **manager: Any,
    ):
        if not isinstance(save_every, int) or save_every < 0:
            raise InvalidArgumentError(f"`SessionServer`: save_every must be an int >= 0, got {save_every!r}.")
        self.name = name or _serve_replica_id()
        self.replica = SessionReplica(
            self.name, model=model, step=step, init=init, hooks=hooks, spill=spill, spill_store=None, **manager
        )
        if spill:
            self.replica.connect(ServePeers(self.name))
        self.checkpoints, self.replay, self.save_every = checkpoints, replay, save_every
        self.tombstone_s = tombstone_s
        self.leaving: set[str] = set()  # sessions exported for a move: no step here until the move ends
        self.claimed: dict[str, float] = {}  # session id -> when this replica took it up (published)
        self.released: dict[str, tuple[int, float]] = {}  # session id -> (epoch, when) it was moved away
        self.replayed: dict[str, int] = {}  # session id -> steps replayed when it was last taken up here
        self._arrivals = threading.Lock()  # (Serve runs a replica's requests on threads)

    def checkpoint(self, session_id: str) -> Any:
        """Where ``session_id``'s checkpoint lives."""
        return child(self.checkpoints, session_id)

    def _epoch(self, sid: str) -> int:
        return self.replica.epoch(sid)

    def _arrive(self, sid: str) -> None:
        """Take up ``sid``, which this replica does not hold: from its last checkpoint, or new."""
        with self._arrivals:
            if sid in self.replica.manager:
                return
            # A complete checkpoint resumes (and one that fails its checks raises); none at all, or only a save
            # that never completed, leaves nothing to resume: the session starts anew, and a request for a
            # later step is replayed from step 0.
            if has_checkpoint(self.checkpoint(sid)):
                self.replica.resume(sid, self.checkpoint(sid))
            else:
                self.replica.open(sid)
            self._claimed(sid)

    def _claimed(self, sid: str) -> None:
        self.claimed[sid] = time.time()
        self.released.pop(sid, None)

    def tombstones(self) -> dict[str, tuple[int, float]]:
        """``{session id: (epoch, when)}`` of the sessions that left this replica within ``tombstone_s``
        (moved away, or spilled), and not back since."""
        cutoff = time.time() - self.tombstone_s
        for sid, (_, at) in list(self.released.items()):
            if at < cutoff:
                del self.released[sid]
        out = dict(self.released)
        for sid, went in list(self.replica.spilled.items()):
            if went.at >= cutoff and sid not in self.replica.manager:
                out[sid] = (went.epoch, went.at)
        return out

    def _check_not_gone(self, sid: str) -> None:
        gone = self.tombstones().get(sid)
        if gone is not None:
            went = self.replica.where(sid)
            where = f" to {went.to!r}" if went is not None else ""
            raise StaleEpochError(
                f"{self.name}: session {sid!r} left this replica{where} {time.time() - gone[1]:.1f} s ago (epoch "
                f"{gone[0]}); retry the request: the routers follow it once its figures are published."
            )

    def step(self, session_id: str, *args: Any, at: int | None = None) -> Reply:
        """One step of ``session_id`` (taken up here first if this replica does not hold it).

        Args:
          at: the step index this request is (the client's count, from 0): a session behind it (resumed from
            an older checkpoint) is replayed up to it first; a session past it refuses (a repeated request).
        """
        sid = session_id
        if sid in self.leaving:
            raise StaleEpochError(f"{self.name}: session {sid!r} is being moved off this replica; retry the request.")
        if sid not in self.replica.manager:
            self._check_not_gone(sid)
            self._arrive(sid)
        if at is not None:
            self._catch_up(sid, at)
        out = self.replica.step(sid, self._epoch(sid), *args)
        done = self.replica.steps(sid)
        if self.save_every and done % self.save_every == 0:
            self.save(sid)
        return Reply(out, self.name, done)

    def _catch_up(self, sid: str, at: int) -> None:
        done = self.replica.steps(sid)
        if done > at:
            raise InvalidArgumentError(
                f"{self.name}: session {sid!r} has taken {done} steps; a request for step {at} was already served."
            )
        if done < at:
            if self.replay is None:
                raise InvalidArgumentError(
                    f"{self.name}: session {sid!r} resumed from its checkpoint at step {done}, and the request is for "
                    f"step {at}: resubmit steps {done}..{at - 1} first, or give `SessionServer` a replay hook."
                )
            replayed = [tuple(args) for args in self.replay(sid, done, at)]
            if len(replayed) != at - done:
                raise InvalidArgumentError(
                    f"{self.name}: the replay hook gave {len(replayed)} steps of session {sid!r}, and steps "
                    f"{done}..{at - 1} ({at - done}) are missing; nothing was replayed."
                )
            for args in replayed:
                self.replica.step(sid, self._epoch(sid), *args)
            self.replayed[sid] = len(replayed)

    def save(self, session_id: str) -> int:
        """Checkpoint ``session_id`` (fenced: refused if another owner saved a newer epoch); the step saved."""
        return self.replica.save(session_id, self._epoch(session_id), self.checkpoint(session_id))

    def export(self, session_id: str, *, replica: str | None = None) -> tuple[bytes, list[Any], int, str]:
        """``(manifest, buffers, epoch, this replica)`` of ``session_id``, for `accept` on another replica;
        steps of the session are refused here until `release` or `abort_move`."""
        self._check_directed(replica)
        epoch = self._epoch(session_id)
        manifest, buffers = self.replica.export(session_id, epoch)
        self.leaving.add(session_id)
        return manifest, buffers, epoch, self.name

    def accept(
        self, session_id: str, exported: tuple[bytes, list[Any], int, str], *, replica: str | None = None
    ) -> tuple[int, str, int]:
        """Take up a session `export` gave; returns ``(its new epoch, the source replica, the source's epoch)``."""
        self._check_directed(replica)
        manifest, buffers, epoch, source = exported
        new_epoch = self.replica.accept(manifest, buffers, epoch, expect=session_id)
        self._claimed(session_id)
        return new_epoch, source, epoch

    def release(self, session_id: str, epoch: int, *, replica: str | None = None) -> bool:
        """Drop this replica's copy of a session moved away at ``epoch``."""
        self._check_directed(replica)
        self.leaving.discard(session_id)
        gone = self.replica.release(session_id, epoch)
        if gone:
            self.claimed.pop(session_id, None)
            self.released[session_id] = (epoch, time.time())
        return gone

    def abort_move(self, session_id: str, *, replica: str | None = None) -> None:
        """End a move that failed: the session is served here again."""
        self._check_directed(replica)
        self.leaving.discard(session_id)

    def figures(self, *, replica: str | None = None) -> Any:
        """This replica's placement figures (`transfer.placement`)."""
        self._check_directed(replica)
        return self.replica.placement()

    def replays(self, *, replica: str | None = None) -> dict[str, int]:
        """``{session id: steps replayed}`` for each session taken up here from a checkpoint behind its request."""
        self._check_directed(replica)
        return dict(self.replayed)

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve publishes to the routers: the sessions held here (with when they were claimed), the
        tombstones of those that left lately, headroom and bytes held."""
        return published(self.replica.placement(), claimed=self.claimed, released=self.tombstones())

    def _check_directed(self, replica: str | None) -> None:
        if replica is not None and replica != self.name:
            raise InvalidArgumentError(f"a request for replica {replica!r} reached replica {self.name!r}.")


def _serve_replica_id() -> str:
    """The id Serve gave this replica (what its router sees)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception as e:  # not inside a Serve replica
        raise InvalidArgumentError(
            "`SessionServer`: outside a Ray Serve replica, pass name= (the replica's id)."
        ) from e
