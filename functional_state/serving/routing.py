"""Session-affinity routing as a pure decision: which replica a request for a session goes to.

Each replica publishes what it holds (`published`, the dict its ``record_routing_stats`` returns to Ray
Serve): each session it holds with the epoch and time it claimed it, and a tombstone (epoch, time) for each
session it let go of lately (moved, spilled). A router reads those back (`ReplicaStats.read`) and asks
`choose`. The rules, in order:

1. A request directed at one replica (the drain and rebalance moves name their source and target) goes there,
   or nowhere if that replica is gone.
2. A session a live replica holds goes to that replica, and only to it: never to another one because the
   holder is busy (a replica that does not hold the session would have to load an older copy of it).
   The router's own record of where it sent the session (``(replica, time)``) comes first, unless a
   publication says something newer: that replica's tombstone for the session, or another replica's claim,
   made after the record. Otherwise, of the replicas publishing a claim, the newest claim wins (the highest
   epoch, then the latest time): a session moved by another router is followed as soon as either replica
   publishes again (the old holder's tombstone or the new holder's claim), not only once both have.
3. A session no live replica holds (new, or its holder died) goes to placement: a replica with no tombstone
   for it before one with, then the most headroom, then the fewest bytes held, then the fewest sessions this router placed on it, which loads the
   session from its last checkpoint or opens it.

Placement is deterministic (headroom, then bytes held, then the replica id), so two routers reading the same
figures place a new session on the same replica. Times are the replicas' and routers' wall clocks (epochs
decide between claims first; a clock skew matters only against a router's own record).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from ..transfer.placement import Placement

__all__ = ["Claim", "ReplicaStats", "choose", "published"]

_NONE: Mapping[str, Any] = MappingProxyType({})


class Claim(NamedTuple):
    """A replica's claim on a session, or its tombstone: the session's epoch and when (wall clock, seconds)."""

    epoch: int
    at: float


class ReplicaStats(NamedTuple):
    """What a router knows of one replica from its published figures."""

    sessions: frozenset[str]  # the session ids it holds
    headroom: int | None  # bytes it can still take in its tightest budgeted pool (None: no budget)
    held: int  # bytes it holds in all pools
    claims: Mapping[str, Claim] = _NONE  # session id -> when it claimed the session it holds
    released: Mapping[str, Claim] = _NONE  # session id -> the tombstone of a session it let go of

    @classmethod
    def read(cls, stats: Mapping[str, Any] | None) -> ReplicaStats:
        """The figures from a replica's published dict (empty until its first publication)."""
        stats = stats or {}
        room = stats.get("headroom")
        sessions = stats.get("sessions", ())
        claims = (
            {str(k): Claim(int(v[0]), float(v[1])) for k, v in sessions.items()}
            if isinstance(sessions, Mapping)
            else {}
        )
        released = {str(k): Claim(int(v[0]), float(v[1])) for k, v in (stats.get("released") or {}).items()}
        return cls(
            frozenset(sessions),
            int(room) if room is not None else None,
            int(stats.get("held", 0)),
            claims,
            released,
        )

    def claim(self, sid: str) -> Claim | None:
        """Its claim on ``sid`` (None: it does not hold it, or its tombstone is as new)."""
        if sid not in self.sessions:
            return None
        mine = self.claims.get(sid, Claim(0, 0.0))
        gone = self.released.get(sid)
        return None if gone is not None and gone >= mine else mine


def published(
    figures: Placement,
    *,
    claimed: Mapping[str, float] | None = None,
    released: Mapping[str, tuple[int, float]] | None = None,
    at: float | None = None,
) -> dict[str, Any]:
    """A replica's placement figures as the dict it publishes to Serve's routers (plain values only).

    Args:
      claimed: ``{session id: when this replica claimed it}`` (wall clock; missing: ``at``).
      released: tombstones, ``{session id: (epoch, when)}`` of sessions this replica let go of lately.
      at: when this is published (default: now).

    Example:
      >>> import numpy as np, functional_state as fs
      >>> from functional_state.transfer import placement
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(byte_budget="1 MiB"), "a")
      >>> s = fs.put(s, "a", "cache", fs.DenseValue.create([np.zeros(256, np.float32)]))
      >>> published(placement(s), claimed={"a": 5.0}, released={"b": (2, 4.0)}, at=6.0)
      {'sessions': {'a': [0, 5.0]}, 'released': {'b': [2, 4.0]}, 'headroom': 1047552, 'held': 1024, 'at': 6.0}
    """
    now = time.time() if at is None else at
    claimed = claimed or {}
    rooms = [r for r in (figures.headroom(pool) for pool in figures.pools) if r is not None]
    return {
        "sessions": {sid: [f.epoch, claimed.get(sid, now)] for sid, f in figures.sessions.items()},
        "released": {
            sid: [int(e), float(t)] for sid, (e, t) in (released or {}).items() if sid not in figures.sessions
        },
        "headroom": min(rooms) if rooms else None,
        "held": sum(held for held, _ in figures.pools.values()),
        "at": now,
    }


def choose(
    session_id: str | None,
    replicas: Mapping[str, ReplicaStats],
    placed: Mapping[str, str | tuple[str, float]],
    *,
    directed: str | None = None,
) -> str | None:
    """The replica a request goes to (see the module docstring), or None when any replica may serve it.

    Args:
      session_id: the request's session (None: the request is about no session).
      replicas: the live replicas' figures, by replica id.
      placed: the router's own record, ``{session id: (replica id, when)}`` of where it last sent each
        session (a bare replica id: a record older than every publication).
      directed: a replica id the request names; the answer is that replica or, if it is gone, ``""``.

    Example:
      >>> live = {"a": ReplicaStats(frozenset({"s1"}), 0, 900), "b": ReplicaStats(frozenset(), 500, 100)}
      >>> choose("s1", live, {}), choose("s2", live, {}), choose("s2", live, {"s2": ("a", 1.0)})
      ('a', 'b', 'a')
    """
    if directed is not None:
        return directed if directed in replicas else ""
    if session_id is None:
        return None
    sid = session_id
    claims = {r: c for r, stats in replicas.items() if (c := stats.claim(sid)) is not None}
    record = placed.get(sid)
    if record is not None:
        mine, since = (record, float("-inf")) if isinstance(record, str) else record
        if mine in replicas:
            gone = replicas[mine].released.get(sid)
            newer = (gone is not None and gone.at > since and mine not in claims) or any(
                r != mine and c.at > since for r, c in claims.items()
            )
            if not newer:
                return mine
    if claims:
        return min(claims, key=lambda r: (-claims[r].epoch, -claims[r].at, r))
    if not replicas:
        return ""
    # Between two publications the figures do not change: the sessions this router placed since spread
    # new ones out where the figures tie (a cold start: every replica empty).
    mine_on = Counter(r if isinstance(r, str) else r[0] for r in placed.values())
    # A replica that let go of this session lately (its holder since died) comes last: it refuses the
    # session while its tombstone lasts.
    return min(
        replicas, key=lambda r: (sid in replicas[r].released, -_room(replicas[r]), replicas[r].held, mine_on[r], r)
    )


def _room(stats: ReplicaStats) -> float:
    return float("inf") if stats.headroom is None else stats.headroom
