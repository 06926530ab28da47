"""Host buffers the package allocates (a restore's large CPU storages) count as allocations, not `Loose`
extents: a park/restore cycle keeps the CPU pool on the additive path, and the totals stay exact."""

from __future__ import annotations

import gc

import numpy as np
import torch

import functional_state as fs
from functional_state.memory import host_buffers
from functional_state.memory.aliases import OWNED
from functional_state.table.manager_state import ledger_of

BIG = 1 << 20  # float32 elements: 4 MiB, above host_buffers.MIN_NBYTES (a restore's own host buffer)


def _parked_and_restored() -> tuple[fs.ManagerState, fs.ManagerState]:
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.put(s, "a", "b", fs.LatentBuffer.create(maxlen=4))
    for i in range(2):
        s = fs.commit(s, "a", "b", torch.full((BIG,), float(i)))
    parked, _ = fs.park(s, "a", "b", copy=True)  # (a private host copy: restored into the package's buffers)
    restored, _ = fs.restore(parked, "a", "b")
    return s, restored


def test_a_restored_large_cpu_storage_is_an_allocation_not_a_loose_extent() -> None:
    before, restored = _parked_and_restored()
    assert not ledger_of(restored).overlaps  # no union index: the pool stays additive
    assert fs.stats(restored) == fs.stats(restored, exact=True)
    assert fs.stats(restored)["nbytes:cpu"] == fs.stats(before)["nbytes:cpu"] == 2 * 4 * BIG
    frames = fs.view(restored, "a", "b")
    assert [float(f[0]) for f in frames] == [0.0, 1.0]
    assert all(("cpu", f.data_ptr(), f.data_ptr() + 4 * BIG) in OWNED for f in frames)


def test_a_user_view_into_a_restored_buffer_is_still_unioned() -> None:
    _, restored = _parked_and_restored()
    frame = fs.view(restored, "a", "b")[0]
    inner = torch.from_numpy(frame.numpy()[: BIG // 2])  # memory inside the restored buffer, not allocated
    s, _ = fs.get_or_create(restored, "c")
    s = fs.put(s, "c", "b", fs.LatentBuffer.create(maxlen=4))
    s = fs.commit(s, "c", "b", inner)
    assert ledger_of(s).overlaps  # the Loose extent makes its pool a union
    assert fs.stats(s) == fs.stats(s, exact=True)
    assert fs.stats(s)["nbytes:cpu"] == fs.stats(restored)["nbytes:cpu"]  # counted once


def test_a_host_buffer_leaves_the_owned_set_when_its_storage_dies() -> None:
    buf = host_buffers.host_buffer(host_buffers.MIN_NBYTES)
    extent = ("cpu", buf.data_ptr(), buf.data_ptr() + host_buffers.MIN_NBYTES)
    assert extent in OWNED
    del buf
    gc.collect()
    assert extent not in OWNED


def test_from_numpy_of_a_users_array_stays_loose() -> None:
    x = np.zeros(host_buffers.MIN_NBYTES, np.uint8)
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.put(s, "a", "b", fs.LatentBuffer.create(maxlen=4))
    s = fs.commit(fs.commit(s, "a", "b", torch.from_numpy(x[:100])), "a", "b", torch.from_numpy(x))
    assert ledger_of(s).overlaps
    assert fs.stats(s) == fs.stats(s, exact=True)
    assert fs.stats(s)["nbytes:cpu"] == x.nbytes
