"""The shell's per-session operations cost the same whatever the table's size (issue 24).

Not timed: each test counts the sessions a walk of the table visits during one operation, at two table
sizes, through the table's public read functions (the only way the shell reads more than one session).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state import table as ms
from functional_state.shell import slot as shell_slot

ITEM = np.zeros(4, np.float32)
WALKS = ("entries", "entries_lru", "lru_sessions", "session_map", "sessions")  # every whole-table read the table offers


@pytest.fixture
def visits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every session id a table walk yields (or returns), in order, while the test runs."""
    seen: list[str] = []

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def walk(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            if isinstance(out, dict):
                seen.extend(out)
                return out
            if isinstance(out, tuple):  # lru_sessions: (ids, sessions)
                seen.extend(out[0])
                return out

            def items() -> Iterator[Any]:
                for item in out:
                    seen.append(item[0])
                    yield item

            return items()

        return walk

    for name in WALKS:
        monkeypatch.setattr(ms, name, counted(getattr(ms, name)))
    # An engine pool another test left for the garbage collector sends a miss down the long path (which frees
    # blocks) until it is collected: the two sizes compared must not take different paths.
    monkeypatch.setattr(shell_slot, "LIVE_POOLS", {})
    return seen


def _worn_manager(n: int, **kw: Any) -> SessionStateManager:
    """A full manager of ``n`` sessions, each holding a ring, after random hits (an unsorted recency log)."""
    m = SessionStateManager(max_sessions=n, **kw)
    buf = LatentBuffer.create(maxlen=4)
    for i in range(n):
        m.get_or_create_session(f"s{i}").put("buf", buf)
    rng = random.Random(0)
    for _ in range(3 * n):
        m.get_or_create_session(f"s{rng.randrange(n)}").commit("buf", ITEM)
    return m


def _miss_visits(n: int, visits: list[str], **kw: Any) -> int:
    m = _worn_manager(n, **kw)
    first = m.state.least_recent
    del visits[:]
    h = m.get_or_create_session("new")
    h.get_or_create("buf", lambda: LatentBuffer.create(maxlen=4))
    h.commit("buf", ITEM)
    assert first not in m and "new" in m and len(m) == n  # the miss evicted the least recent session
    return len(visits)


@pytest.mark.parametrize("budget", [None, "1GiB"], ids=["no budget", "budget"])
def test_a_miss_visits_as_many_sessions_at_1000_as_at_10(visits: list[str], budget: str | None) -> None:
    # A miss once diffed the whole table to find the session it evicted (~25 ms at 100k sessions): its cost
    # must not depend on how many sessions the table holds.
    small, large = _miss_visits(10, visits, byte_budget=budget), _miss_visits(1000, visits, byte_budget=budget)
    assert large == small <= 4


def test_the_evicted_sessions_handle_detaches_with_its_last_state(visits: list[str]) -> None:
    m = _worn_manager(50)
    h = m.get_or_create_session("s0").commit("buf", ITEM)
    last = h.state
    for i in range(1, 50):
        m.get_or_create_session(f"s{i}")  # "s0" is the least recent session now
    del visits[:]
    m.get_or_create_session("new")
    assert len(visits) <= 4
    assert not h.in_table and h.state is last and h.get("buf").view() == last.get("buf").view()
    with pytest.raises(fs.SessionStateLostError, match="evicted"):
        m.get_session("s0")
