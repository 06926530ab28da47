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
