"""`SessionHandle.step` steps only its own incarnation (issue 24).

Regression: a handle's `step` ran `SessionStateManager.step` by session id, so a handle whose session was
dropped and begun anew under the same id stepped the new incarnation's object."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import functional_state as fs
from functional_state import ArrayRing, SessionStateManager


def _add(ring: ArrayRing, x: jnp.ndarray) -> ArrayRing:
    return ring.commit(x)


@pytest.mark.parametrize("donate", [False, True])
def test_a_handle_never_steps_a_later_incarnation_of_its_session(donate: bool) -> None:
    m = SessionStateManager()
    old = m.get_or_create_session("a").put("ring", ArrayRing.create(4, (2,)))
    old.step("ring", _add, jnp.ones(2), donate=donate)
    m.drop_session("a")
    new = m.get_or_create_session("a").put("ring", ArrayRing.create(4, (2,)))
    with pytest.raises(fs.SessionStateLostError, match="'a'"):
        old.step("ring", _add, jnp.full(2, 7.0), donate=donate)
    assert new.get("ring").view().shape == (0, 2)  # the new incarnation is untouched
    new.step("ring", _add, jnp.full(2, 3.0), donate=donate)  # its own handle steps it
    assert new.get("ring").view().tolist() == [[3.0, 3.0]]
    m.step("a", "ring", _add, jnp.full(2, 4.0))  # by id: whichever incarnation is there
    assert new.get("ring").view().shape == (2, 2)
