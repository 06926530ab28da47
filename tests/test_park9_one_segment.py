"""Many small plain 1-D tensors of one dtype park as one segment of one shared host buffer (issue 24, park9).

The runs of at most `parking._CHUNK` bytes all land back to back in the shared buffer, so the park copies them
with one ``torch.cat`` and the restore splits them with one call; the host bytes must be the storages' own, back
to back, and the restore one allocation per storage, bit for bit.
"""

import torch

from functional_state.memory import host_buffers, parking
from functional_state.memory.parking import park_values, restore_values


def _tensors(n: int, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n + numel)
    return [torch.randn(numel, generator=g).to(dtype) for _ in range(n)]


def test_a_uniform_list_parks_as_one_segment_holding_each_storage_back_to_back():
    values = _tensors(600, 1024)  # 2.3 MiB: over the shared buffer's threshold, every storage under a run
    assert sum(t.nbytes for t in values) >= host_buffers.MIN_NBYTES and parking._CHUNK >= 4096
    one = park_values(values)
    assert len(one.buffers) == 1 and len(one.layout.segments) == 1
    assert torch.equal(one.buffers[0], torch.cat(values).view(torch.uint8))
    assert [(s.buffer, s.start, s.nbytes) for s in one.storages] == [(0, 4096 * k, 4096) for k in range(600)]
    assert [leaf.shape for leaf in one.leaves] == [(1024,)] * 600
    back = restore_values(one)
    assert [t.dtype for t in back] == [t.dtype for t in values]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(back, values))
    assert len({t.untyped_storage().data_ptr() for t in back}) == len(values)  # one allocation per storage
    assert all(t.untyped_storage().nbytes() == t.nbytes and t.stride() == (1,) for t in back)


def test_a_uniform_list_under_the_shared_threshold_or_with_a_large_storage_keeps_its_runs():
    small = park_values(_tensors(64, 1024, torch.bfloat16))  # 128 KiB: no shared buffer
    assert small.layout.segments and len(small.buffers) == len(small.layout.segments)
    values = [*_tensors(600, 1024), torch.randn(100_000)]  # one storage over a run: it gets a buffer of its own
    parked = park_values(values)
    assert len(parked.buffers) == 2
    back = restore_values(parked)
    assert all(torch.equal(a, b) for a, b in zip(back, values))
