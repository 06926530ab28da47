"""Serving sessions across replicas on Ray (the `[ray]` extra): `SessionReplica`, what each replica (a Ray actor)
does, and `SessionCluster`, the driver's record of owners and epochs with moves, failover, drain and rebalance."""

from .cluster import SessionCluster
from .replica import STEP_ATTR, SessionReplica

__all__ = ["STEP_ATTR", "SessionCluster", "SessionReplica"]
