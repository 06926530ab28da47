"""A copy-on-write import through Ray's real object store: ``ray.get``'s buffers are borrowed (no copy),
`writable` copies before the first in-place write, the object's bytes never change, and the next step is
bit-identical to the session continued at its source. One local Ray (localhost only, no dashboard)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from test_transfer_borrowed import _inside, _source, _step, _storage_ptrs

import functional_state as fs
from functional_state import ManagerState
from functional_state.memory.outside_readers import immutable, read_outside
from functional_state.transfer import SessionBlob, export_session, import_session

ray = pytest.importorskip("ray")
from ray._private.internal_api import memory_summary  # noqa: E402

STORE = 96 << 20  # (small: filling it past its capacity is quick)
SURVIVORS: list[tuple[ManagerState, str]] = []  # borrowed sessions and their digests, checked after `ray.shutdown`


@pytest.fixture(scope="module")
def local_ray():
    tests = Path(__file__).resolve().parent  # (an importing actor imports this checkout and this module)
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=STORE,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])
            }
        },
    )
    try:
        yield ray
    finally:
        ray.shutdown()
    # The store's process is gone; its memory stays mapped (and unchanged) while a session's storages use it.
    survivors = SURVIVORS[:]
    SURVIVORS.clear()
    for t, want in survivors:
        assert all(read_outside(x) for x in fs.view(t, "a", "kv").values())
        assert _digest(t) == want, "a session borrowing the store's memory changed once Ray was shut down"


def test_an_import_from_the_object_store_borrows_its_buffers_and_copies_on_first_write(local_ray):
    s = _source()
    blob = export_session(s, "a")
    manifest, buffers = ray.put(blob.manifest_bytes()), ray.put(list(blob.buffers))
    del blob
    got = ray.get(buffers)
    assert all(immutable(b) for b in got)  # (the store's sealed memory, read in place)
    before = [b.copy() for b in got]
    t = import_session(ManagerState.create(), SessionBlob.from_parts(ray.get(manifest), got))
    assert _inside(_storage_ptrs(t, "a"), tuple(got))
    assert all(read_outside(x) for x in fs.view(t, "a", "kv").values())
    assert fs.stats(t) == fs.stats(t, exact=True)

    s, expected = _step(s, "a")
    t, out = _step(t, "a")
    assert torch.equal(out, expected)
    assert all(np.array_equal(a, b) for a, b in zip(ray.get(buffers), before))  # the object is unchanged
    again = import_session(ManagerState.create(), SessionBlob.from_parts(ray.get(manifest), ray.get(buffers)))
    first = fs.view(_source(), "a", "kv")
    assert all(torch.equal(fs.view(again, "a", "kv")[k], first[k]) for k in first)


# The session borrows the store's memory: whatever happens to the object's owner, its refs or the store around it,
# its bytes must stay the exported ones. Each case fills the store past its capacity with new objects (plasma
# reuses freed memory, and spills held objects to disk), so a buffer the store let go of would be rewritten.

MIB = 1 << 20
BIG = 2 * MIB  # (floats per K/V tensor: an 8 MiB session, two store-sized buffers)


def _big_source() -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    g = torch.Generator().manual_seed(1)
    kv = {"k": torch.randn(4, BIG // 4, generator=g), "v": torch.randn(BIG, generator=g)}
    return fs.put(s, "a", "kv", fs.PytreeValue.create(kv))


def _big_step(state: ManagerState) -> tuple[ManagerState, torch.Tensor]:
    state, kv = fs.writable(state, "a", "kv")
    kv["k"].index_copy_(0, torch.tensor([2]), torch.full((1, BIG // 4), 0.25))
    kv["v"].mul_(3)
    return fs.commit(state, "a", "kv", kv), (kv["k"].sum(1) + kv["v"].sum()).clone()


def _digest(state: ManagerState) -> str:
    """SHA-256 of every byte of the session (its export's buffers: views of its storages, so the borrowed memory
    itself is read) and of its manifest's leaves."""
    blob = export_session(state, "a")
    h = hashlib.sha256(json.dumps(blob.manifest["leaves"], sort_keys=True).encode())
    for b in blob.buffers:
        h.update(b)
    return h.hexdigest()


def _fill_store(rounds: int = 2) -> None:
    """Put new objects past the store's capacity (held, so older ones spill), then drop them (freed, so their
    memory is reused by the next round), each object a different byte pattern."""
    for r in range(rounds):
        held = [ray.put(np.full(8 * MIB, 17 + 10 * r + i, np.uint8)) for i in range(STORE // (8 * MIB) + 4)]
        del held
        gc.collect()


def _check_borrowed(t: ManagerState, want: str) -> None:
    """After the store was filled: still borrowed, bit-exact, accounted exactly, and its next step is the
    source's."""
    assert all(read_outside(x) for x in fs.view(t, "a", "kv").values())  # (still the store's memory, not a copy)
    assert _digest(t) == want
    assert fs.stats(t) == fs.stats(t, exact=True)
    _, expected = _big_step(_big_source())
    t, out = _big_step(t)
    assert torch.equal(out, expected)
    assert fs.stats(t) == fs.stats(t, exact=True)


def _owner_actor() -> Any:
    # (defined here so Ray ships the class by value: the worker imports nothing of this project)
    @ray.remote(num_cpus=0, max_restarts=0)
    class Owner:
        def pid(self) -> int:
            return os.getpid()

        def put(self, manifest: bytes, buffers: list[np.ndarray]) -> list[Any]:
            self.refs = [ray.put(manifest), ray.put(list(buffers))]  # (this process owns these objects)
            return self.refs

        def give(self, manifest: bytes, buffers: list[np.ndarray]) -> list[Any]:
            return [manifest, [b.copy() for b in buffers]]  # (a task's return: sealed in the store by this worker)

    return Owner.remote()


def _kill(owner: Any) -> None:
    pid = ray.get(owner.pid.remote())
    ray.kill(owner, no_restart=True)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
        time.sleep(0.05)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", "the owner did not die"


@pytest.mark.parametrize("how", ["put", "give"])
def test_a_borrowed_session_outlives_the_process_that_made_its_object(local_ray, how):
    blob = export_session(_big_source(), "a")
    want = _digest(_big_source())
    owner = _owner_actor()
    parts = getattr(owner, how).remote(blob.manifest_bytes(), list(blob.buffers))
    manifest, buffers = ray.get(parts)
    if how == "put":
        manifest, buffers = ray.get(manifest), ray.get(buffers)
    del blob, parts
    assert all(immutable(b) for b in buffers)
    t = import_session(ManagerState.create(), SessionBlob.from_parts(manifest, buffers))
    del manifest, buffers
    _kill(owner)  # the owner dies while the session borrows its object
    gc.collect()
    _fill_store()
    _check_borrowed(t, want)


def test_a_borrowed_session_outlives_every_ref_to_its_object(local_ray):
    blob = export_session(_big_source(), "a")
    want = _digest(_big_source())
    manifest, buffers = ray.put(blob.manifest_bytes()), ray.put(list(blob.buffers))
    del blob
    t = import_session(ManagerState.create(), SessionBlob.from_parts(ray.get(manifest), ray.get(buffers)))
    del manifest, buffers  # only the session's storages (over the store's views) are left
    gc.collect()
    _fill_store()
    SURVIVORS.append((t, want))  # (checked again once Ray is shut down, by `local_ray`)
    _check_borrowed(t, want)


def test_a_borrowed_session_holds_while_the_store_spills_and_restores(local_ray):
    blob = export_session(_big_source(), "a")
    want = _digest(_big_source())
    manifest, ref = blob.manifest, ray.put(list(blob.buffers))
    t = import_session(ManagerState.create(), SessionBlob(manifest, ray.get(ref)))
    del blob
    gc.collect()
    held = [ray.put(np.full(8 * MIB, 101 + i, np.uint8)) for i in range(STORE // (8 * MIB) + 4)]
    assert "Spilled" in memory_summary(stats_only=True)  # (the store was past its capacity: objects went to disk)
    assert _digest(t) == want
    for i, r in enumerate(held):  # restored from disk into the store, over whatever memory is free
        assert ray.get(r)[0] == 101 + i
    del held
    gc.collect()
    _fill_store()
    assert _digest(t) == want
    again = ray.get(ref)  # (the session's object itself, read back: never spilled from under the session)
    assert _digest(import_session(ManagerState.create(), SessionBlob(manifest, again))) == want
    del ref, again
    _check_borrowed(t, want)


def _importer_actor() -> Any:
    @ray.remote(num_cpus=0, max_restarts=0)
    class Importer:
        def accept(self, manifest: bytes, buffers: list[np.ndarray]) -> str:
            """Import from the task's arguments (what `SessionReplica.accept` does): read in place, borrowed."""
            assert all(immutable(b) for b in buffers)
            self.t = import_session(ManagerState.create(), SessionBlob.from_parts(manifest, buffers))
            return _digest(self.t)

        def check(self) -> tuple[bool, str, bool, bool]:
            borrowed = all(read_outside(x) for x in fs.view(self.t, "a", "kv").values())
            _, expected = _big_step(_big_source())
            t, out = _big_step(self.t)
            exact = fs.stats(self.t) == fs.stats(self.t, exact=True) and fs.stats(t) == fs.stats(t, exact=True)
            return borrowed, _digest(self.t), exact, bool(torch.equal(out, expected))

    return Importer.remote()


def test_a_session_imported_from_a_calls_arguments_outlives_the_caller_that_owned_them(local_ray):
    """A replica's move: ``accept``'s arguments are objects another process put (and owns), the receiving
    actor imports them borrowed from the task's arguments, the call returns, and their owner dies."""
    blob = export_session(_big_source(), "a")
    want = _digest(_big_source())
    owner, importer = _owner_actor(), _importer_actor()
    manifest, buffers = ray.get(owner.put.remote(blob.manifest_bytes(), list(blob.buffers)))
    assert ray.get(importer.accept.remote(manifest, buffers)) == want  # (Ray resolves them: the store's memory)
    del blob, manifest, buffers
    _kill(owner)
    gc.collect()
    _fill_store()
    assert ray.get(importer.check.remote()) == (True, want, True, True)
    ray.kill(importer, no_restart=True)
