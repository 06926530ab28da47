"""Serving sessions across replicas on Ray (the `[ray]` extra).

On Ray Serve: `SessionServer` is the class a deployment runs (each replica owns a manager), routed by
`SessionAffinityRouter` (`session_router_config`), with `SessionFleet` to drain or rebalance the replicas. On
plain Ray actors: `SessionReplica`, what each replica does, and `SessionCluster`, the driver's record of owners
and epochs with moves, failover, drain and rebalance.
"""

from .cluster import SessionCluster
from .fleet import SessionFleet
from .replica import STEP_ATTR, SessionReplica
from .router import SessionAffinityRouter, session_router_config
from .routing import ReplicaStats, choose, published
from .server import Reply, SessionServer

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
