"""Parking: tensors whose values are not the bytes of one strided storage, and the small-tensor path (issue 24).

A quantized tensor passed every check of the plain and raw paths and its storage was copied as bytes:
the copy crashed the process (a segfault in ``torch.cat``), and through the manager a commit accepts one,
so a park under a budget took a server down. Sparse, mkldnn and nested tensors raised torch's own
``RuntimeError`` from inside the copy. Each is now refused with `InvalidTypeError`, naming the leaf, before
anything moves, on the small-tensor fast path (every leaf a tensor) and on the general path alike."""

import gc
import warnings

import pytest
import torch

import functional_state as fs
from functional_state.memory import host_buffers
from functional_state.memory.parking import host_storage, park_values, restore_values
from helpers import assert_unchanged, snapshot


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch deprecates quantized tensors, not yet removes them)
        return torch.quantize_per_tensor(torch.tensor([1.0, 2.0, 3.0]), 0.5, 3, torch.quint8)


def _sparse() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))


UNCOPYABLE = {
    "quantized": (_quantized, "quantized"),
    "sparse coo": (_sparse, "sparse_coo"),
    "sparse csr": (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
    "mkldnn": (lambda: torch.randn(2, 3).to_mkldnn(), "mkldnn"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    "meta": (lambda: torch.empty(3, device="meta"), "meta"),
}


@pytest.mark.parametrize("path", ["every leaf a tensor", "mixed leaves"])
@pytest.mark.parametrize("kind", list(UNCOPYABLE))
def test_a_tensor_that_is_not_one_strided_storage_is_refused_naming_its_leaf(kind, path):
    make, word = UNCOPYABLE[kind]
    others = [torch.ones(2)] if path == "every leaf a tensor" else [torch.arange(6.0)[1:], 7]
    values = {"x": [*others, make()]}
    where = rf"\['x'\]\[{len(others)}\]"
    with pytest.raises(fs.InvalidTypeError, match=rf"`park_values`: the tensor at {where} is a {word}.*nothing was"):
        park_values(values)


def test_a_quantized_tensor_committed_through_the_manager_is_refused_and_the_session_kept():
    m = fs.SessionStateManager()
    h = m.get_or_create_session("a").put("b", fs.DenseValue.create([torch.ones(4), _quantized()]))
    before, stats = snapshot(m.state), m.stats()
    with pytest.raises(fs.InvalidTypeError, match="quantized"):
        h.park("b")
    assert_unchanged(m.state, before)
    assert m.stats() == stats


def test_plain_tensors_around_a_refused_one_still_park_once_it_is_gone():
    values = [torch.randn(5) for _ in range(8)]
    back = restore_values(park_values(values))
    assert all(torch.equal(a, b) for a, b in zip(values, back))


# --- many small tensors: one host buffer, recycled ------------------------------------------------------
# Each 256 KiB run of small storages had a malloc buffer of its own, whose pages the heap trimmed when the
# parked copy died: a park/restore cycle of 4,096 small tensors page-faulted ~4,000 times per park (6x the
# park itself). The runs now share one host buffer from `host_buffers`, recycled once nothing holds it.


def test_runs_of_small_storages_share_one_host_buffer_that_a_later_park_reuses():
    values = [torch.randn(1024) for _ in range(1024)]  # 4 MiB in 4 KiB tensors: 16 runs of 256 KiB
    nbytes = sum(t.nbytes for t in values)
    assert nbytes >= host_buffers.MIN_NBYTES and host_buffers.cache_limit() >= nbytes
    parked = park_values(values)
    assert len(parked.buffers) == 1 and parked.buffers[0].untyped_storage().nbytes() == nbytes
    first = parked.buffers[0].data_ptr()
    for k in (0, 700, 1023):  # each storage where the layout says, in the one buffer
        assert torch.equal(host_storage(parked, k), values[k].view(torch.uint8))
    back = restore_values(parked)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(values, back))
    del parked
    gc.collect()
    again = park_values(values)
    assert again.buffers[0].data_ptr() == first  # the same pages, not fresh ones from the kernel
    assert all(torch.equal(a, b) for a, b in zip(values, restore_values(again)))


def test_a_large_storage_keeps_a_buffer_of_its_own_beside_the_shared_one():
    big = torch.randn(host_buffers.MIN_NBYTES // 4 + 5)  # a run of its own
    values = [*(torch.randn(1024) for _ in range(600)), big, torch.arange(7, dtype=torch.int16)]
    parked = park_values(values)
    sizes = sorted(b.untyped_storage().nbytes() for b in parked.buffers)
    assert sizes == sorted([big.nbytes, 600 * 4096 + 14])
    back = restore_values(parked)
    assert all(torch.equal(a, b) for a, b in zip(values, back))


def test_the_shared_buffer_is_accounted_exactly_through_the_manager():
    m = fs.SessionStateManager()
    h = m.get_or_create_session("a").put("b", fs.DenseValue.create([torch.randn(1024) for _ in range(700)]))
    h.park("b")
    stats = m.stats()
    assert stats == m.stats(exact=True)
    assert stats["parked_nbytes"] == 700 * 4096 and stats["nbytes:cpu/unpinned_host"] == 700 * 4096
    h.restore("b")
    assert m.stats() == m.stats(exact=True) and m.stats()["parked_nbytes"] == 0


ODD = {  # one leaf that is not plain, late in a long list of plain ones (the fast path checks in blocks)
    "requires grad": lambda xs: torch.randn(3).requires_grad_(),
    "a view of an earlier leaf": lambda xs: xs[0][1:],
    "an earlier leaf again": lambda xs: xs[3],
    "0-d": lambda xs: torch.tensor(2.5),
    "transposed": lambda xs: torch.randn(3, 4).t(),
    "negative bit": lambda xs: torch._neg_view(torch.randn(5)),
    "other dtype": lambda xs: torch.arange(6, dtype=torch.int64),
    "one element, odd stride": lambda xs: torch.randn(4, 2)[:1, 0],
}


@pytest.mark.parametrize("odd", list(ODD))
def test_a_non_plain_leaf_deep_in_a_long_list_round_trips_exactly(odd):
    values = [torch.randn(8) for _ in range(700)]
    values.insert(600, ODD[odd](values))
    back = restore_values(park_values(values))
    for a, b in zip(values, back):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert (a.is_neg(), a.requires_grad) == (b.is_neg(), b.requires_grad)
        assert torch.equal(a.detach(), b.detach())
    shares = [b.untyped_storage().data_ptr() == back[0].untyped_storage().data_ptr() for b in back]
    assert shares == [a.untyped_storage().data_ptr() == values[0].untyped_storage().data_ptr() for a in values]


def test_an_uncopyable_tensor_deep_in_a_long_list_is_refused():
    values = [torch.randn(8) for _ in range(700)]
    values.insert(600, _quantized())
    with pytest.raises(fs.InvalidTypeError, match=r"the tensor at \[600\] is a quantized"):
        park_values(values)


def test_runs_after_an_odd_sized_storage_in_the_shared_buffer_round_trip_exactly():
    values = [torch.tensor([True, False, True]), *(torch.randn(1024) for _ in range(700))]  # later runs start off 4
    values.append(torch.randn(3, 5).to(torch.bfloat16))
    parked = park_values(values)
    assert len(parked.buffers) == 1
    back = restore_values(parked)
    for a, b in zip(values, back):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8) if b.dtype == torch.bool else b
        )
