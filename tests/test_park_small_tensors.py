"""Parking many small CPU tensors (issue 24): the plain path (a storage a tensor spans exactly) copies the
tensors themselves in one ``torch.cat`` per run and restores them with one ``split_with_sizes_copy``, without
per-tensor Python objects; every result must stay what the general path gave, bit for bit."""

import gc

import numpy as np
import pytest
import torch

from functional_state.memory import parking
from functional_state.memory.parking import host_storage, park_values, rebuild_leaf, restore_values
from functional_state.memory.torch_host import TorchLeaf

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.uint8, torch.int8]
DTYPES += [torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.complex128]


def _raw(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes seen as ``dtype``: NaN payloads, negative zeros, bools that are neither 0 nor 1."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().resolve_conj().resolve_neg())  # unit strides
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _storage_bits(t: torch.Tensor) -> bytes:
    """The raw bytes of the whole storage (no dtype copy that could normalise a value)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
    assert (a.is_conj(), a.is_neg(), a.requires_grad) == (b.is_conj(), b.is_neg(), b.requires_grad)
    assert _bits(a) == _bits(b) and _storage_bits(a) == _storage_bits(b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_small_tensors_of_every_dtype_round_trip_bit_exact_into_separate_storages(dtype):
    tensors = [_raw(dtype, (33,), seed) for seed in range(50)] + [_raw(dtype, (3, 5, 2), 99), _raw(dtype, (2,), 7)]
    parked = park_values(tensors)
    back = restore_values(parked)
    for a, b in zip(back, tensors):
        _same(a, b)
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()  # exactly its own bytes
    assert len({t.untyped_storage().data_ptr() for t in back}) == len(tensors)  # separate stay separate
    back[0].view(torch.uint8).fill_(0)  # a restored tensor is its own memory: the parked copy is untouched
    _same(restore_values(parked)[0], tensors[0])


def test_mixed_dtypes_shapes_and_odd_starts_in_one_host_buffer():
    # A 3-byte int8 storage puts the float32 storages after it off their 4-byte alignment in the host buffer.
    tensors = [_raw(torch.int8, (3,), 1), _raw(torch.float32, (4, 2), 2), _raw(torch.float32, (5, 2), 3)]
    tensors += [_raw(torch.float32, (2, 3), 4), _raw(torch.bfloat16, (7,), 5), _raw(torch.int64, (1, 1), 6)]
    tensors += [torch.empty_strided((3, 1), (1, 9)).fill_(2.0), torch.empty_strided((1,), (5,)).fill_(3.0)]
    parked = park_values(tensors)
    assert len(parked.buffers) == 1 and parked.nbytes == sum(t.untyped_storage().nbytes() for t in tensors)
    for a, b in zip(restore_values(parked), tensors):
        _same(a, b)


def test_aliases_the_same_tensor_twice_and_requires_grad_keep_their_meaning():
    base = torch.arange(12.0)
    w = torch.ones(4, requires_grad=True)
    tensors = [base, base.view(3, 4), base, w, torch.zeros(0), torch.tensor(5.0), base[2:5]]
    back = restore_values(park_values(tensors))
    for a, b in zip(back, tensors):
        _same(a, b)
    assert len({back[i].untyped_storage().data_ptr() for i in (0, 1, 2, 6)}) == 1  # one storage, as before
    back[1][0, 0] = -1.0
    assert back[0][0] == -1.0 and back[2][0] == -1.0
    assert back[3].is_leaf and back[3].requires_grad


def test_the_recipes_written_out_on_request_rebuild_every_leaf_from_the_host_copy():
    # What a checkpoint of a parked object reads: per leaf a TorchLeaf, per storage its bytes in the host buffer.
    tensors = [_raw(torch.float32, (6,), 1), _raw(torch.int16, (2, 3), 2), torch.arange(10.0)[1:4]]
    parked = park_values(tensors)
    assert all(isinstance(leaf, TorchLeaf) for leaf in parked.leaves)
    assert [s.nbytes for s in parked.storages] == [24, 12, 40]
    for leaf, t in zip(parked.leaves, tensors):
        _same(rebuild_leaf(leaf, host_storage(parked, leaf.storage)), t)


def test_parking_many_small_tensors_creates_no_python_object_per_tensor():
    # Regression: each park made a TorchLeaf per tensor and a _Storage per storage (8,192 objects for 4,096
    # tensors); with the collector on, they made the coalesced park of small tensors slower than a clone loop.
    tensors = [torch.randn(256) for _ in range(2048)]
    park_values(tensors)
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        parked = park_values(tensors)
        made = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert made < 200, f"a park of 2,048 tensors left {made} tracked objects"
    assert all(torch.equal(a, b) for a, b in zip(restore_values(parked), tensors))


def test_a_chunked_park_restores_exactly(monkeypatch):
    monkeypatch.setattr(parking, "_CHUNK", 100)  # runs of at most 100 bytes: plain segments end with the run
    tensors = [_raw(torch.float32, (n,), n) for n in (1, 7, 30, 2, 25, 5)]
    parked = park_values(tensors)
    assert len(parked.buffers) == 5  # 4+28 | 120 | 8 | 100 | 20 bytes
    for a, b in zip(restore_values(parked), tensors):
        _same(a, b)


@pytest.mark.parametrize("where", ["alone", "after an int8"])
def test_a_one_element_tensor_with_any_stride_parks(where):
    # Regression: a 1-element tensor is contiguous whatever its stride, and the byte view parking took of
    # it refused a stride other than 1 (RuntimeError: "self.stride(-1) must be 1 to view Float as Byte").
    t = torch.empty_strided((1,), (5,)).fill_(3.0)
    tensors = [t] if where == "alone" else [torch.ones(3, dtype=torch.int8), t]
    for a, b in zip(restore_values(park_values(tensors)), tensors):
        _same(a, b)
