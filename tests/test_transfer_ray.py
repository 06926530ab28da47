"""A copy-on-write import through Ray's real object store: ``ray.get``'s buffers are borrowed (no copy),
`writable` copies before the first in-place write, the object's bytes never change, and the next step is
bit-identical to the session continued at its source. One local Ray (localhost only, no dashboard)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_transfer_borrowed import _inside, _source, _step, _storage_ptrs

import functional_state as fs
from functional_state import ManagerState
from functional_state.memory.outside_readers import immutable, read_outside
from functional_state.transfer import SessionBlob, export_session, import_session

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=128 << 20)
    try:
        yield ray
    finally:
        ray.shutdown()


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
