"""Where a drain or a rebalance moves sessions, decided from replicas' placement figures alone (pure).

Both the actor-based `SessionCluster` and the Serve-based `SessionFleet` ask these; neither moves a session
to a replica without headroom for its bytes in every pool it uses, so a move never makes the target drop one.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..transfer.placement import Placement, SessionFigures

__all__ = ["drain_target", "fits", "held", "rebalance_move", "roomiest"]


def held(figures: Placement) -> int:
    """The bytes a replica holds, all pools together."""
    return sum(n for n, _ in figures.pools.values())


def fits(target: Placement, session: SessionFigures) -> bool:
    """Whether ``target`` has headroom for the session's bytes in every pool it uses."""
    return all((room := target.headroom(pool)) is None or room >= n for pool, n in session.bytes_by_pool.items())


def drain_target(figures: Mapping[str, Placement], sid: str, source: str) -> str | None:
    """The replica (not ``source``) with the most headroom that fits ``sid``, or None when none does.

    Example:
      >>> from functional_state.transfer import Placement, SessionFigures
      >>> s = SessionFigures({"cpu": 10}, 0, 1, None)
      >>> f = {"a": Placement({"cpu": (10, 20)}, {"s": s}), "b": Placement({"cpu": (0, 5)}, {}),
      ...      "c": Placement({"cpu": (0, 50)}, {})}
      >>> drain_target(f, "s", "a")
      'c'
    """
    return roomiest({n: f for n, f in figures.items() if n != source}, figures[source].sessions[sid])


def roomiest(figures: Mapping[str, Placement], session: SessionFigures) -> str | None:
    """The replica in ``figures`` with the most headroom (in the session's tightest pool; no budget is the
    most) that fits ``session``, or None when none does."""
    ok = [n for n, f in figures.items() if fits(f, session)]
    return max(ok, key=lambda n: (min(_room(figures[n], p) for p in session.bytes_by_pool), n), default=None)


def _room(figures: Placement, pool: str) -> float:
    room = figures.headroom(pool)
    return float("inf") if room is None else room


def rebalance_move(figures: Mapping[str, Placement]) -> tuple[str, str, str] | None:
    """The next move narrowing the gap between the replica holding the most bytes and the one holding the
    fewest, as ``(session, from, to)``; None when no move narrows it."""
    if len(figures) < 2:
        return None
    totals = {n: held(f) for n, f in figures.items()}
    top, low = max(totals, key=totals.__getitem__), min(totals, key=totals.__getitem__)
    gap = totals[top] - totals[low]
    sizes = {sid: f.nbytes for sid, f in figures[top].sessions.items()}
    ok = [s for s, n in sizes.items() if 0 < n < gap and fits(figures[low], figures[top].sessions[s])]
    if not ok:
        return None
    return min(ok, key=lambda s: (abs(gap - 2 * sizes[s]), s)), top, low
