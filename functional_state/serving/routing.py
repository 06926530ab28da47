"""Session-affinity routing as a pure decision: which replica a request for a session goes to.

Each replica publishes what it holds (`published`, the dict its ``record_routing_stats`` returns to Ray
Serve); a router reads those back (`ReplicaStats.read`) and asks `choose`. The rules, in order:

1. A request directed at one replica (the drain and rebalance moves name their source and target) goes there,
   or nowhere if that replica is gone.
2. A session a live replica holds goes to that replica, and only to it: never to another one because the
   holder is busy (a replica that does not hold the session would have to load an older copy of it).
   The router's own record of where it placed the session (newer than the published figures, which Serve
   refreshes every ``request_routing_stats_period_s``) comes first.
3. A session no live replica holds (new, or its holder died) goes to placement: the replica with the most
   headroom, then the fewest bytes held, then the fewest sessions this router placed on it, which loads the
   session from its last checkpoint or opens it.

Placement is deterministic (headroom, then bytes held, then the replica id), so two routers reading the same
figures place a new session on the same replica.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..transfer.placement import Placement

__all__ = ["ReplicaStats", "choose", "published"]


class ReplicaStats(NamedTuple):
    """What a router knows of one replica from its published figures."""

    sessions: frozenset[str]  # the session ids it holds
    headroom: int | None  # bytes it can still take in its tightest budgeted pool (None: no budget)
    held: int  # bytes it holds in all pools

    @classmethod
    def read(cls, stats: Mapping[str, Any] | None) -> ReplicaStats:
        """The figures from a replica's published dict (empty until its first publication)."""
        stats = stats or {}
        room = stats.get("headroom")
        return cls(
            frozenset(stats.get("sessions", ())),
            int(room) if room is not None else None,
            int(stats.get("held", 0)),
        )


def published(figures: Placement) -> dict[str, Any]:
    """A replica's placement figures as the dict it publishes to Serve's routers (plain values only).

    Example:
      >>> import numpy as np, functional_state as fs
      >>> from functional_state.transfer import placement
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(byte_budget="1 MiB"), "a")
      >>> s = fs.put(s, "a", "cache", fs.DenseValue.create([np.zeros(256, np.float32)]))
      >>> published(placement(s))
      {'sessions': ['a'], 'headroom': 1047552, 'held': 1024}
    """
    rooms = [r for r in (figures.headroom(pool) for pool in figures.pools) if r is not None]
    return {
        "sessions": list(figures.sessions),
        "headroom": min(rooms) if rooms else None,
        "held": sum(held for held, _ in figures.pools.values()),
    }


def choose(
    session_id: str | None,
    replicas: Mapping[str, ReplicaStats],
    placed: Mapping[str, str],
    *,
    directed: str | None = None,
) -> str | None:
    """The replica a request goes to (see the module docstring), or None when any replica may serve it.

    Args:
      session_id: the request's session (None: the request is about no session).
      replicas: the live replicas' figures, by replica id.
      placed: the router's own record, ``{session id: replica id}`` of where it last sent each session.
      directed: a replica id the request names; the answer is that replica or, if it is gone, ``""``.

    Example:
      >>> live = {"a": ReplicaStats(frozenset({"s1"}), 0, 900), "b": ReplicaStats(frozenset(), 500, 100)}
      >>> choose("s1", live, {}), choose("s2", live, {}), choose("s2", live, {"s2": "a"})
      ('a', 'b', 'a')
    """
    if directed is not None:
        return directed if directed in replicas else ""
    if session_id is None:
        return None
    mine = placed.get(session_id)
    if mine in replicas:
        return mine
    holders = sorted(r for r, stats in replicas.items() if session_id in stats.sessions)
    if holders:
        return holders[0]
    if not replicas:
        return ""
    # Between two publications the figures do not change: the sessions this router placed since spread
    # new ones out where the figures tie (a cold start: every replica empty).
    mine_on = Counter(placed.values())
    return min(replicas, key=lambda r: (-_room(replicas[r]), replicas[r].held, mine_on[r], r))


def _room(stats: ReplicaStats) -> float:
    return float("inf") if stats.headroom is None else stats.headroom
