"""`SessionCluster`: a driver's view of replicas that are Ray actors (`SessionReplica`): which replica owns each
session at which epoch, and the moves between them (a move, a failover from the last checkpoint with a replay
hook, a drain, a rebalance), each fenced by epochs.

Ray does the work: the replicas are actors, a blob's buffers go through the object store (an actor method
returning them puts them there once; the receiving actor reads them in place), and a killed actor surfaces as
Ray's `RayActorError`. This class keeps only the record a router needs: ``owners[sid] = (replica, epoch)``.
A move never drops a session: it is made only where the target has headroom for the session's bytes in every
pool it uses, and the source lets go of its copy only once the target has claimed it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidArgumentError, StaleEpochError
from ..persist.paths import child
from ..transfer.placement import Placement
from .moves import drain_target, held, rebalance_move
from .spill import OBJECT_STORE, Spilled

__all__ = ["SessionCluster"]

Replay = Callable[["SessionCluster", str, int], int]  # replay(cluster, sid, from_step) -> steps replayed


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - the [ray] extra is missing
        raise ImportError("functional_state.serving needs Ray: pip install 'functional-state[ray]'") from e
    return ray


class SessionCluster:
    """Sessions over replicas that are Ray actor handles of `SessionReplica`.

    Args:
      replicas: ``{name: actor handle}``.
      checkpoints: the directory under which each session's checkpoint lives (``<checkpoints>/<sid>``).
      replay: ``replay(cluster, sid, from_step) -> steps replayed``, called after a failover resumed ``sid``
        from its checkpoint at ``from_step``: it resubmits the requests since (`step`), from the caller's log.
    """

    def __init__(self, replicas: Mapping[str, Any], checkpoints: Any, *, replay: Replay | None = None):
        self.replicas = dict(replicas)
        self.checkpoints = checkpoints
        self.replay = replay
        self.owners: dict[str, tuple[str, int]] = {}  # sid -> (replica name, epoch)
        self.lost: list[str] = []  # sessions no replica could take (none so far, by construction)

    def path(self, sid: str) -> Any:
        return child(self.checkpoints, sid)

    def _get(self, ref: Any) -> Any:
        return _ray().get(ref)

    def figures(self) -> dict[str, Placement]:
        """Each live replica's placement figures."""
        names = list(self.replicas)
        return dict(zip(names, self._get([self.replicas[n].placement.remote() for n in names])))

    def open(self, sid: str, replica: str | None = None) -> str:
        """Create ``sid`` on ``replica`` (default: the one with the fewest bytes held); returns the replica."""
        if sid in self.owners:
            raise InvalidArgumentError(f"`SessionCluster.open`: session {sid!r} is open on {self.owners[sid][0]!r}.")
        if replica is None:
            figures = self.figures()
            replica = min(figures, key=lambda n: held(figures[n]))
        self.owners[sid] = (replica, self._get(self.replicas[replica].open.remote(sid)))
        return replica

    def connect(self) -> None:
        """Tell each replica the others, so that one created with ``spill=True`` hands a session its budget
        would drop to a peer with headroom (`serving.spill`)."""
        self._get([r.connect.remote(self.replicas) for r in self.replicas.values()])

    def step(self, sid: str, *args: Any) -> Any:
        """One step of ``sid`` on its owner (followed first if the owner's budget spilled it elsewhere)."""
        name, epoch = self.owners[sid]
        try:
            return self._get(self.replicas[name].step.remote(sid, epoch, *args))
        except StaleEpochError:
            if self.follow(sid) == (name, epoch):
                raise
        name, epoch = self.owners[sid]
        return self._get(self.replicas[name].step.remote(sid, epoch, *args))

    def follow(self, sid: str) -> tuple[str, int]:
        """Where ``sid`` lives now, after its owner's budget spilled it: the peer that took it, or, for a
        session put in the object store, the replica with the most headroom, which takes it up from there.
        Updates and returns ``owners[sid]`` (unchanged if its owner did not spill it)."""
        name, _ = self.owners[sid]
        went: Spilled | None = self._get(self.replicas[name].where.remote(sid))
        if went is None:
            return self.owners[sid]
        if went.to != OBJECT_STORE:
            self.owners[sid] = (went.to, went.epoch)
            return self.owners[sid]
        manifest, buffers = went.parts  # type: ignore[misc]
        figures = self.figures()
        # The blob stays in the store (its buffers never come through here): the replicas are asked in order
        # of headroom, and one without room for it refuses the import and is left unchanged.
        for to in sorted(figures, key=lambda n: (-_room(figures[n]), n)):
            try:
                claimed = int(self._get(self.replicas[to].accept.remote(manifest, buffers, went.epoch, sid)))
            except Exception:
                continue
            self.owners[sid] = (to, claimed)
            return self.owners[sid]
        raise InvalidArgumentError(
            f"`SessionCluster.follow`: session {sid!r} waits in the object store and no replica could take it up "
            f"(none has headroom for it); free room (drain, a larger budget) and call `follow({sid!r})` again."
        )

    def follow_all(self) -> dict[str, tuple[str, int]]:
        """`follow` every session; returns those whose owner changed, with their new owner and epoch."""
        before = dict(self.owners)
        for sid in sorted(self.owners):
            self.follow(sid)
        return {sid: o for sid, o in self.owners.items() if before.get(sid) != o}

    def save(self, sid: str) -> int:
        """Checkpoint ``sid`` from its owner; the step saved."""
        name, epoch = self.owners[sid]
        return int(self._get(self.replicas[name].save.remote(sid, epoch, self.path(sid))))

    def move(self, sid: str, to: str) -> int:
        """Move ``sid`` to replica ``to`` through the object store; returns its new epoch. The source keeps
        its copy until the target has claimed the session (a failed import leaves it where it was)."""
        name, epoch = self.owners[sid]
        if name == to:
            return epoch
        source, target = self.replicas[name], self.replicas[to]
        manifest, buffers = source.export.options(num_returns=2).remote(sid, epoch)
        new_epoch = int(self._get(target.accept.remote(manifest, buffers, epoch)))
        self.owners[sid] = (to, new_epoch)
        self._get(source.release.remote(sid, epoch))
        return new_epoch

    def failover(self, dead: str) -> dict[str, int]:
        """Resume every session replica ``dead`` owned on the others, each from its last checkpoint, then
        replay (``replay``); returns ``{sid: steps replayed}``. ``dead`` leaves the cluster."""
        self.replicas.pop(dead, None)
        replayed = {}
        for sid, (name, epoch) in sorted(self.owners.items()):
            if name != dead:
                continue
            figures = self.figures()
            to = min(figures, key=lambda n: held(figures[n]))
            new_epoch, step = self._get(self.replicas[to].resume.remote(sid, self.path(sid), epoch))
            self.owners[sid] = (to, int(new_epoch))
            replayed[sid] = self.replay(self, sid, int(step)) if self.replay is not None else 0
        return replayed

    def drain(self, name: str) -> list[str]:
        """Move every session off replica ``name`` to replicas with headroom for it; returns the ids that
        found none (they stay on ``name``, never dropped)."""
        stuck = []
        for sid in [s for s, (n, _) in self.owners.items() if n == name]:
            to = drain_target(self.figures(), sid, name)
            if to is None:
                stuck.append(sid)
            else:
                self.move(sid, to)
        return stuck

    def rebalance(self) -> int:
        """Move sessions from the replica holding the most bytes to the one holding the fewest while that
        narrows the gap; returns the number moved."""
        moved = 0
        for _ in range(len(self.owners)):  # (bounded: each move narrows the gap)
            step = rebalance_move(self.figures())
            if step is None:
                break
            self.move(step[0], step[2])
            moved += 1
        return moved


def _room(figures: Placement) -> float:
    rooms = [r for r in (figures.headroom(p) for p in figures.pools) if r is not None]
    return min(rooms) if rooms else float("inf")
