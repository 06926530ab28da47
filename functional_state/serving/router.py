"""`SessionAffinityRouter`: Ray Serve's request router for session servers, and `session_router_config`.

A Serve deployment of `SessionServer` routes through this class (``RequestRouterConfig(request_router_class=
SessionAffinityRouter)``): Serve calls `choose_replicas` for each request with the live replicas, each carrying
the figures its replica last published (``record_routing_stats``), and this class answers with the one replica
`routing.choose` picks. It never answers with a replica that does not hold the request's session while one
that does is alive, so a busy holder makes the request wait (Serve backs off and asks again) rather than go
elsewhere.

A request's session is Serve's own ``session_id`` (``handle.options(session_id=...)``, or the HTTP session
header) or else the method's first argument; a request naming ``replica=<id>`` (the moves of
`SessionFleet`) goes to that replica only, and fails at once if it is gone.

What a router knows is as fresh as its own record (the requests it routed, each with when) and the figures
Serve last broadcast (every ``request_routing_stats_period_s``). Two routers placing the same new session
within one period read the same figures and pick the same replica (placement is deterministic). A move made
through one router is seen by the others as soon as either replica publishes again: the old holder publishes
a tombstone for the session it let go of, the new holder its claim at a higher epoch, and `routing.choose`
prefers whichever is newer than its own record. Until then another router may still send a request to the
old holder, which refuses it (its tombstone: `StaleEpochError`, retry) rather than taking the session up from
its checkpoint. A replica that takes a session up claims it past its checkpoint's epoch, and the checkpoint
never goes back to a lower epoch (`persist.fencing`).
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..errors import InvalidArgumentError
from .routing import ReplicaStats, choose

__all__ = ["REPLICA_KWARG", "SessionAffinityRouter", "session_of", "session_router_config"]

REPLICA_KWARG = "replica"  # a request's keyword naming the one replica it is for

# Methods that leave a session where it is: routing them records nothing about where the session lives.
_NOT_PLACING = frozenset({"release", "abort_move", "figures", "replays", "session_ids"})


def session_of(request: PendingRequest) -> str | None:
    """The session a request is for: Serve's ``session_id`` option, else the method's first argument."""
    if request.metadata.session_id:
        return str(request.metadata.session_id)
    first = request.args[0] if request.args else request.kwargs.get("session_id")
    return first if isinstance(first, str) else None


class SessionAffinityRouter(RequestRouter):
    """Routes each request to the replica holding its session (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.placed: dict[str, tuple[str, float]] = {}  # session id -> (replica id it last sent it to, when)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        live = {r.replica_id.unique_id: r for r in candidate_replicas}
        directed = pending_request.kwargs.get(REPLICA_KWARG)
        stats = {uid: ReplicaStats.read(r.routing_stats) for uid, r in live.items()}
        chosen = choose(session_of(pending_request), stats, self.placed, directed=directed)
        if chosen is None:
            return [candidate_replicas]
        if chosen == "":
            if not pending_request.future.done():
                pending_request.future.set_exception(
                    InvalidArgumentError(
                        f"`SessionAffinityRouter`: the request names replica {directed!r}, which is not a live "
                        f"replica of this deployment (live: {sorted(live)}). List them again with "
                        f"`SessionFleet.replicas()`."
                    )
                )
            return [candidate_replicas]  # (Serve stops routing a request whose future is done)
        return [[live[chosen]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        sid = session_of(pending_request)
        if sid is not None and pending_request.metadata.call_method not in _NOT_PLACING:
            uid = replica_id.unique_id
            # Only a change of replica is news: sending the session again where it was keeps the record's
            # time, so a tombstone that replica published since still overrides it (a retry refreshing the
            # time would keep the session's requests on its old holder for good).
            if self.placed.get(sid, ("",))[0] != uid:
                self.placed[sid] = (uid, time.time())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        gone = replica_id.unique_id
        self.placed = {sid: rec for sid, rec in self.placed.items() if rec[0] != gone}


def session_router_config(period_s: float = 1.0, **options: Any) -> RequestRouterConfig:
    """The ``request_router_config`` of a session-serving deployment: `SessionAffinityRouter`, with replicas
    publishing the sessions they hold every ``period_s`` seconds.

    Example:
      >>> session_router_config(0.5).request_routing_stats_period_s
      0.5
    """
    fields: dict[str, Any] = {"request_router_class": SessionAffinityRouter, "request_routing_stats_period_s": period_s}
    return RequestRouterConfig(**fields, **options)  # (ray types this model's fields through pydantic.v1)
