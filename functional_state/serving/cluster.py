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

from ..errors import InvalidArgumentError
from ..persist.paths import child
from ..transfer.placement import Placement
from .moves import drain_target, held, rebalance_move

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

    def step(self, sid: str, *args: Any) -> Any:
        """One step of ``sid`` on its owner."""
        name, epoch = self.owners[sid]
        return self._get(self.replicas[name].step.remote(sid, epoch, *args))

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
