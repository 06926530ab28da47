"""`SessionFleet`: the operator's side of a Serve deployment of `SessionServer`: its replicas, their figures,
and the moves that drain a replica or rebalance bytes across them.

Every call goes through the deployment's own handle, so Serve's router (`SessionAffinityRouter`) routes it and
records where each session went: ``export`` reaches the session's holder by affinity, ``accept`` and
``release`` name their replica (``replica=<id>``). The exported blob is handed from one replica to the other as
a Serve response passed as an argument, so its buffers travel through Ray's object store, never through the
driver. The replica ids are the ones Serve gives (``serve.get_replica_context().replica_id``), listed from
Ray's named actors.
"""

from __future__ import annotations

from typing import Any

from ..transfer.placement import Placement
from .moves import drain_target, rebalance_move

__all__ = ["SessionFleet"]


class SessionFleet:
    """Drain and rebalance over a Serve deployment of `SessionServer` (``handle``: its `DeploymentHandle`).

    Example (a running deployment; see ``docs/api/serving.md``)::

        fleet = SessionFleet(handle)
        fleet.drain(fleet.replicas()[0])   # every session moved to replicas with headroom
        fleet.rebalance()
    """

    def __init__(self, handle: Any):
        self.handle = handle

    def replicas(self) -> list[str]:
        """The ids of the deployment's live replicas, sorted."""
        return sorted(rid.unique_id for rid in self._replica_ids())

    def _replica_ids(self) -> list[Any]:
        import ray
        from ray.serve.request_router import ReplicaID

        out = []
        for actor in ray.util.list_named_actors(all_namespaces=True):
            name = actor["name"]
            if actor["namespace"] == "serve" and ReplicaID.is_full_id_str(name):
                rid = ReplicaID.from_full_id_str(name)
                if (rid.deployment_id.name, rid.deployment_id.app_name) == (
                    self.handle.deployment_name,
                    self.handle.app_name,
                ):
                    out.append(rid)
        return out

    def actor(self, replica: str) -> Any:
        """The Ray actor behind replica ``replica`` (to kill one in a failover drill, say)."""
        import ray

        for rid in self._replica_ids():
            if rid.unique_id == replica:
                return ray.get_actor(rid.to_full_id_str(), namespace="serve")
        raise KeyError(replica)

    def figures(self) -> dict[str, Placement]:
        """Each live replica's placement figures."""
        names = self.replicas()
        calls = [self.handle.figures.remote(replica=n) for n in names]
        return {n: call.result() for n, call in zip(names, calls)}

    def replays(self) -> dict[str, dict[str, int]]:
        """Each live replica's ``{session id: steps replayed}`` (sessions it took up behind their requests)."""
        names = self.replicas()
        calls = [self.handle.replays.remote(replica=n) for n in names]
        return {n: call.result() for n, call in zip(names, calls)}

    def holder(self, sid: str) -> str | None:
        """The replica holding ``sid`` now (None: none)."""
        return next((n for n, f in self.figures().items() if sid in f.sessions), None)

    def move(self, sid: str, to: str) -> int:
        """Move ``sid`` to replica ``to``; returns its new epoch. The holder keeps its copy, and serves it again,
        unless the target took the session up."""
        exported = self.handle.export.remote(sid)  # (routed to the holder by affinity)
        try:
            epoch, source, old = self.handle.accept.remote(sid, exported, replica=to).result()
        except Exception:
            self._abort(exported, sid)
            raise
        self.handle.release.remote(sid, old, replica=source).result()
        return int(epoch)

    def _abort(self, exported: Any, sid: str) -> None:
        """After a failed move: the holder serves the session again (if the export itself failed, nothing
        was marked)."""
        try:
            source = exported.result()[3]
        except Exception:
            return
        self.handle.abort_move.remote(sid, replica=source).result()

    def drain(self, replica: str) -> list[str]:
        """Move every session off ``replica`` to the replicas with headroom for it; returns the ids that found
        none (they stay where they are, never dropped)."""
        stuck = []
        for sid in list(self.figures()[replica].sessions):
            to = drain_target(self.figures(), sid, replica)
            if to is None:
                stuck.append(sid)
            else:
                self.move(sid, to)
        return stuck

    def rebalance(self, limit: int = 1000) -> int:
        """Move sessions from the replica holding the most bytes to the one holding the fewest while that
        narrows the gap (at most ``limit`` moves); returns the number moved."""
        for moved in range(limit):
            step = rebalance_move(self.figures())
            if step is None:
                return moved
            self.move(step[0], step[2])
        return limit
