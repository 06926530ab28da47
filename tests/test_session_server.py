"""`SessionServer` in-process (no Ray started) and the routing decision (`serving.routing.choose`): a session
goes to its holder only, placement by headroom, a resumed session replayed up to the request, moves fenced."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray.serve")

import serving_model as model

from functional_state import InvalidArgumentError, StaleEpochError, TransferError
from functional_state.serving import ReplicaStats, SessionServer, choose, published


def _server(name: str, root, **kw) -> SessionServer:
    return SessionServer(model="wm@1", step=model.step, init=model.init, checkpoints=root, name=name, **kw)


def test_a_session_goes_to_its_holder_only_even_when_another_replica_has_more_room():
    live = {
        "a": ReplicaStats(frozenset({"s"}), 0, 900),  # full, but the holder
        "b": ReplicaStats(frozenset(), 10_000, 0),
        "c": ReplicaStats(frozenset(), None, 50),  # no budget: unbounded room
    }
    assert choose("s", live, {}) == "a"
    assert choose("s", live, {"s": ("b", 1.0)}) == "b"  # the router's own newer record wins while "b" lives
    assert choose("s", live, {"s": "gone"}) == "a"  # a record of a dead replica falls back to the figures
    assert choose("new", live, {}) == "c"  # placement: the most headroom
    assert choose("new", {k: live[k] for k in "ab"}, {}) == "b"
    assert choose(None, live, {}) is None  # no session: any replica
    cold = {r: ReplicaStats(frozenset(), 100, 0) for r in "xyz"}  # a cold start: the figures tie
    placed: dict[str, str] = {}
    for sid in ("n0", "n1", "n2", "n3"):
        placed[sid] = choose(sid, cold, placed)
    assert sorted(placed.values()) == ["x", "x", "y", "z"]  # spread, not all on one replica
    assert choose("s", live, {}, directed="b") == "b" and choose("s", live, {}, directed="x") == ""
    assert choose("s", {}, {}) == ""  # no replica alive


def test_published_figures_read_back_the_same():
    server = _server("r0", "unused", byte_budget="4 MiB")
    server.step("s", 0)
    stats = server.record_routing_stats()
    assert stats == published(server.figures(), claimed=server.claimed, at=stats["at"])
    epoch, claimed = server.replica.epoch("s"), server.claimed["s"]
    assert stats == {
        "sessions": {"s": [epoch, claimed]},
        "released": {},
        "headroom": 4 * (1 << 20) - 2 * 4 * model.SIZE,
        "held": 2 * 4 * model.SIZE,
        "at": stats["at"],
    }
    assert ReplicaStats.read(stats) == ReplicaStats(
        frozenset({"s"}), stats["headroom"], stats["held"], {"s": (epoch, claimed)}, {}
    )
    assert ReplicaStats.read({}) == ReplicaStats(frozenset(), None, 0)


def test_a_session_taken_up_from_its_checkpoint_is_replayed_up_to_the_request(tmp_path):
    a = _server("a", tmp_path, save_every=3)
    outputs = [a.step("s", t, at=t).output for t in range(5)]  # saved at step 3
    b = _server("b", tmp_path, replay=model.replay)
    reply = b.step("s", 5, at=5)  # steps 3 and 4 replayed first
    ref = _server("ref", tmp_path / "ref")
    expected = [ref.step("s", t).output for t in range(6)]
    assert outputs + [reply.output] == expected and reply.step == 6 and reply.replica == "b"
    with pytest.raises(InvalidArgumentError, match="request for step 5 was already served"):
        b.step("s", 5, at=5)
    c = _server("c", tmp_path)
    with pytest.raises(InvalidArgumentError, match="resumed from its checkpoint at step 3"):
        c.step("s", 7, at=7)
    d = _server("d", tmp_path, replay=lambda sid, lo, hi: [(lo,)])
    with pytest.raises(InvalidArgumentError, match="gave 1 steps"):
        d.step("s", 7, at=7)
    assert d.replica.steps("s") == 3  # nothing replayed


def test_a_move_between_servers_fences_the_source_and_keeps_the_bytes(tmp_path):
    a, b = _server("a", tmp_path), _server("b", tmp_path)
    a.step("s", 0)
    exported = a.export("s", replica="a")
    with pytest.raises(StaleEpochError, match="being moved"):
        a.step("s", 1)
    with pytest.raises(InvalidArgumentError, match="reached replica 'b'"):
        b.accept("s", exported, replica="a")
    with pytest.raises(TransferError, match="asked for session 'other'"):
        b.accept("other", exported, replica="b")
    assert b.replica.manager.state.session_ids == ()
    epoch, source, old = b.accept("s", exported, replica="b")
    assert (source, epoch) == ("a", old + 1) and a.release("s", old, replica="a")
    ref = _server("ref", tmp_path / "ref")
    assert b.step("s", 1).output == [ref.step("s", t).output for t in range(2)][1]  # the next step as if unmoved
    ring = b.replica.manager.get_session("s").view("latents")
    assert len(ring) == 2 and all(isinstance(x, np.ndarray) for x in ring)
    a.step("t", 0)
    a.export("t")
    a.abort_move("t")
    assert a.step("t", 1).step == 2  # served here again


def test_a_checkpoint_of_another_session_where_one_is_taken_up_is_refused(tmp_path):
    a = _server("a", tmp_path)
    a.step("other", 0)
    a.replica.manager.save_session("other", a.checkpoint("s"))  # misfiled under "s"
    b = _server("b", tmp_path)
    with pytest.raises(StaleEpochError, match="holds no session 's'"):
        b.step("s", 0)
    assert b.replica.manager.state.session_ids == ()  # not opened anew over a checkpoint it cannot read


def test_the_old_holder_publishes_a_tombstone_and_refuses_the_session_rather_than_take_it_up_again(tmp_path):
    # Regression (issue 36): after a move, a router that had not seen it yet sent the session to its old
    # holder, which took it up as new (or from an older checkpoint) beside the new holder.
    a, b = _server("a", tmp_path), _server("b", tmp_path)
    a.step("s", 0)
    _, _, old = b.accept("s", a.export("s"), replica="b")
    a.release("s", old, replica="a")
    stats = a.record_routing_stats()
    assert "s" not in stats["sessions"] and stats["released"]["s"][0] == old
    with pytest.raises(StaleEpochError, match="left this replica"):
        a.step("s", 1)
    assert "s" not in a.replica.manager
    live = {n: ReplicaStats.read(x.record_routing_stats()) for n, x in (("a", a), ("b", b))}
    assert choose("s", live, {"s": ("a", stats["released"]["s"][1] - 1)}) == "b"
    a.tombstone_s = 0.0  # the tombstone lapsed: a request placed here (its holder died, say) takes it up
    assert a.step("s", 0).step == 1
