"""A checkpoint keeps a torch leaf's type: a `torch.nn.Parameter` loads back a Parameter."""

from __future__ import annotations

import pytest
import torch

import functional_state as fs
from functional_state import SessionStateManager


@pytest.mark.parametrize("parked", [False, True], ids=["resident", "parked"])
def test_a_parameter_loads_back_a_parameter_sharing_its_storage(tmp_path, parked):
    """A `torch.nn.Parameter` came back from a checkpoint as a plain tensor (an optimizer's parameters lost
    their type); it loads as a Parameter with its flag, still sharing its storage with a view saved beside it."""
    weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    m = SessionStateManager()
    h = m.get_or_create_session("p").put("dense", fs.DenseValue.create([weight, weight.data[1], frozen]))
    if parked:
        h.park("dense")
    m.save_session("p", tmp_path / "ck")
    loaded = SessionStateManager()
    loaded.load_session("p", tmp_path / "ck")
    handle = loaded.get_session("p")
    if parked:
        handle.restore("dense")
    w, row, f = handle.view("dense")
    assert type(w) is torch.nn.Parameter and w.requires_grad and torch.equal(w, weight)
    assert type(f) is torch.nn.Parameter and not f.requires_grad
    assert type(row) is torch.Tensor and row.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    torch.optim.SGD([w], lr=1.0).zero_grad()  # (a leaf an optimizer accepts)
