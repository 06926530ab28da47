"""Serving sessions across replicas on Ray (the `[ray]` extra).

On Ray Serve: `SessionServer` is the class a deployment runs (each replica owns a manager), routed by
`SessionAffinityRouter` (`session_router_config`), with `SessionFleet` to drain or rebalance the replicas. On
plain Ray actors: `SessionReplica`, what each replica does, and `SessionCluster`, the driver's record of owners
and epochs with moves, failover, drain and rebalance.
"""

from typing import TYPE_CHECKING, Any

from .cluster import SessionCluster
from .fleet import SessionFleet
from .replica import STEP_ATTR, SessionReplica
from .routing import ReplicaStats, choose, published
from .server import Reply, SessionServer

if TYPE_CHECKING:
    from .router import SessionAffinityRouter, session_router_config

__all__ = [
    "STEP_ATTR",
    "ReplicaStats",
    "Reply",
    "SessionAffinityRouter",
    "SessionCluster",
    "SessionFleet",
    "SessionReplica",
    "SessionServer",
    "choose",
    "published",
    "session_router_config",
]

# The router subclasses Ray Serve's `RequestRouter`, so it is imported on first use: the rest of this package
# (the replica's verbs, the routing rules, the cluster record) imports and is tested where Ray is not installed.
_ROUTER_NAMES = frozenset({"SessionAffinityRouter", "session_router_config"})


def __getattr__(name: str) -> Any:
    if name in _ROUTER_NAMES:
        from . import router

        return getattr(router, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
