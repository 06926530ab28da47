"""Host buffers for parking (issue 24): a large park after a restore reuses the freed host buffer instead of
taking fresh, page-faulting memory, and a buffer is never handed out again while anything still reads it."""

import resource

import numpy as np
import pytest
import torch

from functional_state import InvalidArgumentError
from functional_state.memory import host_buffers
from functional_state.memory.parking import host_storage, park_values, restore_values

BIG = 64 << 20  # above glibc's largest mmap threshold: without recycling, every buffer is new pages


@pytest.fixture(autouse=True)
def _fresh_cache():
    limit = host_buffers.cache_limit()
    host_buffers.clear_cache()
    yield
    host_buffers.set_cache_limit(limit)
    host_buffers.clear_cache()


def _tensor(n: int, fill: int) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.uint8)


def test_a_park_after_a_restore_takes_no_fresh_pages():
    # Regression: each park of a deploy-shape feat map copied into fresh memory, and the kernel's first-touch
    # faults (zeroing every page) made a park a third of memcpy speed under a byte budget.
    a = {"x": _tensor(BIG, 1)}
    restored = restore_values(park_values(a))  # the host buffer dies here, nothing holds it
    assert torch.equal(restored["x"], a["x"])
    b = {"x": _tensor(BIG, 2)}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    parked = park_values(b)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 16, f"the park faulted {faults} pages in: it took fresh memory, not the freed buffer"
    assert torch.equal(restore_values(parked)["x"], b["x"])


def test_a_buffer_a_parked_copy_still_holds_is_never_reused():
    old = park_values({"x": _tensor(BIG, 3)})  # an older state keeps its parked copy
    restore_values(old)
    new = park_values({"x": _tensor(BIG, 4)})
    assert new.buffers[0].data_ptr() != old.buffers[0].data_ptr()
    assert torch.equal(restore_values(old)["x"], _tensor(BIG, 3))  # untouched by the second park


def test_an_alias_of_the_host_bytes_keeps_the_buffer():
    parked = park_values({"x": _tensor(BIG, 5)})
    alias = host_storage(parked, 0)  # a numpy-backed view of the host buffer, with a storage of its own
    ptr = parked.buffers[0].data_ptr()
    del parked
    assert host_buffers.cached_nbytes() == 0  # the alias still reads it
    fresh = host_buffers.host_buffer(BIG)
    assert fresh.data_ptr() != ptr
    fresh.fill_(9)
    assert torch.equal(alias, _tensor(BIG, 5))
    del alias
    assert host_buffers.cached_nbytes() == BIG  # now it comes back
    assert host_buffers.host_buffer(BIG).data_ptr() == ptr


def test_the_cache_keeps_at_most_its_limit():
    host_buffers.set_cache_limit(BIG)
    bufs = [host_buffers.host_buffer(BIG) for _ in range(3)]
    del bufs
    assert host_buffers.cached_nbytes() == BIG
    host_buffers.set_cache_limit(0)  # lowering the limit trims what is kept
    assert host_buffers.cached_nbytes() == 0
    buf = host_buffers.host_buffer(BIG)
    del buf
    assert host_buffers.cached_nbytes() == 0


def test_clear_cache_frees_every_kept_buffer():
    buf = host_buffers.host_buffer(BIG)
    del buf
    assert host_buffers.clear_cache() == BIG
    assert host_buffers.cached_nbytes() == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GiB", None])
def test_set_cache_limit_refuses_what_is_not_a_byte_count(bad):
    limit = host_buffers.cache_limit()
    with pytest.raises(InvalidArgumentError, match="set_cache_limit"):
        host_buffers.set_cache_limit(bad)
    assert host_buffers.cache_limit() == limit


def test_parks_from_many_threads_each_get_their_own_bytes():
    import threading

    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(10):
            fill = (k * 10 + i) % 251
            parked = park_values({"x": _tensor(4 << 20, fill)})
            if not torch.equal(restore_values(parked)["x"], _tensor(4 << 20, fill)):
                errors.append(f"thread {k}, round {i}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert host_buffers.cached_nbytes() <= host_buffers.cache_limit()


def test_a_fresh_host_buffer_is_64_byte_aligned_so_jax_aliases_a_restored_tensor() -> None:
    """numpy's large arrays start 16 bytes into their mapping; a JAX import needs 64-byte alignment, so a
    restored CPU tensor over a buffer that is not page-aligned was copied by `to_jax`, not aliased."""
    import warnings

    import torch

    import functional_state as fs
    import torch_bridge as tb

    host_buffers.clear_cache()  # (a fresh buffer, not one an earlier test left)
    sizes = [host_buffers.MIN_NBYTES + k * 4096 for k in range(1, 4)]  # sizes no other test caches
    assert all(host_buffers.host_buffer(n).data_ptr() % 64 == 0 for n in sizes)
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.put(s, "a", "b", fs.LatentBuffer.create(maxlen=2))
    s = fs.commit(s, "a", "b", torch.arange(1 << 20, dtype=torch.float32))
    parked, _ = fs.park(s, "a", "b")
    restored, _ = fs.restore(parked, "a", "b")
    (frame,) = fs.view(restored, "a", "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tb.BridgeCopyWarning)
        alias = tb.to_jax(frame)
    assert alias.unsafe_buffer_pointer() == frame.data_ptr()
    assert bool((np.asarray(alias) == np.arange(1 << 20, dtype=np.float32)).all())
