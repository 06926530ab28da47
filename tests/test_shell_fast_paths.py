"""The shell's short paths (issue 24): a hit returns the session's one handle, a miss without engine pools is
installed at once, a factory's object is put under one lock. Each must decide what the retry loop decides."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import functional_state as fs
from functional_state import ArrayRing, LatentBuffer, SessionStateManager


def test_a_hit_returns_the_sessions_handle_and_a_new_incarnation_gets_a_new_one():
    m = SessionStateManager(max_sessions=1)
    h = m.get_or_create_session("a")
    assert m.get_or_create_session("a") is h
    m.get_or_create_session("b")  # evicts "a"
    again = m.get_or_create_session("a")
    assert again is not h and again.in_table and not h.in_table


def test_a_factory_of_the_wrong_class_is_refused_and_changes_nothing():
    m = SessionStateManager()
    h = m.get_or_create_session("s")
    with pytest.raises(fs.InvalidTypeError, match="expected ArrayRing"):
        h.get_or_create("buf", LatentBuffer.create, ArrayRing)
    assert "buf" not in h.state


def test_when_another_thread_puts_the_object_first_both_get_the_winner():
    m = SessionStateManager()
    h = m.get_or_create_session("s")
    winner = LatentBuffer.create(maxlen=2)

    def factory():  # another thread (not a reentrant write) puts its object while this one is built
        t = threading.Thread(target=lambda: m.get_or_create_session("s").put("buf", winner))
        t.start()
        t.join()
        return LatentBuffer.create(maxlen=3)

    assert h.get_or_create("buf", factory) is winner
    assert h.get("buf") is winner


def test_a_miss_evicting_a_session_detaches_its_handle_once():
    m = SessionStateManager(max_sessions=2)
    a = m.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=2)).commit("buf", np.ones(2))
    m.get_or_create_session("b")
    m.get_or_create_session("c")  # evicts "a"
    assert not a.in_table and a.view("buf")[0].tolist() == [1.0, 1.0]
    assert m.stats()["evictions"] == 1
    with pytest.raises(fs.SessionStateLostError, match="evicted"):
        m.get_session("a")
    a.commit("buf", np.zeros(2))  # a detached handle writes its own copy, never the table
    assert "a" not in m and len(a.view("buf")) == 2


def test_get_session_of_a_present_session_is_a_touch_without_the_write_loop(monkeypatch):
    """Seen failing before (issue 38): every `get_session` ran the full write loop to touch recency."""
    m = SessionStateManager(max_sessions=2)
    h = m.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=2))
    m.get_or_create_session("b")
    runs = {"n": 0}
    real = m._run  # (the manager's one retry loop, bound at construction)

    def counted(*args, **kwargs):
        runs["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(m, "_run", counted)
    hits = m.stats()["hits"]
    assert m.get_session("a") is h  # the session's one handle
    assert runs["n"] == 0 and m.stats()["hits"] == hits + 1
    m.get_or_create_session("c")  # "a" was touched last: "b" is evicted
    assert "a" in m and "b" not in m
    with pytest.raises(fs.SessionStateLostError, match="evicted"):
        m.get_session("b")
    m.drop_session("a")
    with pytest.raises(fs.SessionStateLostError, match="dropped"):
        m.get_session("a")
