"""The holder index of attr values (`memory/holders.py`): what kept figures count, checked against the walk
where a mutation sample showed the suite blind (issue 34)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_holder_index import SIDS, HolderMachine

import functional_state as fs
from functional_state import ManagerState
from functional_state.memory import holders
from functional_state.table.manager_state import ledger_of


def _session():
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    return state


def _assert_kept_equals_walk(state, nbytes):
    assert fs.stats(state) == fs.stats(state, exact=True)
    assert fs.stats(state)["nbytes:cpu"] == nbytes


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_an_array_held_as_a_fixed_attr_and_inside_a_container_attr_counts_once(container):
    # A container's extent that a fixed attr value also holds was added to the kept total a second time.
    x = np.ones(64, np.float32)
    held = {"k": x} if container is dict else container([x, 3])
    state = fs.set_attr(fs.set_attr(_session(), "a", "x", x), "a", "box", held)
    _assert_kept_equals_walk(state, x.nbytes)
    state, _ = fs.get_or_create(state, "b")
    state = fs.set_attr(state, "b", "box", [x])  # another session's container of it: still once
    _assert_kept_equals_walk(state, x.nbytes)
    state = fs.del_attr(state, "a", "x")  # the containers alone hold it now
    _assert_kept_equals_walk(state, x.nbytes)


def _grown_at_the_same_address():
    """A tensor attr whose storage is replaced by a larger one at the same address (a numpy buffer's)."""
    memory = np.zeros(4096, np.uint8)
    t = torch.from_numpy(memory[:256])
    return t, lambda: t.set_(torch.from_numpy(memory).untyped_storage()), memory.nbytes


def _grown_elsewhere():
    t = torch.zeros(256, dtype=torch.uint8)
    return t, lambda: t.untyped_storage().resize_(4096), 4096


@pytest.mark.parametrize("grown", [_grown_at_the_same_address, _grown_elsewhere], ids=["same-address", "moved"])
def test_a_tensor_attr_resized_in_place_is_recorded_anew_when_another_attr_of_its_session_changes(grown):
    # Two blind spots: the stamp compared (address, device) only, so a storage grown at its address read as
    # unchanged; and `swap_session`'s re-record of such a value was never exercised by a write of another attr.
    t, grow, nbytes = grown()
    state = fs.set_attr(_session(), "a", "t", t)
    _assert_kept_equals_walk(state, 256)
    address = t.untyped_storage().data_ptr()
    grow()
    assert (t.untyped_storage().data_ptr() == address) == (grown is _grown_at_the_same_address)
    state = fs.update_session(state, "a", lambda s: s.set_attr("note", 1))
    _assert_kept_equals_walk(state, nbytes)


class AttrHolderMachine(HolderMachine):
    """The holder machine (`tests/test_holder_index.py`) with an array held as a fixed attr and inside a list
    attr at once, and objects removed through `update_session`: its invariants (the ledger's holder answer
    equals the walk, its counts a fresh build, ``stats()`` the exact walk) checked there too."""

    @precondition(lambda self: self._resident())
    @rule(data=st.data(), to=st.sampled_from(SIDS), let_go=st.booleans())
    def fixed_and_in_a_list(self, data, to, let_go):
        sid, name = data.draw(st.sampled_from(self._resident()))
        storage = fs.lookup(self.state, sid).get(name).storage
        self.state, _ = fs.get_or_create(self.state, to)
        self.state = fs.set_attr(self.state, to, "x_fixed", storage)
        box = [storage]
        self.lists.append(box)
        self.state = fs.set_attr(self.state, data.draw(st.sampled_from(self._sessions())), "x_both", box)
        if let_go and name in fs.lookup(self.state, sid):  # the object goes: attrs alone may hold the storage
            self.state = fs.update_session(self.state, sid, lambda s: s.remove(name))

    @precondition(lambda self: self._objects())
    @rule(data=st.data())
    def remove_object(self, data):
        sid, name = data.draw(st.sampled_from(self._objects()))
        self.state = fs.update_session(self.state, sid, lambda s: s.remove(name))


TestAttrHolderMachine = AttrHolderMachine.TestCase
TestAttrHolderMachine.settings = settings(
    max_examples=15, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)
)


KIB = 1024


BIG = 64 * KIB


def test_the_holder_index_sees_the_storage_a_resized_attr_tensor_holds_now() -> None:
    # A donation asks whether anything else holds a buffer: the resized tensor's new storage is held.
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    t = torch.zeros(256, dtype=torch.uint8)
    state = fs.set_attr(state, "a", "x", t)
    ledger_of(state)  # (the ledger is built on first use: built here, it has recorded the attr before the resize)
    s = t.untyped_storage()
    old = ("cpu", s.data_ptr(), s.data_ptr() + s.nbytes())
    t.resize_(BIG)
    s = t.untyped_storage()
    new = ("cpu", s.data_ptr(), s.data_ptr() + s.nbytes())
    state = fs.set_attr(state, "a", "x", t)  # set again: recorded anew
    assert holders.held_elsewhere(ledger_of(state), [new, old]) == {new}
