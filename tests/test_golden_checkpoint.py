"""A checkpoint written by functional-state 0.2 (before the layer restructure, issue 20) still loads.

`tests/data/golden_v0_2/` was written once by ``python tests/test_golden_checkpoint.py --write`` on the
flat-layout tree (commit 4a6fee6); the test rebuilds the same values deterministically and compares them
leaf by leaf, so a moved module, a renamed type or a changed manifest codec that breaks old files fails here.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch

import functional_state as fs
from functional_state import ManagerState

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_v0_2"


def build() -> ManagerState:
    """Two sessions holding every checkpoint type resident and parked, a staged ring, and attrs."""
    s = ManagerState.create(max_sessions=4)
    s, _ = fs.get_or_create(s, "a")
    s, _ = fs.get_or_create(s, "b")
    ring = fs.LatentBuffer.create(maxlen=2)
    for i in range(3):  # wrapped: order matters
        ring = ring.commit(torch.arange(4, dtype=torch.float32).reshape(2, 2) + 10 * i)
    s = fs.put(s, "a", "ring", ring.stage(torch.full((2, 2), -1.0)))
    jring = fs.ArrayRing.create(3, (2,), jnp.float32)
    for v in range(4):
        jring = jring.commit(jnp.full(2, float(v)))
    s = fs.put(s, "a", "jring", jring)
    s = fs.put(s, "a", "dense", fs.DenseValue.create([torch.arange(3, dtype=torch.int64), np.arange(2.0)]))
    s = fs.put(s, "b", "pring", fs.LatentBuffer.create(maxlen=2).commit(torch.ones(3, dtype=torch.bfloat16)))
    s = fs.put(s, "b", "pjring", fs.ArrayRing.create(2, (1,), jnp.int32).commit(jnp.array([7], jnp.int32)))
    s = fs.put(s, "b", "pdense", fs.DenseValue.create([jnp.arange(2, dtype=jnp.bfloat16)]))
    for name in ("pring", "pjring", "pdense"):
        s, _ = fs.park(s, "b", name)
    s = fs.set_attr(s, "a", "misc", {"n": 3, "s": "x", "t": (1, 2.5), "none": None})
    s = fs.set_attr(s, "a", "pending", [1, 2], on_fork="copy_container")
    s = fs.set_attr(s, "b", "t", torch.tensor([2**40], dtype=torch.int64))
    return s


def _leaves(state: ManagerState, sid: str) -> dict:
    """Every object's and attr's values as numpy (parked objects restored first), by name."""
    out: dict = {}
    for name, obj in fs.lookup(state, sid).objects.items():
        if obj.parked:
            state, _ = fs.restore(state, sid, name)
    session = fs.lookup(state, sid)
    for name, obj in session.objects.items():
        out[name] = (type(obj).__name__, [_np(x) for x in _values(obj)])
    for name in session.attrs:
        out["attr:" + name] = _plain(fs.get_attr(state, sid, name))
    return out


def _values(obj: fs.StateObject) -> list:
    if isinstance(obj, fs.LatentBuffer):
        return [*obj.items, *([] if obj.staged is None else [obj.staged])]
    if isinstance(obj, fs.ArrayRing):
        return [obj.storage, obj.head, obj.size]
    return list(obj.value)


def _np(x: object) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("torch", str(x.dtype), tuple(x.shape), x.float().numpy().tolist())
    a = np.asarray(x)
    return (type(x).__module__.split(".")[0], str(a.dtype), a.shape, a.astype(np.float64).tolist())


def _plain(v: object) -> object:
    return _np(v) if isinstance(v, torch.Tensor) else v


def test_golden_session_checkpoint_loads_and_equals_the_rebuilt_values():
    want = build()
    got = fs.load_session(ManagerState.create(max_sessions=4), "a", GOLDEN / "session_a")
    assert _leaves(got, "a") == _leaves(want, "a")
    assert fs.lookup(got, "a").objects["ring"].staged is not None


def test_golden_table_checkpoint_loads_every_session_parked_objects_still_parked():
    want = build()
    got = fs.load(GOLDEN / "table")
    assert list(fs.sessions(got)) == list(fs.sessions(want))
    for sid in fs.sessions(want):
        assert _leaves(got, sid) == _leaves(want, sid), sid
    assert all(o.parked for o in fs.lookup(got, "b").objects.values())


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    shutil.rmtree(GOLDEN, ignore_errors=True)
    GOLDEN.mkdir(parents=True)
    state = build()
    fs.save_session(state, "a", GOLDEN / "session_a")
    fs.save(state, GOLDEN / "table")
    print("wrote", GOLDEN)
