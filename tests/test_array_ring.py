import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functional_state import ArrayRing, InvalidArgumentError, InvalidTypeError, NotAllocatedError, StateShapeError
from helpers import assert_unchanged, snapshot


def _frame(i, shape=(4, 3), dtype=jnp.float32):
    return jnp.full(shape, i, dtype)


def test_commit_and_latest_oldest_first():
    ring = ArrayRing.create(3, (4, 3))
    for i in range(5):
        ring = ring.commit(_frame(i))
    assert len(ring) == 3
    np.testing.assert_array_equal(ring.latest(3)[:, 0, 0], [2, 3, 4])
    np.testing.assert_array_equal(ring.latest(1)[:, 0, 0], [4])
    assert ring.latest(0).shape == (0, 4, 3)
    np.testing.assert_array_equal(ring.view()[:, 0, 0], [2, 3, 4])


def test_latest_refuses_more_than_retained():
    ring = ArrayRing.create(4, (2,)).commit(_frame(1, (2,)))
    with pytest.raises(ValueError, match="holds only 1"):
        ring.latest(2)
    with pytest.raises(ValueError, match="capacity=4"):
        ring.latest(5)
    with pytest.raises(ValueError, match="capacity=4"):
        ring.latest(-1)


def test_latest_capacity_bound_is_checked_under_jit():
    ring = ArrayRing.create(2, (2,))
    with pytest.raises(ValueError, match="capacity=2"):
        jax.jit(lambda r: r.latest(3))(ring)


@pytest.mark.parametrize(
    "bad", [jnp.zeros((4, 2)), jnp.zeros((4, 3), jnp.bfloat16), jnp.zeros((3, 4)), np.zeros((4, 3), np.float16)]
)
def test_shape_or_dtype_mismatch_raises_and_never_recompiles(bad):
    compiled = []

    @jax.jit
    def step(ring, frame):
        out = ring.commit(frame)
        compiled.append(1)  # reached only by traces that go on to compile
        return out

    ring = step(ArrayRing.create(2, (4, 3)), _frame(0))
    with pytest.raises(StateShapeError, match=r"expected \(4, 3\)|expected float32"):
        step(ring, bad)
    with pytest.raises(StateShapeError):
        ring.commit(bad)
    ring = step(ring, _frame(1))
    assert len(compiled) == 1


def test_mismatch_messages_say_what_differs():
    ring = ArrayRing.create(2, (4, 3))
    with pytest.raises(StateShapeError, match=r"shape mismatch: expected \(4, 3\).*got \(4, 2\)") as e:
        ring.commit(jnp.zeros((4, 2)))
    assert "astype" not in str(e.value)  # a cast cannot fix a shape
    with pytest.raises(StateShapeError, match=r"dtype mismatch: expected float32, got bfloat16.*astype\('float32'\)"):
        ring.commit(jnp.zeros((4, 3), jnp.bfloat16))


def test_frame_shape_must_be_a_tuple():
    with pytest.raises(InvalidTypeError, match="frame_shape must be a tuple of ints"):
        ArrayRing.create(4, 16)
    with pytest.raises(InvalidTypeError, match="frame_shape"):
        ArrayRing.create(4, (2.5,))


def test_64_bit_dtypes_are_refused_while_x64_is_off():
    # Regression: create(dtype=float64) reported float64, stored float32, and cast float64 frames silently.
    assert not jax.config.read("jax_enable_x64")
    for dt in (np.float64, jnp.int64, "complex128"):
        with pytest.raises(InvalidArgumentError, match="not available with jax_enable_x64 off"):
            ArrayRing.create(2, (3,), dt)
    ring = ArrayRing.create(2, (3,), np.float32)
    with pytest.raises(StateShapeError, match="dtype mismatch"):
        ring.commit(np.zeros(3, np.float64))


def test_latest_beyond_what_is_held_fails_loudly_under_jit():
    # Regression: under jit, latest(k) with k above the frames held returned zero-filled slots.
    ring = ArrayRing.create(4, (2,)).commit(jnp.ones(2))
    read = jax.jit(lambda r: r.latest(3))
    with pytest.raises(Exception, match="asked for k=3 frames but the ring holds only 1"):
        jax.block_until_ready(read(ring))
    ring = ring.commit(jnp.ones(2) * 2).commit(jnp.ones(2) * 3)
    np.testing.assert_array_equal(read(ring)[:, 0], [1, 2, 3])  # the same compiled read, now valid


def test_repr_shows_shapes_and_bool_is_true():
    ring = ArrayRing.create(4, (16,))
    assert repr(ring) == "ArrayRing(storage=f32[4,16], size=i32[], capacity=4)"
    assert (
        repr(ring.evict()[0])
        == "ArrayRing(storage=None (f32[4,16] when resident), size=i32[], capacity=4, status='evicted')"
    )
    assert bool(ArrayRing.create(4, (16,), allocate=False))


def test_mismatch_leaves_the_ring_unchanged():
    ring = ArrayRing.create(2, (4, 3)).commit(_frame(3))
    before = snapshot(ring)
    with pytest.raises(StateShapeError):
        ring.commit(jnp.zeros((4, 3), jnp.int32))
    assert_unchanged(ring, before)


def test_thousand_jitted_commits_trace_once():
    traces = []

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(ring, frame):
        traces.append(1)
        return ring.commit(frame)

    ring = ArrayRing.create(8, (16,))
    for i in range(1000):
        ring = step(ring, jnp.full((16,), i, jnp.float32))
    assert len(traces) == 1
    np.testing.assert_array_equal(ring.latest(8)[:, 0], np.arange(992, 1000))
    assert int(ring.size) == 8 and int(ring.head) == 1000 % 8


def test_donation_reuses_the_buffer():
    step = jax.jit(ArrayRing.commit, donate_argnums=0)
    ring = ArrayRing.create(4, (256,))
    ring = step(ring, _frame(0, (256,)))  # warm up: the input here was created eagerly
    old_storage = ring.storage
    old_ptr = old_storage.unsafe_buffer_pointer()
    new = step(ring, _frame(1, (256,)))
    assert old_storage.is_deleted()
    assert new.storage.unsafe_buffer_pointer() == old_ptr
    np.testing.assert_array_equal(new.latest(2)[:, 0], [0, 1])


def test_stage_then_commit_promotes_under_jit():
    ring = ArrayRing.create(2, (3,)).stage(_frame(7, (3,)))
    np.testing.assert_array_equal(ring.view()[:, 0], [7])
    assert ring.view(include_staged=False).shape == (0, 3)
    ring = jax.jit(lambda r: r.commit())(ring)
    assert ring.staged is None
    np.testing.assert_array_equal(ring.latest(1)[:, 0], [7])


def test_evict_reset_allocate():
    ring = ArrayRing.create(4, (1024,), jnp.float32).commit(_frame(1, (1024,)))
    evicted, freed = ring.evict()
    assert freed == 4 * 1024 * 4
    assert evicted.storage is None and not evicted.resident
    assert len(evicted.allocate()) == 0
    reset = ring.reset()
    with pytest.raises(NotAllocatedError):
        reset.latest(0)
    assert ring.nbytes_by_device() == {"cpu": 16384}


@pytest.mark.parametrize("capacity", [0, -2, 1.5, None])
def test_bad_capacity(capacity):
    with pytest.raises(InvalidArgumentError, match="capacity"):
        ArrayRing.create(capacity, (2,))


@pytest.mark.parametrize(
    "op",
    [
        lambda r: r.commit(_frame(5, (3,))),
        lambda r: r.stage(_frame(5, (3,))),
        lambda r: r.latest(2),
        lambda r: r.view(),
        lambda r: r.evict(),
        lambda r: r.reset(),
        lambda r: r.allocate(),
        lambda r: jax.jit(ArrayRing.commit)(r, _frame(5, (3,))),
    ],
)
def test_pure(op):
    ring = ArrayRing.create(3, (3,)).commit(_frame(1, (3,))).commit(_frame(2, (3,)))
    snap = snapshot(ring)
    op(ring)
    assert_unchanged(ring, snap)


def _batch(counts, capacity=4):
    """Rings holding ``counts[i]`` frames (frame j of ring i is filled with 10 * i + j), stacked for vmap."""
    rings = []
    for i, n in enumerate(counts):
        ring = ArrayRing.create(capacity, (2,))
        for j in range(n):
            ring = ring.commit(_frame(10 * i + j, (2,)))
        rings.append(ring)
    return rings, jax.tree.map(lambda *xs: jnp.stack(xs), *rings)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_latest_under_vmap_checks_each_ring_on_its_own_count(jit):
    # Regression: under vmap the `cond` guarding the check became a select that always ran the raising branch,
    # so `latest(k)` raised for every batch, even when every ring held k frames.
    rings, batch = _batch([2, 3, 6])
    snap = snapshot(batch)
    read = jax.vmap(lambda r: r.latest(2))
    if jit:
        read = jax.jit(read)
    got = jax.block_until_ready(read(batch))
    assert got.shape == (3, 2, 2)
    for ring, window in zip(rings, got):
        np.testing.assert_array_equal(window, ring.latest(2))  # the eager, unbatched answer
    assert_unchanged(batch, snap)
    np.testing.assert_array_equal(jax.vmap(lambda r: r.latest(0))(batch).shape, (3, 0, 2))


def test_latest_under_vmap_still_refuses_a_short_ring_eagerly_and_under_jit():
    _, batch = _batch([3, 1, 4])
    with pytest.raises(InvalidArgumentError, match="asked for k=2 frames but the ring holds only 1"):
        jax.vmap(lambda r: r.latest(2))(batch)
    with pytest.raises(Exception, match="asked for k=2 frames but the ring holds only 1"):
        jax.block_until_ready(jax.jit(jax.vmap(lambda r: r.latest(2)))(batch))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_torch_tensor_is_told_the_ring_holds_jax_arrays_and_what_holds_tensors(dtype):
    # Regression: a torch frame was told to call `.astype(...)` (torch tensors have none) or that its
    # dtype `torch.float32` mismatched `float32`, with no word that the ring holds JAX arrays only.
    torch = pytest.importorskip("torch", reason="the message for a torch frame needs torch to build one")
    ring = ArrayRing.create(2, (4, 3)).commit(_frame(1))
    snap = snapshot(ring)
    with pytest.raises(InvalidTypeError) as e:
        ring.commit(torch.zeros((4, 3), dtype=getattr(torch, dtype)))
    message = str(e.value)
    assert "holds JAX arrays" in message and "torch.Tensor" in message and "astype" not in message
    assert all(name in message for name in ("LatentBuffer", "DenseValue", "PytreeValue", "torch_bridge.to_jax"))
    assert_unchanged(ring, snap)
