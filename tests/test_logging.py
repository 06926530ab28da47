"""What the library logs at INFO (the `functional_state` logger): one line per LRU eviction, per budget release
(park, evict, drop: session, object, bytes, why), and once for live handles whose session left the table."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs

LOGGER = "functional_state"


def _lines(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def _value(n):
    return fs.PytreeValue.create({"x": np.ones(n, np.float32)})


def test_an_lru_eviction_logs_one_info_line_with_session_objects_bytes_and_why(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = fs.ManagerState.create(max_sessions=1)
    s, _ = fs.get_or_create(s, "old")
    s = fs.put(s, "old", "kv", _value(256))
    s, _ = fs.get_or_create(s, "new")
    [line] = [m for m in _lines(caplog) if "LRU eviction" in m]
    assert line == "LRU eviction: session 'old' (1 objects, 1.0 KiB) left the table, full at max_sessions=1, for 'new'"


def test_budget_releases_log_one_info_line_per_action(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    manager = fs.SessionStateManager(byte_budget={"cpu": "1.5 KiB"}, release_levers=("drop",))
    manager.get_or_create_session("a").put("kv", _value(256))
    manager.get_or_create_session("b").put("kv", _value(256))  # over: the least recent session is dropped
    released = [m for m in _lines(caplog) if m.startswith("release for pool")]
    assert released == ["release for pool 'cpu': drop  a: cpu -1.0 KiB (least recently used session)"]
    assert all("\n" not in r.getMessage() for r in caplog.records if r.name == LOGGER)


def test_a_park_under_pressure_logs_session_object_bytes_and_why(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = fs.ManagerState.create()
    for sid in ("a", "b"):
        s, _ = fs.get_or_create(s, sid)
        s = fs.put(s, sid, "kv", fs.PytreeValue.create({"x": jnp.ones(256, jnp.float32)}))  # numpy stays put
    plan = fs.plan_release(s, "cpu", 1024, protect=["b"], levers=("park",))
    fs.apply_plan(s, plan)
    [line] = [m for m in _lines(caplog) if m.startswith("release for pool")]
    assert line.startswith("release for pool 'cpu': park  a/kv: cpu -1.0 KiB") and "least recently used" in line


def test_a_live_handle_of_an_evicted_session_is_told_once_that_it_writes_its_own_copy(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    manager = fs.SessionStateManager(max_sessions=1)
    h = manager.get_or_create_session("a").put("kv", _value(4))
    manager.get_or_create_session("b")
    h.put("more", _value(4))  # accepted, on the handle's own copy (the spec's contract)
    h.put("again", _value(4))
    told = [m for m in _lines(caplog) if "keep their own copy" in m]
    assert len(told) == 1 and told[0].startswith("session 'a' evicted (LRU")
    assert not h.in_table and set(h.state.objects) == {"kv", "more", "again"}


@pytest.mark.parametrize("level", [logging.WARNING])
def test_nothing_is_logged_at_the_default_level(caplog, level):
    caplog.set_level(level, logger=LOGGER)
    s = fs.ManagerState.create(max_sessions=1)
    s, _ = fs.get_or_create(s, "old")
    s, _ = fs.get_or_create(s, "new")
    assert not [r for r in caplog.records if r.name == LOGGER]
