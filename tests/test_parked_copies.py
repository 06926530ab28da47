"""Tests of `memory/parked_copies.py`: parked bytes are kept, not read from every copy, and copies over
memory they did not allocate count as their union."""

import numpy as np
import torch

import functional_state as fs
from functional_state.memory import accounting
from helpers import table_with_attrs


def test_parked_bytes_are_kept_not_read_from_every_copy(monkeypatch):
    # Regression (issue 24): stats() read every parked host copy for ``parked_nbytes`` (8 us per copy:
    # 92 ms with 10,000 sessions parked). The ledger keeps those bytes as copies come and go: one stats
    # call reads no copy, and agrees with a walk of them.
    n = 40
    state = table_with_attrs(n, lambda i: np.zeros(2, np.float32))
    for i in range(n):
        state, _ = fs.park(state, f"s{i}", "buf")
    state = fs.commit(fs.restore(state, "s3", "buf")[0], "s3", "buf", torch.ones(4))  # one copy let go
    reads = []
    real = accounting.collect_extents
    monkeypatch.setattr(accounting, "collect_extents", lambda root, *a: reads.append(root) or real(root, *a))
    kept = fs.stats(state)["parked_nbytes"]
    assert reads == []
    monkeypatch.undo()
    assert kept == fs.stats(state, exact=True)["parked_nbytes"] == (n - 1) * 16


def test_parked_copies_over_memory_they_did_not_allocate_count_as_their_union():
    from functional_state.memory.parked_copies import NO_COPIES

    base = torch.from_numpy(np.zeros(32, np.float32))  # storages torch did not allocate: `Loose` extents
    # Bytes 0-64 and 32-128 of one buffer, and the storage of all 128 (a view counts its storage).
    copies = [torch.from_numpy(base.numpy()[:16]), torch.from_numpy(base.numpy()[8:]), base[:4]]
    index = NO_COPIES.change([[c] for c in copies[:2]], [])
    assert index.loose and index.total() == accounting.total_nbytes(*copies[:2]) == 128  # not 64 + 96
    index = index.change([[copies[2]]], [[copies[1]]])
    assert index.total() == accounting.total_nbytes(copies[0], copies[2]) == 128
    index = index.change([[copies[0]]], [[copies[0]], [copies[2]]])  # a second holder of one, then both go
    assert index.total() == 64 and len(index) == 1
    index = index.change([], [[copies[0]]])
    assert (index.total(), index.loose, len(index)) == (0, 0, 0)
