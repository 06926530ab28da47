"""`memory.huge_pages`: a large fresh host allocation an import or a load fills is advised for huge pages, so
its first touch faults a 2 MiB page at a time instead of 4 KiB (issue 36: the 603 MiB import was dominated by
first-touch faults of fresh torch storages)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import numpy as np
import pytest

from functional_state.memory.huge_pages import HUGE_PAGE, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    text = THP.read_text() if THP.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "none"


def test_advice_covers_only_whole_huge_pages_and_never_raises():
    assert advise_huge_pages(0, HUGE_PAGE - 1) is False  # no whole huge page inside: nothing asked
    if sys.platform.startswith("linux"):
        a = np.empty(4 * HUGE_PAGE, np.uint8)
        assert advise_huge_pages(a.ctypes.data + 1, a.nbytes - 1) in (True, False)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_a_torch_storage_an_import_fills_takes_huge_pages():
    # Regression: `persist.read.host_storage` (the memory an import or a load copies into) faulted every
    # 4 KiB page of a fresh torch allocation: 16,384 faults for 64 MiB.
    pytest.importorskip("torch")
    from functional_state.persist.read import host_storage

    nbytes = 64 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    view, owner = host_storage(nbytes)
    view[:] = 1  # the first touch
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < nbytes // 4096 // 4, faults  # 4 KiB pages would be 16,384
    assert owner.untyped_storage().nbytes() == nbytes and owner.untyped_storage().resizable()


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_the_copy_writable_makes_of_a_large_host_storage_takes_huge_pages():
    # The first in-place write after a copy-on-write import copies whole borrowed storages (`writable`):
    # `storage.clone()` faulted every 4 KiB page of the copy.
    torch = pytest.importorskip("torch")
    import functional_state as fs

    nbytes = 64 << 20
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    k = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    s = fs.put(s, "a", "kv", fs.PytreeValue.create({"k": k[8:].view(torch.int16)}))  # (a view: offset kept)
    s = fs.fork_session(s, "a", "b")  # (shared: `writable` must copy it)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    s, kv = fs.writable(s, "a", "kv")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < nbytes // 4096 // 4, faults  # 4 KiB pages would be 16,384
    assert kv["k"].untyped_storage().resizable() and torch.equal(kv["k"], fs.view(s, "b", "kv")["k"])
    assert kv["k"].untyped_storage().data_ptr() != fs.view(s, "b", "kv")["k"].untyped_storage().data_ptr()
