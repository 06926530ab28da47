"""A replica's spill lever: a session its byte budget would drop goes to a peer with headroom, else to Ray's
object store, before it is dropped.

`ReplicaSpill` is the ``spill`` callback a `SessionReplica` (and so a `SessionServer`) gives its manager
(`SessionStateManager(spill=)`, see `shell.spill`). Offered a session, it exports it from the table the write
would install over (`export_session`, at the session's epoch) and:

1. hands it to the peer with the most headroom that fits it (`moves.drain_target`'s rule, on the peers'
   placement figures), through the same ``accept`` a move uses: the peer claims it at the next epoch;
2. failing that (no peer fits, the peer refused or did not answer), puts the blob in Ray's object store,
   where a driver picks it up (`SessionReplica.spilled`) and has a replica ``accept`` it;
3. failing both, declines: the manager's budget then keeps the session while anything else can go, and
   drops it only as a last resort (`enforce_budget`).

Each spilled session is recorded in `SessionReplica.spilled` (`Spilled`: where it went and at which epoch),
so a caller that still routes to this replica learns where to go (`StaleEpochError` names it). The peers are
a small protocol (`Peers`): `ActorPeers` for replicas that are Ray actors, the Serve deployment handle for
`SessionServer` (`server.ServePeers`). A peer is asked while the write that spills waits: run actor replicas
with ``max_concurrency >= 2`` so that two replicas spilling to each other at once do not wait on each other
(the calls also time out, ``timeout_s``, and a timed-out spill falls through to the object store).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .. import table as ms
from ..table.manager_state import ManagerState
from ..table.ownership import session_epoch
from ..transfer.exporting import export_session
from ..transfer.placement import Placement, placement
from .moves import roomiest

if TYPE_CHECKING:
    from .replica import SessionReplica

__all__ = ["OBJECT_STORE", "ActorPeers", "Peers", "ReplicaSpill", "ServePeers", "Spilled", "Store", "object_store"]

_log = logging.getLogger("functional_state")

OBJECT_STORE = "object store"  # `Spilled.to` for a session put in Ray's object store


class Spilled(NamedTuple):
    """Where a spilled session went: ``to`` a peer replica (claimed there at ``epoch``) or the object store
    (``to == "object store"``: ``parts`` are the object refs of its manifest and buffers, exported at
    ``epoch``; ``accept`` them on a replica to take the session up)."""

    to: str
    epoch: int
    parts: tuple[Any, Any] | None = None
    at: float = 0.0  # when (wall clock): a replica publishes a tombstone for the session from then


class Peers(Protocol):
    """The replicas a spilling replica may hand a session to."""

    def figures(self) -> Mapping[str, Placement]:
        """Each peer's placement figures, by name."""
        ...

    def accept(self, peer: str, sid: str, manifest: bytes, buffers: list[Any], epoch: int) -> int:
        """Have ``peer`` take up the session exported at ``epoch``; its new epoch there."""
        ...


class ActorPeers:
    """`Peers` that are Ray actors running `SessionReplica` (``{name: actor handle}``), asked with a timeout."""

    def __init__(self, handles: Mapping[str, Any], timeout_s: float = 30.0):
        self.handles, self.timeout_s = dict(handles), timeout_s

    def figures(self) -> dict[str, Placement]:
        import ray

        names = list(self.handles)
        got = ray.get([self.handles[n].placement.remote() for n in names], timeout=self.timeout_s)
        return dict(zip(names, got))

    def accept(self, peer: str, sid: str, manifest: bytes, buffers: list[Any], epoch: int) -> int:
        import ray

        ref = self.handles[peer].accept.remote(manifest, buffers, epoch, expect=sid)
        return int(ray.get(ref, timeout=self.timeout_s))


class ServePeers:
    """`Peers` that are the other replicas of the Serve deployment running this `SessionServer` (named
    ``name``), reached through the deployment's own handle (``replica=<id>`` requests; the blob goes through
    Ray's object store as a request argument). Asked from a replica's request thread (Serve runs sync methods
    in a thread pool), with a timeout."""

    def __init__(self, name: str, timeout_s: float = 30.0):
        self.name, self.timeout_s = name, timeout_s
        self._fleet: Any = None

    def _handle(self) -> Any:
        if self._fleet is None:
            from ray import serve

            from .fleet import SessionFleet

            ctx = serve.get_replica_context()
            self._fleet = SessionFleet(serve.get_deployment_handle(ctx.deployment, ctx.app_name))
        return self._fleet.handle

    def figures(self) -> dict[str, Placement]:
        handle = self._handle()
        names = [n for n in self._fleet.replicas() if n != self.name]
        calls = [handle.figures.remote(replica=n) for n in names]
        return {n: call.result(timeout_s=self.timeout_s) for n, call in zip(names, calls)}

    def accept(self, peer: str, sid: str, manifest: bytes, buffers: list[Any], epoch: int) -> int:
        exported = (manifest, buffers, epoch, self.name)
        call = self._handle().accept.remote(sid, exported, replica=peer)
        return int(call.result(timeout_s=self.timeout_s)[0])


def object_store(manifest: bytes, buffers: list[Any]) -> tuple[Any, Any] | None:
    """Put a blob's parts in Ray's object store: their refs, or None where Ray is not running here."""
    try:
        import ray
    except ImportError:  # pragma: no cover - the [ray] extra is missing
        return None
    if not ray.is_initialized():
        return None
    return ray.put(manifest), ray.put(buffers)


Store = Callable[[bytes, list[Any]], "tuple[Any, Any] | None"]


class ReplicaSpill:
    """The spill callback of one replica's manager (see the module docstring).

    Args:
      replica: the replica whose sessions it spills (its name, hooks, peers and `spilled` record).
      store: where a session no peer takes goes (default: Ray's object store, when Ray runs here); returns
        the parts' refs, or None to decline.
    """

    def __init__(self, replica: SessionReplica, store: Store | None = object_store):
        self.replica, self.store = replica, store

    def __call__(self, table: ManagerState, sid: str) -> bool:
        replica = self.replica
        epoch = int(session_epoch(ms.lookup(table, sid).attrs))
        blob = export_session(table, sid, epoch=epoch, **replica.hooks)
        manifest, buffers = blob.manifest_bytes(), list(blob.buffers)
        peer = self._peer(table, sid)
        if peer is not None:
            try:
                claimed = replica.peers.accept(peer, sid, manifest, buffers, epoch)  # type: ignore[union-attr]
            except Exception:
                _log.warning("%s: spilling session %r to %r failed", replica.name, sid, peer, exc_info=True)
            else:
                replica.note_spilled(sid, Spilled(peer, claimed, None, time.time()))
                _log.info("%s: spilled session %r to %r (epoch %d)", replica.name, sid, peer, claimed)
                return True
        parts = self.store(manifest, buffers) if self.store is not None else None
        if parts is None:
            return False
        replica.note_spilled(sid, Spilled(OBJECT_STORE, epoch, parts, time.time()))
        _log.info("%s: spilled session %r to the object store (epoch %d)", replica.name, sid, epoch)
        return True

    def _peer(self, table: ManagerState, sid: str) -> str | None:
        """The peer with the most headroom that fits ``sid``, or None (no peers, none answers, none fits)."""
        peers = self.replica.peers
        if peers is None:
            return None
        try:
            figures = {n: f for n, f in peers.figures().items() if n != self.replica.name}
        except Exception:
            _log.warning("%s: the peers' figures could not be read", self.replica.name, exc_info=True)
            return None
        return roomiest(figures, placement(table).sessions[sid])
