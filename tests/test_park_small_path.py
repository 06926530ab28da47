"""Parking: tensors whose values are not the bytes of one strided storage, and the small-tensor path (issue 24).

A quantized tensor passed every check of the plain and raw paths and its storage was copied as bytes:
the copy crashed the process (a segfault in ``torch.cat``), and through the manager a commit accepts one,
so a park under a budget took a server down. Sparse, mkldnn and nested tensors raised torch's own
``RuntimeError`` from inside the copy. Each is now refused with `InvalidTypeError`, naming the leaf, before
anything moves, on the small-tensor fast path (every leaf a tensor) and on the general path alike."""

import warnings

import pytest
import torch

import functional_state as fs
from functional_state.memory.parking import park_values, restore_values
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
