"""A checkpoint leaves torch tensors as a model uses them: a save must not change the tensors it reads, and a
load must hand back tensors a model can grow in place (`resize_`, as a KV cache or a prompt grows). A numpy
view taken with ``Tensor.numpy()``, or a tensor made over numpy memory, is never resizable again: the save
once made every storage it read so for good, and a load handed out only such tensors."""

from __future__ import annotations

import pytest
import torch

import functional_state as fs
from torch_bridge import to_jax


def _manager() -> tuple[fs.SessionStateManager, torch.Tensor, torch.Tensor]:
    m = fs.SessionStateManager()
    h = m.get_or_create_session("a")
    h.put("buf", fs.LatentBuffer.create(maxlen=2))
    prompt, item = torch.arange(64, dtype=torch.float32), torch.arange(16, dtype=torch.uint8)
    h.set_attr("prompt", prompt)
    h.commit("buf", item)
    return m, prompt, item


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_leaves_the_tensors_it_reads_resizable(tmp_path, asynchronous):
    m, prompt, item = _manager()
    m.save(tmp_path / "ck", asynchronous=asynchronous).wait()
    assert prompt.untyped_storage().resizable() and item.untyped_storage().resizable()
    prompt.resize_(128)  # (raised "Trying to resize storage that is not resizable" after a save)
    assert prompt.shape == (128,)


def test_a_load_hands_back_tensors_a_model_can_grow_and_jax_can_alias(tmp_path):
    m, prompt, item = _manager()
    m.save(tmp_path / "ck").wait()
    loaded = fs.SessionStateManager()
    loaded.load(tmp_path / "ck")
    h = loaded.get_session("a")
    got, ring = h.get_attr("prompt"), h.get("buf").view()
    assert torch.equal(got, prompt) and torch.equal(ring[-1], item)
    assert got.untyped_storage().resizable() and ring[-1].untyped_storage().resizable()
    assert got.data_ptr() % 64 == 0  # (JAX aliases host memory at 64-byte alignment)
    assert to_jax(got, strict=True).unsafe_buffer_pointer() == got.data_ptr()  # aliased, not copied
    got.resize_(256)
    assert got.shape == (256,) and torch.equal(got[:64], prompt)
