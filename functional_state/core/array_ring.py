"""`ArrayRing`: a preallocated, fixed-shape JAX ring whose commit is jittable and never recompiles."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._repr import short
from ..errors import InvalidArgumentError, InvalidTypeError, StateShapeError
from .codec import ObjectCodec, field_error, refused_field, register_checkpoint_type
from .pytree import pytree_dataclass
from .state_object import RESIDENT, UNALLOCATED, StateObject, Status, check_source

__all__ = ["ArrayRing"]


def _raise_short_window(size: Any, k: int, capacity: int) -> None:
    if int(size) >= k:
        return  # under vmap the check runs for every ring of the batch: only a short one raises
    raise InvalidArgumentError(
        f"`ArrayRing.latest`: asked for k={k} frames but the ring holds only {int(size)} (capacity {capacity}). "
        f"A shorter window is never returned, and never zero-filled: commit more frames first or ask for fewer."
    )


def _check_capacity(capacity: Any, what: str) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise InvalidArgumentError(f"`{what}`: capacity must be a positive int, got {capacity!r}.")


def _checked_frame_shape(frame_shape: Any, what: str) -> tuple[int, ...]:
    if not isinstance(frame_shape, (tuple, list)) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in frame_shape
    ):
        raise InvalidTypeError(
            f"`{what}`: frame_shape must be a tuple of ints (e.g. (16,) for 16-vectors), got {frame_shape!r}."
        )
    shape = tuple(int(d) for d in frame_shape)
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"`{what}`: frame_shape must be non-negative, got {shape}.")
    return shape


def _checked_dtype(dtype: Any, what: str) -> np.dtype:
    dt = np.dtype(dtype)
    stored = np.dtype(jax.dtypes.canonicalize_dtype(dt))
    if stored != dt:
        raise InvalidArgumentError(
            f"`{what}`: dtype {dt} is not available with jax_enable_x64 off: JAX would store {stored}, and a ring "
            f"that reports one dtype and stores another would cast every frame. Pass dtype={stored.name!r}, or "
            f"enable x64 (`jax.config.update('jax_enable_x64', True)`)."
        )
    return dt


class _RingCodec(ObjectCodec):
    """The default codec, whose check holds a decoded ring to what `ArrayRing.create` and its verbs keep: its
    configuration valid, its storage ``[capacity, *frame_shape]`` of its dtype while resident (else None), a
    staged frame of the frame's shape and dtype, ``0 <= head < capacity`` and ``0 <= size <= capacity``."""

    def check(self, obj: Any, where: str) -> None:
        super().check(obj, where)
        with refused_field(where, "capacity", obj.capacity):
            _check_capacity(obj.capacity, "ArrayRing")
        with refused_field(where, "frame_shape", obj.frame_shape):
            if _checked_frame_shape(obj.frame_shape, "ArrayRing") != obj.frame_shape:
                raise InvalidTypeError("`ArrayRing`: frame_shape must be a tuple of ints.")
        if not isinstance(obj.dtype, np.dtype):
            raise field_error(where, "dtype", obj.dtype, "a numpy dtype")
        with refused_field(where, "dtype", obj.dtype):
            _checked_dtype(obj.dtype, "ArrayRing")
        storage = obj.storage
        if obj.status != RESIDENT:
            if storage is not None:
                raise field_error(where, "storage", storage, f"None (the ring is {obj.status})")
        elif not (isinstance(storage, jax.Array) and storage.ndim == 1 + len(obj.frame_shape)):
            raise field_error(where, "storage", storage, f"a JAX array of shape [capacity, *{obj.frame_shape}]")
        else:  # the storage is the data (its bytes checksummed): the configuration must describe it
            for field, held, stored in (
                ("capacity", obj.capacity, storage.shape[0]),
                ("frame_shape", obj.frame_shape, tuple(storage.shape[1:])),
                ("dtype", obj.dtype, storage.dtype),
            ):
                if held != stored:
                    raise field_error(where, field, held, f"{stored!r}, as its storage {short(storage)} holds")
        if obj.staged is not None:
            with refused_field(where, "staged", obj.staged):
                obj._check_payload(obj.staged)
        for field, top in (("head", obj.capacity - 1), ("size", obj.capacity)):
            x = getattr(obj, field)
            if not (isinstance(x, jax.Array) and x.shape == () and x.dtype == jnp.int32 and 0 <= int(x) <= top):
                raise field_error(where, field, x, f"an int32 JAX scalar in [0, {top}] (capacity {obj.capacity})")


@register_checkpoint_type(codec=_RingCodec())
@pytree_dataclass(static=("capacity", "frame_shape", "dtype", "status", "recompute_source", "recompute_cost"))
class ArrayRing(StateObject):
    """The last ``capacity`` frames of shape ``frame_shape``, in one ``[capacity, *frame_shape]`` array.

    A commit writes the slot at ``head`` with ``.at[head].set(frame)``: under ``jax.jit`` the shapes never
    change, so a loop of commits traces once. A frame of another shape or dtype is refused (never cast,
    never retraced). To donate the ring's buffer to a jitted step safely (never a buffer a fork or another
    session still holds), use `functional_state.step` or `SessionHandle.step`.

    Example:
      >>> ring = ArrayRing.create(capacity=3, frame_shape=(2,), dtype=jnp.float32)
      >>> step = jax.jit(ArrayRing.commit)
      >>> for i in range(5):
      ...     ring = step(ring, jnp.full((2,), i, jnp.float32))
      >>> ring.latest(2)[:, 0].tolist()
      [3.0, 4.0]
      >>> ring
      ArrayRing(storage=f32[3,2], size=i32[], capacity=3)
    """

    storage: jax.Array | None  # [capacity, *frame_shape] dtype; None unless resident
    head: jax.Array  # i32[]: the slot the next commit writes
    size: jax.Array  # i32[]: frames held, saturating at capacity
    staged: jax.Array | None  # [*frame_shape] dtype, or None
    host_copy: Any  # ParkedStorage of `storage` while parked, else None
    capacity: int
    frame_shape: tuple[int, ...]
    dtype: np.dtype
    status: Status
    recompute_source: str | None
    recompute_cost: float  # relative cost of rebuilding it from its source (the planner evicts cheapest first)

    @classmethod
    def create(
        cls,
        capacity: int,
        frame_shape: Sequence[int],
        dtype: Any = jnp.float32,
        *,
        allocate: bool = True,
        recompute_source: str | None = None,
        recompute_cost: float = 1.0,
    ) -> ArrayRing:
        """Build a ring of ``capacity`` frames; allocated storage is zero-filled.

        Raises:
          InvalidArgumentError: ``capacity`` is not a positive int, ``frame_shape`` has a negative
            dimension, or ``dtype`` is a 64-bit type while ``jax_enable_x64`` is off (JAX would store it in
            32 bits, and the ring never casts).
          InvalidTypeError: ``frame_shape`` is not a tuple or list of ints.
        """
        _check_capacity(capacity, "ArrayRing.create")
        shape = _checked_frame_shape(frame_shape, "ArrayRing.create")
        dt = _checked_dtype(dtype, "ArrayRing.create")
        check_source(recompute_source, "ArrayRing.create", recompute_cost)
        ring = cls(
            storage=None,
            head=jnp.zeros((), jnp.int32),
            size=jnp.zeros((), jnp.int32),
            staged=None,
            host_copy=None,
            capacity=capacity,
            frame_shape=shape,
            dtype=dt,
            status=UNALLOCATED,
            recompute_source=recompute_source,
            recompute_cost=float(recompute_cost),
        )
        return ring.allocate() if allocate else ring

    def _check_payload(self, payload: Any) -> None:
        if type(payload).__module__.partition(".")[0] == "torch":  # (torch is never imported here)
            raise InvalidTypeError(
                f"`ArrayRing.commit`: got a {type(payload).__module__}.{type(payload).__name__}; an ArrayRing holds "
                f"JAX arrays (a preallocated ring a jitted step writes in place). For torch tensors use a "
                f"`LatentBuffer` (an append buffer or ring of tensors), a `DenseValue` or a `PytreeValue`, or convert "
                f"the frame without a copy first: `torch_bridge.to_jax(frame)`."
            )
        shape = tuple(getattr(payload, "shape", ()))
        dtype = getattr(payload, "dtype", None)
        if shape != self.frame_shape:
            raise StateShapeError(
                f"`ArrayRing.commit`: frame shape mismatch: expected {self.frame_shape} (dtype {self.dtype}), got "
                f"{shape} (dtype {dtype}). The ring never reshapes a frame: a different shape would recompile "
                f"every jitted step. Build a ring with frame_shape={shape} for frames of that shape."
            )
        if dtype != self.dtype:
            raise StateShapeError(
                f"`ArrayRing.commit`: frame dtype mismatch: expected {self.dtype}, got {dtype} (shape {shape} "
                f"matches). The ring never casts; convert the frame first: `frame.astype({self.dtype.name!r})`."
            )

    def _commit_payload(self, payload: Any) -> ArrayRing:
        assert self.storage is not None  # resident, checked by commit
        return self._replace(
            storage=self.storage.at[self.head].set(payload),
            head=(self.head + 1) % self.capacity,
            size=jnp.minimum(self.size + 1, self.capacity).astype(jnp.int32),
        )

    def _indices(self, k: int) -> jax.Array:
        return (self.head - k + jnp.arange(k, dtype=jnp.int32)) % self.capacity

    def latest(self, k: int) -> jax.Array:
        """The last ``k`` committed frames, oldest first, shape ``[k, *frame_shape]``.

        Raises:
          ValueError: ``k`` is not an int in ``[0, capacity]``, or the ring holds fewer than ``k`` frames.
            Outside jit this raises at the call. Inside jit ``size`` is only known when the computation
            runs, so the check runs there and the error surfaces as a ``JaxRuntimeError`` carrying this
            message when the result is computed: never a zero-filled frame. Under ``jax.vmap`` each ring of
            the batch is checked on its own count, and only a ring holding fewer than ``k`` frames raises.
        """
        self._require_resident("latest")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= self.capacity:
            raise InvalidArgumentError(
                f"`ArrayRing.latest`: k={k!r} is outside [0, capacity={self.capacity}]; this ring never "
                f"retains more than {self.capacity} frames. Build it with a larger capacity."
            )
        k = int(k)
        assert self.storage is not None
        if isinstance(self.size, jax.core.Tracer):
            if k:
                capacity = self.capacity
                # Under vmap a batched `cond` becomes a select that runs both branches, so the callback
                # gets each ring's own size and decides itself; unbatched, it runs only for a short ring.
                jax.lax.cond(
                    self.size < k,
                    lambda s: jax.debug.callback(lambda v: _raise_short_window(v, k, capacity), s),
                    lambda s: None,
                    self.size,
                )
        elif k > int(self.size):
            _raise_short_window(self.size, k, self.capacity)
        return self.storage[self._indices(k)]

    def __len__(self) -> int:
        self._require_resident("__len__")
        return int(self.size)

    def _committed_view(self) -> jax.Array:
        return self.latest(int(self.size))

    def _view_with(self, payload: Any) -> jax.Array:
        return self._commit_payload(payload)._committed_view()

    def _allocated_storage(self) -> dict[str, Any]:
        return {
            "storage": jnp.zeros((self.capacity, *self.frame_shape), self.dtype),
            "head": jnp.zeros((), jnp.int32),
            "size": jnp.zeros((), jnp.int32),
        }

    def _released_storage(self) -> dict[str, Any]:
        return {"storage": None, "head": jnp.zeros((), jnp.int32), "size": jnp.zeros((), jnp.int32)}

    def _committed_roots(self) -> Any:
        return self.storage

    def _parkable_fields(self) -> dict[str, Any]:
        return {"storage": self.storage}  # head and size stay: they are positions, not storage

    def __repr__(self) -> str:
        if self.storage is None:
            storage = f"{short(np.zeros(0, self.dtype)).split('[')[0]}[{self.capacity},{','.join(map(str, self.frame_shape))}]"
            storage = f"None ({storage} when resident)"
        else:
            storage = short(self.storage)
        parts = [f"storage={storage}", f"size={short(self.size)}", f"capacity={self.capacity}"]
        if self.staged is not None:
            parts.append(f"staged={short(self.staged)}")
        if self.status != RESIDENT:
            parts.append(f"status={self.status!r}")
        if self.recompute_source is not None:
            parts.append(f"recompute_source={self.recompute_source!r}")
        return f"ArrayRing({', '.join(parts)})"
