"""The pure routing rules (`serving.routing`) with several routers: a moved session's newest claim wins over
an older one, and the old holder's tombstone overrides a router's record of it (no Ray needed)."""

from __future__ import annotations

from functional_state.serving import ReplicaStats, choose


def _stats(sessions=None, released=None, headroom=1000, held=0, at=0.0) -> ReplicaStats:
    """A replica's figures as a router reads them back from what it published (the wire form)."""
    return ReplicaStats.read(
        {"sessions": sessions or {}, "released": released or {}, "headroom": headroom, "held": held, "at": at}
    )


def test_of_two_conflicting_claims_the_newest_wins():
    # Regression (issue 36): with two replicas both publishing a session (the old holder had not published
    # since the move), the lowest replica id won, whatever the epochs.
    live = {"a": _stats({"s": [1, 10.0]}, at=20.0), "b": _stats({"s": [2, 15.0]}, at=16.0)}
    assert choose("s", live, {}) == "b"
    live = {"a": _stats({"s": [3, 30.0]}, at=31.0), "b": _stats({"s": [2, 15.0]}, at=16.0)}  # and back again
    assert choose("s", live, {}) == "a"


def test_a_tombstone_of_the_old_holder_overrides_a_routers_record():
    # Regression (issue 36): a router that had sent the session to "a" kept sending it there after another
    # router moved it to "b", until both replicas published again; "a"'s tombstone now says it let go.
    live = {"a": _stats(released={"s": [1, 12.0]}, headroom=10, at=13.0), "b": _stats(at=5.0)}
    assert choose("s", live, {"s": "a"}) == "b"  # the new holder has not published yet: placement, not "a"
    assert choose("s", live, {"s": ("a", 11.0)}) == "b"  # routed there before it let go
    assert choose("s", live, {"s": ("a", 14.0)}) == "a"  # routed there after: the router's record is newer


def test_a_routers_record_newer_than_every_publication_wins():
    live = {"a": _stats({"s": [1, 10.0]}, at=20.0), "b": _stats(at=20.0)}
    assert choose("s", live, {"s": ("b", 30.0)}) == "b"  # moved to b by this router, not yet published
    live["c"] = _stats({"s": [2, 35.0]}, at=36.0)  # then claimed by c (another router's move)
    assert choose("s", live, {"s": ("b", 30.0)}) == "c"
    assert choose("s", live, {"s": ("gone", 40.0)}) == "c"  # a record of a dead replica: the newest claim
