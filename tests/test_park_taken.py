"""A CPU park takes a torch storage nothing else holds as its host copy instead of copying it (issue 38), and a
restore hands it back: the bytes still move from the device figure to the host figure, every older table and
fork reads what it held, an in-place write goes through `writable`'s copy, and a storage someone else can reach
(a tensor or container the caller keeps, a view, numpy memory) is copied as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import DenseValue, ManagerState, SharedStorageWrittenError
from functional_state.memory import parking

transformers = pytest.importorskip("transformers")

from test_adapter_transformers import KINDS, PROMPTS, alone, greedy, sessions  # noqa: E402


def table(make):
    """A table whose session "a" holds ``DenseValue(make())`` under "kv" (the tensors referenced by it alone)."""
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    return fs.put(s, "a", "kv", DenseValue.create(make()))


def fresh():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(4, 64, generator=g) for _ in range(3))


def host_copy(s, sid="a"):
    return fs.lookup(s, sid).get("kv").host_copy


def exact(s):
    assert fs.stats(s) == fs.stats(s, exact=True)


def test_a_park_takes_a_storage_nothing_else_holds_and_a_restore_hands_it_back():
    s = table(fresh)
    ptrs = [t.data_ptr() for t in fs.view(s, "a", "kv")]
    s, moved = fs.park(s, "a", "kv")
    n = 3 * 4 * 64 * 4
    assert moved == {"cpu": -n, "cpu/unpinned_host": n}  # the figures move as a copy's would
    exact(s)
    assert host_copy(s).taken is not None
    assert [b.data_ptr() for b in host_copy(s).buffers] == ptrs  # no copy
    s, moved = fs.restore(s, "a", "kv")
    assert moved == {"cpu": n, "cpu/unpinned_host": -n}
    exact(s)
    back = fs.view(s, "a", "kv")
    assert [t.data_ptr() for t in back] == ptrs  # handed back, no copy
    assert all(torch.equal(a, b) for a, b in zip(back, fresh(), strict=True))


def test_copy_true_parks_a_private_copy():
    s = table(fresh)
    ptrs = {t.data_ptr() for t in fs.view(s, "a", "kv")}
    s, _ = fs.park(s, "a", "kv", copy=True)
    assert host_copy(s).taken is None and not ptrs & {b.data_ptr() for b in host_copy(s).buffers}
    exact(s)


@pytest.mark.parametrize(
    "keep",
    [
        pytest.param(lambda v: v[0], id="a tensor the caller keeps"),
        pytest.param(lambda v: v, id="the tuple the caller keeps"),
        pytest.param(lambda v: v[1][:2], id="a view"),
        pytest.param(lambda v: v[2].untyped_storage(), id="the storage"),
        pytest.param(lambda v: v[0].numpy(), id="a numpy view"),
    ],
)
def test_a_storage_someone_else_can_reach_is_copied(keep):
    """Each of these reaches a parked storage from outside the table: it would write the parked copy."""
    value = fresh()
    kept = keep(value)
    s = table(lambda v=value: v)
    del value
    s, _ = fs.park(s, "a", "kv")
    assert host_copy(s).taken is None
    exact(s)
    del kept


def test_numpy_memory_is_copied():
    s = table(lambda: (torch.from_numpy(np.ones((4, 8), np.float32)),))
    s, _ = fs.park(s, "a", "kv")
    assert host_copy(s).taken is None


@pytest.mark.parametrize("fork", [False, True])
def test_a_write_through_writable_after_a_zero_copy_restore_reaches_no_older_table_and_no_fork(fork):
    s = table(fresh)
    parked, _ = fs.park(s, "a", "kv")
    del s  # (the resident object gone: the restore can hand the storage back)
    assert host_copy(parked).taken is not None
    restored, _ = fs.restore(parked, "a", "kv")
    assert [t.data_ptr() for t in fs.view(restored, "a", "kv")] == [b.data_ptr() for b in host_copy(parked).buffers]
    before = fs.fork_session(restored, "a", "b") if fork else restored
    written, view = fs.writable(before, "a", "kv")
    for t in view:
        t.fill_(7.0)  # in place, as a StaticCache update writes
    want = fresh()
    for older in (restored, before):
        for sid in fs.sessions(older):
            assert all(torch.equal(a, b) for a, b in zip(fs.view(older, sid, "kv"), want, strict=True)), sid
    if fork:
        assert all(torch.equal(a, b) for a, b in zip(fs.view(written, "b", "kv"), want, strict=True))
    again, _ = fs.restore(parked, "a", "kv")  # the parked copy still holds what was parked
    assert all(torch.equal(a, b) for a, b in zip(fs.view(again, "a", "kv"), want, strict=True))
    assert all(bool((t == 7.0).all()) for t in fs.view(written, "a", "kv"))
    exact(written)


def test_an_older_table_written_through_writable_leaves_the_parked_copy_as_parked():
    s = table(fresh)
    parked, _ = fs.park(s, "a", "kv")
    assert host_copy(parked).taken is not None
    s, view = fs.writable(s, "a", "kv")  # the resident object the older table holds shares the storages
    for t in view:
        t.fill_(5.0)
    back, _ = fs.restore(parked, "a", "kv")
    assert all(torch.equal(a, b) for a, b in zip(fs.view(back, "a", "kv"), fresh(), strict=True))


def test_a_write_outside_writable_to_a_taken_storage_is_refused_at_restore_and_nothing_changes():
    s = table(fresh)
    parked, _ = fs.park(s, "a", "kv")
    fs.view(s, "a", "kv")[0].add_(1.0)  # the older table's tensor, written behind the table's back
    with pytest.raises(SharedStorageWrittenError, match="copy=True"):
        fs.restore(parked, "a", "kv")
    assert fs.lookup(parked, "a").get("kv").parked
    with pytest.raises(SharedStorageWrittenError):  # and the older table's own check refuses it too
        fs.writable(s, "a", "kv")


@pytest.mark.parametrize("kind", KINDS)
def test_park_and_restore_every_token_with_a_fork_equal_each_session_decoded_alone(kind):
    caches = sessions(kind)
    m = caches.manager
    prompts = PROMPTS[:3]
    got = {f"s{i}": [caches.begin(f"s{i}", torch.tensor([p]))] for i, p in enumerate(prompts)}
    caches.fork("s0", "f")  # a beam of s0, forced to another first token
    got["f"] = list(got["s0"])
    taken = 0
    for step in range(4):
        for sid in got:
            tok = torch.tensor([[2]]) if sid == "f" and step == 0 else greedy(got[sid][-1])
            got[sid].append(caches.step(sid, tok))
            assert m.stats() == m.stats(exact=True)
            caches.park(sid)
            taken += m.get_session(sid).state.get("kv").host_copy.taken is not None
            assert m.stats() == m.stats(exact=True)
    assert taken >= 12  # (a fork's first park may share a storage with its sharer: that one copies)
    for i, p in enumerate(prompts):
        want = alone(kind, p)[:5]
        assert all(torch.equal(a, b) for a, b in zip(got[f"s{i}"], want, strict=True)), i
    want = alone(kind, prompts[0], forced=[2])[:5]
    assert all(torch.equal(a, b) for a, b in zip(got["f"], want, strict=True))


def test_parking_module_copies_unless_asked_to_take():
    """`park_values` of the caller's own pytree copies: only an object's fields, passed with ``held``, are taken."""
    values = {"x": torch.ones(8)}
    assert parking.park_values(values).taken is None


def test_a_restore_copies_while_the_resident_object_an_older_table_holds_lives():
    """Handed back, the storage would be the older table's and the restored one's alone once the parked copy
    is gone: a write through `writable` there would reach the older table."""
    s = table(fresh)
    parked, _ = fs.park(s, "a", "kv")
    restored, _ = fs.restore(parked, "a", "kv")
    assert not {t.data_ptr() for t in fs.view(restored, "a", "kv")} & {t.data_ptr() for t in fs.view(s, "a", "kv")}
    del parked
    _written, view = fs.writable(restored, "a", "kv")
    for t in view:
        t.fill_(3.0)
    assert all(torch.equal(a, b) for a, b in zip(fs.view(s, "a", "kv"), fresh(), strict=True))


def test_a_taken_park_files_its_host_copy_as_a_read_of_its_buffers_would():
    """The park reads the host figures while it checks the storages; they must equal a fresh read of the host
    buffers (the storages' addresses and bytes, in a host pool), or the ledger would drift from a walk."""
    s = table(fresh)
    ptrs = [t.data_ptr() for t in fs.view(s, "a", "kv")]
    s, _ = fs.park(s, "a", "kv")
    copy = host_copy(s)
    assert copy.taken is not None and copy.host_extents is not None
    read = parking.ParkedStorage(copy.treedef, copy.slots, copy.layout, tuple(copy.buffers))  # (no memo)
    got = sorted((e.pool, e.start, e.end) for e in copy._accounting_extents())
    assert got == sorted((e.pool, e.start, e.end) for e in read._accounting_extents())
    assert got == sorted(("cpu/unpinned_host", p, p + 4 * 64 * 4) for p in ptrs)
    exact(s)
    s, _ = fs.restore(s, "a", "kv")
    exact(s)


@pytest.mark.parametrize("read", [False, True], ids=["views never read", "views read"])
def test_a_restore_hands_back_the_taken_tensors_whether_or_not_their_host_views_were_made(read):
    """The uint8 host views of a taken park are made on first read; each made view holds its storage once
    more, so the restore's count of who holds a storage must follow whether they were made."""
    s = table(fresh)
    before = fs.view(s, "a", "kv")
    ids, ptrs = [id(t) for t in before], [t.data_ptr() for t in before]
    del before
    parked, _ = fs.park(s, "a", "kv")
    del s  # (nothing but the parked copy holds the tensors now)
    if read:
        assert [b.data_ptr() for b in host_copy(parked).buffers] == ptrs
    back, _ = fs.restore(parked, "a", "kv")
    got = fs.view(back, "a", "kv")
    assert [id(t) for t in got] == ids and [t.data_ptr() for t in got] == ptrs  # the very tensors, no copy
    exact(back)
    del parked
    back, view = fs.writable(back, "a", "kv")  # alone now: written in place, no copy
    assert [t.data_ptr() for t in view] == ptrs


@pytest.mark.parametrize("copy", [False, True], ids=["taken", "copied"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copied_table_restores_its_parked_object(how, copy):
    """A pickled or deep-copied table holding a parked object restores it. Seen failing before (review36): a
    taken park compared the copied tensors' fresh version counters with the originals' (a
    SharedStorageWrittenError claiming an in-place write) and kept the original storages' addresses as its
    figures; a copied park failed in the ledger's index of parked copies, keyed by the original's ids."""
    import copy as copy_module
    import pickle

    parked, _ = fs.park(table(fresh), "a", "kv", copy=copy)
    other = pickle.loads(pickle.dumps(parked)) if how == "pickle" else copy_module.deepcopy(parked)
    del parked
    back, _ = fs.restore(other, "a", "kv")
    assert all(torch.equal(a, b) for a, b in zip(fs.view(back, "a", "kv"), fresh(), strict=True))
    exact(back)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copy_of_a_parked_copy_written_in_place_since_still_refuses_its_restore(how):
    import copy as copy_module
    import pickle

    s = table(fresh)
    parked, _ = fs.park(s, "a", "kv")
    fs.view(s, "a", "kv")[0].add_(1.0)  # outside `writable`, through the older table's resident object
    other = pickle.loads(pickle.dumps(parked)) if how == "pickle" else copy_module.deepcopy(parked)
    with pytest.raises(SharedStorageWrittenError, match="written in place since"):
        fs.restore(other, "a", "kv")
