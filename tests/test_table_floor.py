"""The floor of the manager benchmark (benchmarks/bench_manager.py, `floor_*`) is a bound only if it does the
same work: on the benchmark's own id sequences it must hold the same sessions in the same LRU order with
the same ring values as ours and as the OrderedDict baseline, and, like ours, leave every old state valid
and unchanged (persistence is what it is a floor of)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import functional_state as fs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_manager as bm


def _run(n: int, seqs: list[list[str]], reroot: bool = False):
    """Ours, the floor and the OrderedDict after the same ids; item k of the run is the int k."""
    buf = fs.LatentBuffer.create(maxlen=4)
    ours = fs.ManagerState.create(max_sessions=n)
    floor = bm.floor_create(n, reroot)
    od = bm.OrderedDictManager(n)
    for i in range(n):
        sid = f"s{i}"
        ours, _ = fs.get_or_create(ours, sid)
        ours = fs.put(ours, sid, "buf", buf)
        floor, _ = bm.floor_get_or_create(floor, sid)
        floor = bm.floor_put(floor, sid, "buf", ())
        od.op(sid, -1)
    snapshots = []
    k = 0
    for seq in seqs:
        for sid in seq:
            ours, session = fs.get_or_create(ours, sid)
            if not session.objects:
                ours = fs.put(ours, sid, "buf", buf)
            ours = fs.commit(ours, sid, "buf", k)
            floor, fsession = bm.floor_get_or_create(floor, sid)
            if not fsession:
                floor = bm.floor_put(floor, sid, "buf", ())
            floor = bm.floor_commit(floor, sid, "buf", k)
            od.op(sid, k)
            k += 1
        snapshots.append((floor, _floor_contents(floor), list(od.sessions)))
    return ours, floor, od, snapshots


def _floor_contents(floor) -> dict[str, tuple]:
    return {sid: tuple(floor[0][sid][0]["buf"]) for sid in bm.floor_lru(floor)}


@pytest.mark.parametrize("reroot", [False, True], ids=["hamt", "reroot_map"])
@pytest.mark.parametrize("n", [3, 64, 1_000])
def test_floor_matches_ours_and_the_ordered_dict(n, reroot):
    stream = bm._IdStream(n, random.Random(n))
    stream.ops = 2_000 if n < 1_000 else 6_000  # (past a compaction of the 1k log: 4x the table)
    seqs = [stream.sequence() for _ in range(3)]
    ours, floor, od, snapshots = _run(n, seqs, reroot)
    order = list(od.sessions)
    assert bm.floor_lru(floor) == order == list(ours.session_ids) == list(stream.lru)
    rings = {sid: tuple(d["buf"]) for sid, d in od.sessions.items()}
    assert _floor_contents(floor) == rings
    assert {sid: fs.view(ours, sid, "buf") for sid in order} == rings
    assert len(floor[0]) == n
    # Every old state is unchanged by all that came after it.
    for old, contents, old_order in snapshots:
        assert _floor_contents(old) == contents and list(contents) == old_order


@pytest.mark.parametrize("reroot", [False, True], ids=["hamt", "reroot_map"])
def test_floor_old_states_branch(reroot):
    """A table derived from an old state (its window ends before the log does) branches the log: both the
    old line and the new one keep their own order."""
    s = bm.floor_create(3, reroot)
    for sid in "abc":
        s, _ = bm.floor_get_or_create(s, sid)
        s = bm.floor_put(s, sid, "buf", ())
    old = s
    s, _ = bm.floor_get_or_create(s, "a")
    s = bm.floor_commit(s, "a", "buf", 1)
    s, _ = bm.floor_get_or_create(s, "d")  # evicts b
    t, _ = bm.floor_get_or_create(old, "b")  # from the old state: a branch
    t = bm.floor_commit(t, "b", "buf", 2)
    t, _ = bm.floor_get_or_create(t, "e")  # evicts a
    assert bm.floor_lru(old) == ["a", "b", "c"]
    assert bm.floor_lru(s) == ["c", "a", "d"]
    assert bm.floor_lru(t) == ["c", "b", "e"]
    assert t[0]["b"][0]["buf"] == (2,) and s[0]["a"][0]["buf"] == (1,) and old[0]["a"][0]["buf"] == ()


def test_floor_hits_without_commits():
    """A hit not followed by a commit still moves its session: the next hit settles its tick in the node."""
    s = bm.floor_create(3)
    for sid in "abc":
        s, _ = bm.floor_get_or_create(s, sid)
    for sid in "aba":
        s, _ = bm.floor_get_or_create(s, sid)
    s, _ = bm.floor_get_or_create(s, "d")  # evicts c, the least recent
    assert bm.floor_lru(s) == ["b", "a", "d"]


# --- the compiled floor (benchmarks/manager_floor.py): bench_manager's ``floor compiled`` row -------------
@pytest.fixture(scope="module")
def mf():
    """`manager_floor` as the bench runs it: compiled by mypyc when mypyc is installed, else its source
    (the same checks hold for both)."""
    return bm.compiled_floor()


def _compiled_contents(mf, t) -> dict[str, tuple]:
    return {sid: mf.ring_of(t, sid, "buf") for sid in mf.lru(t)}


@pytest.mark.parametrize("n", [3, 64, 1_000])
def test_compiled_floor_matches_ours_and_the_ordered_dict(mf, n):
    stream = bm._IdStream(n, random.Random(n))
    stream.ops = 2_000 if n < 1_000 else 6_000  # (past a compaction of the 1k log: 4x the table)
    ours = fs.ManagerState.create(max_sessions=n)
    buf = fs.LatentBuffer.create(maxlen=4)
    t = bm._compiled_floor_table(mf, n)
    od = bm.OrderedDictManager(n)
    for i in range(n):
        ours, _ = fs.get_or_create(ours, f"s{i}")
        ours = fs.put(ours, f"s{i}", "buf", buf)
        od.op(f"s{i}", -1)
    snapshots = []
    k = 0
    for _ in range(3):
        for sid in stream.sequence():
            ours, session = fs.get_or_create(ours, sid)
            if not session.objects:
                ours = fs.put(ours, sid, "buf", buf)
            ours = fs.commit(ours, sid, "buf", k)
            t, objects = mf.get_or_create(t, sid)
            if not objects:
                t = mf.put(t, sid, "buf", ())
            t = mf.commit(t, sid, "buf", k)
            od.op(sid, k)
            k += 1
        snapshots.append((t, _compiled_contents(mf, t), list(od.sessions)))
    order = list(od.sessions)
    assert mf.lru(t) == order == list(ours.session_ids) == list(stream.lru)
    rings = {sid: tuple(d["buf"]) for sid, d in od.sessions.items()}
    assert _compiled_contents(mf, t) == rings
    assert {sid: fs.view(ours, sid, "buf") for sid in order} == rings
    assert len(t.nodes) == n
    for old, contents, old_order in snapshots:  # every old state unchanged by all that came after it
        assert _compiled_contents(mf, old) == contents and list(contents) == old_order


def test_compiled_floor_old_states_branch(mf):
    """As `test_floor_old_states_branch`, on the compiled floor: both lines keep their own order and rings."""
    s = mf.create(3)
    for sid in "abc":
        s, _ = mf.get_or_create(s, sid)
        s = mf.put(s, sid, "buf", ())
    old = s
    s, _ = mf.get_or_create(s, "a")
    s = mf.commit(s, "a", "buf", 1)
    s, _ = mf.get_or_create(s, "d")  # evicts b
    t, _ = mf.get_or_create(old, "b")  # from the old state: a branch
    t = mf.commit(t, "b", "buf", 2)
    t, _ = mf.get_or_create(t, "e")  # evicts a
    assert mf.lru(old) == ["a", "b", "c"]
    assert mf.lru(s) == ["c", "a", "d"]
    assert mf.lru(t) == ["c", "b", "e"]
    assert mf.ring_of(t, "b", "buf") == (2,) and mf.ring_of(s, "a", "buf") == (1,)
    assert mf.ring_of(old, "a", "buf") == ()


def test_compiled_floor_is_compiled_where_mypyc_is(mf):
    """The bench's row is labelled compiled only when it is: with mypyc installed the module is the extension."""
    pytest.importorskip("mypyc")
    assert bm.floor_is_compiled() and not mf.__file__.endswith(".py")
