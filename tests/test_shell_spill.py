"""The spill lever in the shell (`SessionStateManager(spill=...)`, `functional_state.shell.spill`): a session the
byte budget would drop is handed to a callback first, outside the lock; one it took is never dropped as lost,
one whose spill failed stays unless the budget cannot be met otherwise, and a write that lands on a session
between the plan and its spill is never lost (the newer value is spilled)."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState, SessionStateManager
from functional_state.shell.writes import Writes
from functional_state.transfer import export_session, import_session

KIB = 1024


def _kib(fill: float, n: int = 1) -> fs.DenseValue:
    return fs.DenseValue.create([np.full(256 * n, fill, np.float32)])


def _manager(spill: Any, budget: str = "3 KiB", **kw: Any) -> tuple[SessionStateManager, dict[str, Any]]:
    """Sessions a, b, c holding 1 KiB each under a budget of ``budget``, dropping only; their handles."""
    m = SessionStateManager(byte_budget=budget, release_levers=("drop",), spill=spill, **kw)
    handles = {sid: m.get_or_create_session(sid).put("x", _kib(i)) for i, sid in enumerate("abc")}
    return m, handles


class Peer:
    """A peer replica: takes what it is offered through the transfer blob, records each offer."""

    def __init__(self, refuse: Any = ()) -> None:
        self.table, self.offered, self.refuse = ManagerState.create(), list[str](), set(refuse)

    def __call__(self, table: ManagerState, sid: str) -> bool:
        self.offered.append(sid)
        if sid in self.refuse:
            raise ConnectionError(f"peer gone while taking {sid!r}")
        if sid in self.table:
            self.table, _ = fs.drop_session(self.table, sid)  # (a newer value replaces the one spilled before)
        self.table = import_session(self.table, export_session(table, sid))
        return True


def test_a_spilled_session_lives_on_at_the_peer_and_is_not_an_eviction() -> None:
    peer = Peer()
    m, h = _manager(peer)
    m.get_or_create_session("d").put("x", _kib(9, 2))  # 5 KiB against 3: the two least recent must go
    assert peer.offered == ["a", "b"] and set(m.state.session_ids) == {"c", "d"}
    assert m.stats()["evictions"] == 0  # nothing lost
    for i, sid in enumerate("ab"):
        assert fs.view(peer.table, sid, "x")[0].tolist() == [float(i)] * 256
    # Their handles refuse writes (they would reach a copy nobody reads) and say where the session went.
    assert not h["a"].in_table
    with pytest.raises(fs.SessionStateLostError, match="spilled"):
        h["a"].put("y", _kib(1))
    with pytest.raises(fs.SessionStateLostError, match="spilled"):
        m.get_session("b")


@pytest.mark.parametrize("how", ["raises", "declines"])
def test_a_failed_spill_leaves_its_session_in_place_when_the_budget_can_be_met_otherwise(how, caplog) -> None:
    caplog.set_level(logging.INFO, "functional_state")
    peer = Peer(refuse="a")
    spill = peer if how == "raises" else (lambda table, sid: peer(table, sid) if sid != "a" else False)
    m, h = _manager(spill)
    m.get_or_create_session("d").put("x", _kib(9, 2))
    assert peer.offered == (["a", "b", "c"] if how == "raises" else ["b", "c"])
    assert set(m.state.session_ids) == {"a", "d"} and h["a"].in_table  # a stayed; b and c went to the peer
    assert m.stats()["evictions"] == 0
    word = "raised" if how == "raises" else "was declined"
    assert f"spilling session 'a' {word}; it stays in the table" in caplog.text
    if how == "raises":
        assert "ConnectionError: peer gone" in caplog.text  # (the error is reported with its traceback)


def test_a_failed_spill_is_dropped_only_when_the_budget_cannot_be_met_otherwise(caplog) -> None:
    caplog.set_level(logging.INFO, "functional_state")
    peer = Peer(refuse="abc")
    m, h = _manager(peer)
    m.get_or_create_session("d").put("x", _kib(9, 2))  # every spill fails: two must go even so
    assert set(m.state.session_ids) == {"c", "d"} and m.stats()["evictions"] == 2
    # (c, offered no more once the budget could not be met with a and b protected, took its place in the plan)
    assert "cannot be met without dropping session(s) ['a', 'b'], whose spill failed" in caplog.text
    # Dropped as evictions: their handles keep the last state, as after any eviction.
    assert not h["a"].in_table and h["a"].view("x")[0].tolist() == [0.0] * 256


def test_a_write_the_budget_cannot_fit_even_so_is_refused_and_nothing_is_offered() -> None:
    peer = Peer()
    m, _ = _manager(peer)
    with m.pin("b"), m.pin("c"), pytest.raises(fs.BudgetExceededError):
        m.get_or_create_session("d").put("x", _kib(9, 3))  # 6 KiB: a alone cannot make room
    assert set(m.state.session_ids) == {"a", "b", "c", "d"} and "x" not in fs.lookup(m.state, "d").objects
    assert peer.offered == []  # (no plan frees enough: nothing is handed over)


def test_a_write_to_the_session_between_the_plan_and_its_spill_is_spilled_too() -> None:
    # The spill runs outside the lock, so a write may land on the session it is handing over. The write that
    # made room is then decided again, and the session, a newer value now, offered again: the peer ends with
    # the write. (Remove the identity test in `admission._SpillLever` and the second offer never comes.)
    m, h = _manager(None, budget="4 KiB")
    written: list[str] = []
    handed: list[list[float]] = []

    def spill(table: ManagerState, sid: str) -> bool:
        handed.append(fs.view(table, sid, "x")[0][:1].tolist())
        if not written:
            written.append(sid)
            h[sid].put("x", _kib(7))  # same size: installed at once, under the budget the table still meets
        return True

    m._writes.spill = spill  # (set after the setup writes)
    m.get_or_create_session("d").put("x", _kib(9, 2))  # 5 KiB against 4: "a" must go
    assert written == ["a"] and handed == [[0.0], [7.0]]
    assert "a" not in m.state and m.stats()["evictions"] == 0


def test_a_session_unchanged_since_its_spill_is_not_offered_again() -> None:
    # A write to another session lands during the spill: the write that spills is decided again on the newer
    # table, and the session it spills, unchanged, is not handed over a second time.
    m, h = _manager(None, budget="4 KiB")
    offered: list[str] = []

    def spill(table: ManagerState, sid: str) -> bool:
        offered.append(sid)
        if len(offered) == 1:
            h["c"].put("x", _kib(5))  # same size, another session: installed at once
        return True

    m._writes.spill = spill  # (set after the setup writes)
    m.get_or_create_session("d").put("x", _kib(9, 2))
    assert offered == ["a"] and "a" not in m.state
    assert fs.view(m.state, "c", "x")[0][0] == 5.0  # (the other write stands)


def test_a_step_under_a_budget_with_a_spill_offers_what_it_drops() -> None:
    import jax.numpy as jnp

    peer = Peer()
    m = SessionStateManager(byte_budget="3 KiB", release_levers=("drop",), spill=peer)
    for sid in "ab":
        m.get_or_create_session(sid).put("x", fs.DenseValue.create([jnp.zeros(256, jnp.float32)]))
    h = m.get_or_create_session("c").put("x", fs.DenseValue.create([jnp.zeros(256, jnp.float32)]))
    h.step("x", lambda obj: fs.DenseValue.create([jnp.zeros(512, jnp.float32)]))  # grows to 2 KiB
    assert peer.offered == ["a"] and set(m.state.session_ids) == {"b", "c"} and m.stats()["evictions"] == 0


def test_the_spill_must_be_callable() -> None:
    with pytest.raises(fs.InvalidTypeError, match="spill must be a callable"):
        SessionStateManager(spill="peer-1")  # type: ignore[arg-type]


@pytest.mark.parametrize("lock", ["lock", pytest.param("none", marks=pytest.mark.xfail(strict=True))])
def test_a_write_racing_the_install_of_a_spill_is_never_lost(lock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another thread writes the spilled session just as the write that spills it installs (the install starts
    # that thread and gives it 0.2 s). Under the lock the other write waits, then finds its session gone and is
    # refused; without it (the xfail case) it reports success on the table the install then replaces: lost.
    factory = threading.Lock if lock == "lock" else contextlib.nullcontext
    handed: dict[str, Any] = {}
    m = SessionStateManager(
        byte_budget="3 KiB",
        release_levers=("drop",),
        lock_factory=factory,
        spill=lambda table, sid: handed.__setitem__(sid, fs.lookup(table, sid)) or True,
    )
    x = m.get_or_create_session("x").put("v", _kib(1)).set_attr("n", 0)
    w = m.get_or_create_session("w").put("v", _kib(2))  # 2 KiB of 3
    done: list[int] = []

    def other_write() -> None:
        with contextlib.suppress(fs.SessionStateLostError):
            x.set_attr("n", 1)
            done.append(1)

    install, threads = Writes.install, []

    def racing_install(self: Writes, decision: Any) -> Any:
        if not threads and any(d.sid == "x" for d in decision.left):
            threads.append(threading.Thread(target=other_write))
            threads[0].start()
            threads[0].join(0.2)
        return install(self, decision)

    monkeypatch.setattr(Writes, "install", racing_install)
    w.put("v", _kib(3, 3))  # 4 KiB against 3: x must go
    assert threads, "the install that spills x never ran"
    threads[0].join(30)
    assert "x" not in m.state and handed["x"].get_attr("n") == (1 if done else 0)
