"""Messages of mistakes a new user makes (issue 40's graded errors): each names what was wrong and the fix,
and changes nothing."""

import numpy as np
import pytest

import functional_state as fs
from helpers import assert_unchanged, snapshot


def _table(*ids):
    s = fs.ManagerState.create()
    for sid in ids:
        s, _ = fs.get_or_create(s, sid)
        s = fs.put(s, sid, "v", fs.PytreeValue.create({"x": np.ones(100)}))
    return s


@pytest.mark.parametrize("verb", ["commit", "stage", "view", "put", "append"])
def test_a_handle_verb_called_on_the_manager_names_the_handle_api(verb):
    # Regression: `manager.commit(...)` was a bare AttributeError ("object has no attribute 'commit'").
    manager = fs.SessionStateManager()
    with pytest.raises(AttributeError, match=rf"`manager.get_or_create_session\(sid\).{verb}\(...\)`"):
        getattr(manager, verb)
    assert not hasattr(manager, verb)


def test_a_misspelt_manager_attribute_lists_the_near_ones():
    with pytest.raises(AttributeError, match=r"no attribute `stast`. Did you mean `stats`"):
        fs.SessionStateManager().stast  # noqa: B018


def test_the_pure_function_is_named_only_where_it_exists():
    with pytest.raises(AttributeError) as e:
        fs.SessionStateManager().commit  # noqa: B018
    assert "functional_state.commit(manager.state, sid, ...)" in str(e.value)
    with pytest.raises(AttributeError) as e:
        fs.SessionStateManager().append  # noqa: B018
    assert "functional_state.append" not in str(e.value)


def test_an_unknown_session_id_lists_the_near_ids():
    # Regression: a typo'd id said only "not in the table".
    s = _table("chat-17", "chat-18", "robot")
    with pytest.raises(fs.SessionStateLostError, match=r"Near ids in the table: 'chat-1[78]', 'chat-1[78]'\."):
        fs.view(s, "chat-71", "v")
    with pytest.raises(fs.SessionStateLostError) as e:
        fs.view(s, "zzzzzz", "v")
    assert "Near ids" not in str(e.value)
    manager = fs.SessionStateManager()
    manager.get_or_create_session("req-1")
    with pytest.raises(fs.SessionStateLostError, match="Near ids in the table: 'req-1'"):
        manager.get_session("req-2")


def test_plan_release_on_a_pool_the_table_does_not_use_says_so():
    # Regression: it returned None, as for a need no plan can meet, with no reason.
    s = _table("a")
    snap = snapshot(s)
    with pytest.raises(fs.InvalidArgumentError, match=r"holds nothing in pool 'cuda:1'.*its pools: cpu 800 B"):
        fs.plan_release(s, "cuda:1", 100)
    assert_unchanged(s, snap)
    assert fs.plan_release(s, "cuda:1", 0).actions == ()  # nothing needed: the empty plan, as for any pool
    assert fs.plan_release(s, "cpu", 10**6) is None  # a pool in use, a need no plan meets: None as before
