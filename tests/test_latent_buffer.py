import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from functional_state import InvalidArgumentError, LatentBuffer, NotAllocatedError, NothingStagedError, NotResidentError
from helpers import assert_unchanged, snapshot


def _item(kind, i):
    if kind == "numpy":
        return np.full((2, 3), i, np.float32)
    if kind == "torch":
        return torch.full((2, 3), float(i), dtype=torch.bfloat16)
    return jnp.full((2, 3), i, jnp.float32)


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
def test_append_buffer_keeps_everything_in_order_and_by_reference(kind):
    items = [_item(kind, i) for i in range(5)]
    buf = LatentBuffer.create()
    for x in items:
        buf = buf.append(x)
    assert len(buf) == 5
    assert all(a is b for a, b in zip(buf.view(), items))


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
def test_ring_drops_oldest(kind):
    items = [_item(kind, i) for i in range(7)]
    ring = LatentBuffer.create(maxlen=3)
    for x in items:
        ring = ring.commit(x)
    assert len(ring) == 3
    assert [float(np.asarray(x.float() if kind == "torch" else x)[0, 0]) for x in ring.view()] == [4.0, 5.0, 6.0]


def test_stage_commit_discard_lifecycle():
    buf = LatentBuffer.create(maxlen=2).commit("a")
    staged = buf.stage("draft")
    assert staged.view() == ("a", "draft")
    assert staged.view(include_staged=False) == ("a",)
    assert len(staged) == 1  # staged items are not committed
    assert staged.discard().view() == ("a",)
    promoted = staged.commit()
    assert promoted.view() == ("a", "draft") and promoted.staged is None
    explicit = staged.commit("final")
    assert explicit.view(include_staged=False) == ("a", "final") and explicit.staged == "draft"
    # A ring view with a staged item shows the window as it would be after the commit.
    assert LatentBuffer.create(maxlen=2).commit(1).commit(2).stage(3).view() == (2, 3)


def test_commit_without_staged_raises_and_names_the_fix():
    buf = LatentBuffer.create()
    with pytest.raises(NothingStagedError, match=r"stage\(x\)"):
        buf.commit()


@pytest.mark.parametrize(
    "op", [lambda b: b.view(), lambda b: b.commit(1), lambda b: b.stage(1), len, lambda b: b.discard()]
)
def test_use_before_allocate_raises(op):
    buf = LatentBuffer.create(allocate=False)
    with pytest.raises(NotAllocatedError, match="allocate"):
        op(buf)
    assert len(buf.allocate()) == 0


def test_reset_returns_to_unallocated():
    buf = LatentBuffer.create().commit(1).stage(2).reset()
    assert not buf.allocated and not buf.resident and buf.staged is None
    with pytest.raises(NotAllocatedError):
        buf.view()


def test_evict_frees_committed_bytes_only_and_keeps_staged():
    a = np.zeros(1000, np.uint8)
    b = np.zeros(500, np.uint8)
    staged = np.zeros(300, np.uint8)
    buf = LatentBuffer.create().commit(a).commit(b).commit(a[10:20]).stage(staged)
    assert buf.nbytes_by_device() == {"cpu": 1500}
    assert buf.staged_nbytes_by_device() == {"cpu": 300}
    evicted, freed = buf.evict()
    assert freed == 1500
    assert not evicted.resident and evicted.staged is staged
    assert evicted.nbytes_by_device() == {}
    with pytest.raises(NotResidentError, match="evict"):
        evicted.view()
    assert evicted.evict()[1] == 0
    assert len(evicted.allocate()) == 0


def test_recompute_source_is_a_name():
    assert LatentBuffer.create(recompute_source="latents").recompute_source == "latents"
    for bad in ("", 3, LatentBuffer.create()):
        with pytest.raises(InvalidArgumentError, match="recompute_source must be the name"):
            LatentBuffer.create(recompute_source=bad)


def test_allocate_on_a_resident_buffer_is_a_no_op():
    # Regression: allocate() on a resident object silently emptied it.
    buf = LatentBuffer.create().commit(1).commit(2)
    assert buf.allocate() is buf and buf.allocate().view() == (1, 2)
    assert buf.reset().allocate().view() == ()


def test_bool_never_depends_on_residency():
    # Regression: bool() of an unallocated buffer raised (through __len__), and an empty one was falsy.
    assert bool(LatentBuffer.create(allocate=False)) and bool(LatentBuffer.create())
    assert bool(LatentBuffer.create().commit(1).evict()[0])


def test_repr_shows_shapes_not_values():
    buf = LatentBuffer.create(maxlen=4).commit(np.zeros((2, 3), np.float32)).stage(torch.zeros(5, dtype=torch.bfloat16))
    assert repr(buf) == "LatentBuffer(items=(f32[2,3],), staged=bf16[5], maxlen=4, status='resident')"
    assert repr(LatentBuffer.create(allocate=False, recompute_source="x")) == (
        "LatentBuffer(items=(), maxlen=None, status='unallocated', recompute_source='x')"
    )


@pytest.mark.parametrize("maxlen", [0, -1, 2.5, True, "3"])
def test_bad_maxlen_raises(maxlen):
    with pytest.raises(InvalidArgumentError, match="maxlen"):
        LatentBuffer.create(maxlen=maxlen)


def test_is_a_keyed_pytree_with_array_leaves_and_static_config():
    buf = LatentBuffer.create(maxlen=4).commit(jnp.ones(2)).stage(jnp.zeros(2))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(buf)[0]]
    assert paths == [".items[0]", ".staged"]
    doubled = jax.tree_util.tree_map(lambda x: x * 2, buf)
    assert doubled.maxlen == 4 and float(doubled.view(include_staged=False)[0][0]) == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        buf.maxlen = 5


PURE_OPS = {
    "allocate": lambda b: b.allocate(),
    "stage": lambda b: b.stage(np.ones(2)),
    "commit": lambda b: b.commit(np.ones(2)),
    "commit_staged": lambda b: b.commit(),
    "append": lambda b: b.append(np.ones(2)),
    "discard": lambda b: b.discard(),
    "view": lambda b: b.view(),
    "reset": lambda b: b.reset(),
    "evict": lambda b: b.evict(),
    "nbytes": lambda b: b.nbytes_by_device(),
}


@pytest.mark.parametrize("name", sorted(PURE_OPS))
def test_every_operation_is_pure(name):
    buf = LatentBuffer.create(maxlen=3).commit(np.arange(2.0)).commit(torch.arange(3)).stage(jnp.ones(2))
    snap = snapshot(buf)
    PURE_OPS[name](buf)
    assert_unchanged(buf, snap)
    assert buf.resident and len(buf) == 2


def test_private_replace_rejects_misspelt_fields():
    # Regression: the fast replace helper accepted any keyword and silently added an attribute.
    from functional_state.core.pytree import replace

    buf = LatentBuffer.create()
    with pytest.raises(TypeError, match="itmes"):
        replace(buf, itmes=(1,))
    assert replace(buf, items=(1,)).view() == (1,)


@pytest.mark.parametrize("maxlen", [None, 1, 3])
def test_the_direct_commit_builds_what_the_generic_copy_builds(maxlen):
    # `LatentBuffer.commit` builds the new buffer slot by slot (issue 24: the generic `_replace` was a third of
    # a manager op); it must give exactly what the base class's path gives, and leave its input unchanged.
    from functional_state.core.state_object import StateObject

    buf = LatentBuffer.create(maxlen=maxlen, recompute_source="src", recompute_cost=2.5).stage(_item("numpy", -1))
    for i in range(5):
        snap = snapshot(buf)
        fast, generic = buf.commit(_item("numpy", i)), StateObject.commit(buf, _item("numpy", i))
        assert_unchanged(buf, snap)
        for f in dataclasses.fields(LatentBuffer):
            a, b = getattr(fast, f.name), getattr(generic, f.name)
            if f.name == "items":
                assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
            else:
                assert a is b or a == b, f.name
        assert type(fast) is LatentBuffer and fast.view(include_staged=False) == fast.items
        buf = fast
    assert len(buf.items) == (5 if maxlen is None else maxlen) and buf.staged is not None


def test_a_subclass_keeps_its_type_through_commit_stage_and_reset() -> None:
    """`_replace` builds the object's own class: a subclass of a state object (declared without the
    decorator) came back from every verb as its base class."""

    class Tagged(LatentBuffer):
        pass

    buf = Tagged.create(maxlen=2)
    for step in range(3):
        buf = buf.commit(jnp.full(2, float(step)))
        assert type(buf) is Tagged
    assert type(buf.stage(jnp.ones(2))) is Tagged
    assert type(buf.reset()) is Tagged
