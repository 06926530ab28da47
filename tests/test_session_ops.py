"""Tests of `shell/session_ops.py`: what a handle asks of its manager, applied to its session wherever it is; a write
into the very session being computed is refused."""

from __future__ import annotations

import pytest

from functional_state import (
    LatentBuffer,
    ReentrantWriteError,
    SessionStateManager,
)


def test_a_factory_that_writes_its_own_session_is_refused_and_changes_nothing():
    m = SessionStateManager()
    h = m.get_or_create_session("s").set_attr("n", 1)

    def factory():
        h.set_attr("n", 5)
        return LatentBuffer.create()

    with pytest.raises(ReentrantWriteError):
        h.get_or_create("buf", factory)
    assert h.get_attr("n") == 1 and "buf" not in h.state
    h.set_attr("n", 2)  # the session is writable again afterwards
    assert h.get_attr("n") == 2


def test_a_transaction_that_writes_its_own_session_is_refused_clearly():
    m = SessionStateManager()
    h = m.get_or_create_session("s").set_attr("n", 1)
    with pytest.raises(ReentrantWriteError, match="Return the new state"):
        h.transact(lambda s: (h.set_attr("n", 5), s)[1])
    assert h.get_attr("n") == 1
