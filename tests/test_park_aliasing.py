"""Parking torch storages that overlap without being one storage, and tensor subclasses (found by review).

Two ``torch.from_numpy`` tensors over overlapping numpy memory (``X[:5]`` and ``X``) are separate storages
that can share an address: parking keyed storages by address alone and filed the second under the first,
so its restore read past the bytes that were copied. A storage is now its extent (address and bytes): each
comes back as a copy of its own bytes (no longer aliased; the documented choice), two over the same extent
as one storage. And a ``torch.nn.Parameter`` (any subclass parking can rebuild) keeps its type; one it
cannot rebuild is refused at park time with nothing moved."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_state as fs
from functional_state.memory import host_buffers
from functional_state.memory.parking import park_values, restore_values
from helpers import assert_unchanged, snapshot

fn = torch.from_numpy
BIG = host_buffers.MIN_NBYTES // 4 + 3  # float32 elements: a storage copied through the recycled host buffers


def _case(name: str, x: np.ndarray) -> list:
    return {
        "prefix then whole": lambda: [fn(x[:5]), fn(x)],
        "whole then prefix": lambda: [fn(x), fn(x[:5])],
        "inside then whole": lambda: [fn(x[2:]), fn(x)],
        "whole then inside": lambda: [fn(x), fn(x[2:7])],
        "views of both": lambda: [fn(x[:5])[1:], fn(x).view(-1, 1)[3:], fn(x[:5])],
        "other dtype, same start": lambda: [fn(x[:4].view(np.int32)), fn(x).view(-1, 1)],
        "numpy leaves mixed in": lambda: [x, fn(x[:5]), 7, x[3:], fn(x), fn(x[1:])],
    }[name]()


def _expect(leaves: list) -> list:
    """Per leaf what a restore must give: type, dtype, shape, strides, offset, storage bytes, values' bits."""
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            size = t.untyped_storage().nbytes()
            bits = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            out.append((type(t), t.dtype, t.shape, t.stride(), t.storage_offset(), size, bits))
        else:
            out.append((type(t), np.array(t).tobytes()))
    return out


CASES = [
    "prefix then whole",
    "whole then prefix",
    "inside then whole",
    "whole then inside",
    "views of both",
    "other dtype, same start",
    "numpy leaves mixed in",
]


@pytest.mark.parametrize("n", [10, BIG], ids=["small", "large"])
@pytest.mark.parametrize("case", CASES)
def test_overlapping_storages_come_back_bit_exact_each_its_own_bytes(case, n):
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    leaves = _case(case, x)
    want = _expect(leaves)
    back = restore_values(park_values(leaves))
    assert _expect(back) == want  # (the base tree read past a 20-byte copy for "prefix then whole")
    tensors = [t for t in back if isinstance(t, torch.Tensor)]
    for t in tensors:  # separate storages stay separate: a write through one shows in no other
        before = [u.clone() for u in tensors if u.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()]
        t.view(-1)[:1] = 99.0 if t.dtype == torch.float32 else 99
        after = [u for u in tensors if u.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()]
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    if case == "numpy leaves mixed in":
        assert back[0] is x and back[3].base is x  # numpy values are kept as they are


def test_two_storages_over_one_extent_come_back_as_one_storage():
    x = np.arange(12, dtype=np.float32)
    leaves = [fn(x), fn(x)[3:], fn(x).view(3, 4)]  # three storages, one extent
    back = restore_values(park_values(leaves))
    assert _expect(back) == _expect(leaves)
    assert len({t.untyped_storage().data_ptr() for t in back}) == 1  # aliased before, aliased after
    back[0][3] = -1.0
    assert back[1][0] == -1.0 and back[2][0, 3] == -1.0


@pytest.mark.parametrize("order", ["prefix first", "whole first"])
def test_a_session_parks_and_restores_overlapping_frames_and_its_accounting_stays_exact(order):
    x = np.arange(10, dtype=np.float32)
    frames = [fn(x[:5]), fn(x)] if order == "prefix first" else [fn(x), fn(x[:5])]
    m = fs.SessionStateManager()
    h = m.get_or_create_session("a").put("b", fs.LatentBuffer.create())
    for f in frames:
        h.commit("b", f)
    want = [f.clone() for f in frames]
    # Resident, the two storages hold the 40 bytes of x (the kept totals union them, as the walk does).
    # Parked, each storage's own bytes are copied, all 60.
    assert m.stats() == m.stats(exact=True) and m.stats()["nbytes:cpu"] == 40
    h.park("b")
    assert m.stats() == m.stats(exact=True) and m.stats()["parked_nbytes"] == 60
    h.restore("b")
    assert m.stats() == m.stats(exact=True) and m.stats()["nbytes:cpu"] == 60  # two copies now, not aliased
    got = list(h.view("b"))
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert [g.untyped_storage().nbytes() for g in got] == [f.untyped_storage().nbytes() for f in frames]


class Tagged(torch.Tensor):
    """A subclass that adds a method and carries attributes: rebuilt with them."""

    def doubled(self):
        return self * 2


class Wrapper(torch.Tensor):
    """A wrapper subclass (``__torch_dispatch__``): its storage is not its data, so it is refused."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_parameter_comes_back_a_parameter_with_its_flag(requires_grad):
    p = torch.nn.Parameter(torch.arange(6.0).view(2, 3), requires_grad=requires_grad)
    tagged = torch.arange(4.0).as_subclass(Tagged)
    tagged.unit = "m"
    leaves = {"p": p, "data": p.data[1], "tagged": tagged, "plain": torch.ones(3)}
    back = restore_values(park_values(leaves))
    q = back["p"]
    assert type(q) is torch.nn.Parameter and q.requires_grad == requires_grad and q.is_leaf
    assert torch.equal(q.detach(), p.detach()) and q.stride() == p.stride()
    assert type(back["data"]) is torch.Tensor and not back["data"].requires_grad  # one storage, each its type
    assert back["data"].untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert type(back["tagged"]) is Tagged and back["tagged"].unit == "m"
    assert torch.equal(back["tagged"].doubled().as_subclass(torch.Tensor), torch.arange(4.0) * 2)
    assert type(back["plain"]) is torch.Tensor
    if requires_grad:  # still a parameter an optimizer can step
        torch.optim.SGD([q], lr=1.0).zero_grad()
        (q.sum()).backward()
        assert torch.equal(q.grad, torch.ones(2, 3))


class Slotted(torch.Tensor):
    """A subclass with slots: a restore could not give their values back, so it is refused."""

    __slots__ = ("unit",)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(3).as_subclass(Wrapper),
        lambda: torch.nn.parameter.UninitializedParameter(),
        lambda: torch.ones(3).as_subclass(Slotted),
    ],
    ids=["dispatch wrapper", "uninitialized parameter", "slots"],
)
def test_a_subclass_that_cannot_be_rebuilt_is_refused_at_park_time(make):
    leaves = {"x": [torch.ones(2), make()]}
    with pytest.raises(fs.InvalidTypeError, match=r"`park_values`: the tensor at \['x'\]\[1\] is a .*subclass"):
        park_values(leaves)


def test_a_refused_subclass_leaves_the_session_as_it_was():
    bad = torch.arange(3.0).as_subclass(Slotted)
    m = fs.SessionStateManager()
    h = m.get_or_create_session("a").put("b", fs.LatentBuffer.create()).commit("b", torch.ones(3))
    h.commit("b", bad)
    before = snapshot(m.state)
    stats = m.stats()
    with pytest.raises(fs.InvalidTypeError, match=type(bad).__name__):
        h.park("b")
    assert_unchanged(m.state, before)
    assert m.stats() == stats


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 15), st.integers(1, 16), st.sampled_from(["f32", "i32", "u8", "view"])),
        min_size=1,
        max_size=6,
    )
)
def test_any_mix_of_storages_over_one_numpy_buffer_round_trips_bit_exact(spans):
    x = np.random.default_rng(1).standard_normal(16).astype(np.float32)
    leaves = []
    for start, length, kind in spans:
        part = x[start : start + length]
        if kind == "i32":
            leaves.append(fn(part.view(np.int32)))
        elif kind == "u8":
            leaves.append(fn(part.view(np.uint8))[1:])  # a view at an offset of its storage
        elif kind == "view":
            leaves.append(fn(part).view(-1, 1).t())
        else:
            leaves.append(fn(part))
    want = _expect(leaves)
    assert _expect(restore_values(park_values(leaves))) == want
    assert _expect(leaves) == want  # the input is untouched


def test_kept_totals_count_overlapping_torch_storages_over_one_numpy_buffer_once() -> None:
    """Two torch storages over one numpy buffer (``from_numpy(X[:5])`` and ``from_numpy(X)``) are distinct
    extents that overlap: the exact walk unions them (40 bytes); the kept per-extent totals added them (60)
    until they kept the union of a pool's `Loose` extents (tests/test_ledger_overlap.py covers the rest)."""
    X = np.arange(10, dtype=np.float32)
    m = fs.SessionStateManager()
    h = m.get_or_create_session("a").put("b", fs.LatentBuffer.create())
    h.commit("b", torch.from_numpy(X[:5])).commit("b", torch.from_numpy(X))
    assert m.stats() == m.stats(exact=True)
