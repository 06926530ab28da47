"""functional_state.table.records: the table's records copy, pickle and print alike in both builds.

Run on the compiled build (`make test`) and on the pure one (`make test-pure`): a class compiled by mypyc has
no ``__slots__`` for pickle's default protocol, so without their ``__reduce__`` the records (and a table made
of them) failed to copy or pickle only where the table was compiled.
"""

import copy
import pickle

import pytest

import functional_state as fs
from functional_state.table.recency_log import Log, entries
from functional_state.table.records import Recency, Totals


def _table() -> fs.ManagerState:
    state = fs.ManagerState.create(max_sessions=2)
    for sid in ("a", "b", "a", "c"):  # a hit, then an insertion that evicts "b"
        state, _ = fs.get_or_create(state, sid)
    return fs.put(state, "a", "x", fs.LatentBuffer.create(maxlen=2))


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))])
def test_a_record_clones_to_an_equal_record(clone):
    state = _table()
    stored, recency, totals = state._nodes["a"], state._recency, state._totals
    for record, fields in [
        (stored, ("_tick", "_uid")),  # a session as the table stores it: carrying its tick and incarnation
        (recency, ("clock", "start", "end", "pending", "pending_tick", "limit")),
        (totals, ("issued", "misses", "evictions", "parks", "restores")),
    ]:
        again = clone(record)
        assert type(again) is type(record) and again is not record
        assert [getattr(again, f) for f in fields] == [getattr(record, f) for f in fields]
        assert repr(again) == repr(record)
    log = clone(recency.log)
    assert type(log) is Log and (log.base, log.depth) == (recency.log.base, recency.log.depth)
    assert list(entries(log, recency.start, recency.end)) == list(entries(recency.log, recency.start, recency.end))


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))])
def test_a_table_clones_with_its_order_and_counters(clone):
    state = _table()
    again = clone(state)
    assert again.session_ids == state.session_ids == ("a", "c")
    assert again.counters == state.counters and again.issued == state.issued
    assert repr(again) == repr(state)
    # The clone is a table of its own: using it changes neither.
    again, _ = fs.get_or_create(again, "a")
    assert again.session_ids == ("c", "a") and state.session_ids == ("a", "c")


def test_the_records_print_their_fields():
    assert repr(Totals(3, 2, 1, 0, 0)) == "Totals(issued=3, misses=2, evictions=1, parks=0, restores=0)"
    recency = Recency(5, Log(["a"], [4]), 0, 1, "a", 4, 4)
    assert repr(recency) == "Recency(clock=5, window=[0, 1), limit=4, pending='a'@4)"
    stored = fs.SessionState.empty()._stamped(1, 0)
    assert recency.tick_of("a", stored) == 4  # the pending tick, not the stored session's
    assert recency.tick_of("b", stored) == 1


class _Tagged(str):
    """A str subclass that carries a reference: pointed at a table holding it, it would close a cycle."""


def test_a_str_subclass_id_is_kept_as_a_plain_str():
    # `Recency` and `Totals` are acyclic for mypyc (never tracked by the collector): the pending id a
    # `Recency` holds must be a plain str, or a subclass carrying a reference to the table would make a
    # cycle the collector cannot see.
    state = fs.ManagerState.create(max_sessions=4)
    tagged = _Tagged("a")
    state, _ = fs.get_or_create(state, tagged)
    state, _ = fs.get_or_create(state, "b")
    state, _ = fs.get_or_create(state, _Tagged("a"))  # a hit: "a" is the pending session
    assert state._recency.pending == "a"
    assert type(state._recency.pending) is str
    assert [type(sid) for sid in state.session_ids] == [str, str]
    tagged.table = state  # (the reference a subclass can carry: the table no longer holds the tagged id)
    assert all(sid is not tagged for sid in state.session_ids)


@pytest.mark.skipif(not fs.COMPILED, reason="acyclic is a mypyc class attribute: the pure build tracks them")
def test_the_compiled_records_are_not_tracked_by_the_collector():
    import gc

    state = _table()
    assert not gc.is_tracked(state._recency)
    assert not gc.is_tracked(state._totals)
