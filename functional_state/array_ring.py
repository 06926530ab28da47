"""`ArrayRing`: a preallocated, fixed-shape JAX ring whose commit is jittable and never recompiles."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._pytree import pytree_dataclass, replace
from .errors import StateShapeError
from .state_object import StateObject

__all__ = ["ArrayRing"]


@pytree_dataclass(
    static=("capacity", "frame_shape", "dtype", "allocated", "resident", "recompute_source")
)
class ArrayRing(StateObject):
    """The last ``capacity`` frames of shape ``frame_shape``, in one ``[capacity, *frame_shape]`` array.

    A commit writes the slot at ``head`` with ``.at[head].set(frame)``: under ``jax.jit`` the shapes never
    change, so a loop of commits traces once, and with ``donate_argnums`` the write reuses the buffer.
    A frame of another shape or dtype is refused (never cast, never retraced).

    Do not donate a ring that a forked session still shares: donation deletes the buffer both hold.

    Example:
      >>> ring = ArrayRing.create(capacity=3, frame_shape=(2,), dtype=jnp.float32)
      >>> step = jax.jit(ArrayRing.commit)
      >>> for i in range(5):
      ...     ring = step(ring, jnp.full((2,), i, jnp.float32))
      >>> ring.latest(2)[:, 0].tolist()
      [3.0, 4.0]
    """

    storage: jax.Array | None  # [capacity, *frame_shape] dtype; None when unallocated or evicted
    head: jax.Array  # int32 scalar: the slot the next commit writes
    size: jax.Array  # int32 scalar: frames held, saturating at capacity
    staged: jax.Array | None  # [*frame_shape] dtype, or None
    capacity: int
    frame_shape: tuple[int, ...]
    dtype: np.dtype
    allocated: bool
    resident: bool
    recompute_source: Any

    @classmethod
    def create(
        cls,
        capacity: int,
        frame_shape: Sequence[int],
        dtype: Any = jnp.float32,
        *,
        allocate: bool = True,
        recompute_source: Any = None,
    ) -> "ArrayRing":
        """Build a ring of ``capacity`` frames; allocated storage is zero-filled.

        Raises:
          ValueError: ``capacity`` is not a positive int, or ``frame_shape`` has a negative dimension.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"`ArrayRing.create`: capacity must be a positive int, got {capacity!r}.")
        shape = tuple(int(d) for d in frame_shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"`ArrayRing.create`: frame_shape must be non-negative, got {tuple(frame_shape)}.")
        ring = cls(
            storage=None,
            head=jnp.zeros((), jnp.int32),
            size=jnp.zeros((), jnp.int32),
            staged=None,
            capacity=capacity,
            frame_shape=shape,
            dtype=np.dtype(dtype),
            allocated=False,
            resident=False,
            recompute_source=recompute_source,
        )
        return ring.allocate() if allocate else ring

    def _check_payload(self, payload: Any) -> None:
        shape = tuple(getattr(payload, "shape", ()))
        dtype = getattr(payload, "dtype", None)
        if shape != self.frame_shape or dtype != self.dtype:
            raise StateShapeError(
                f"`ArrayRing.commit`: frame mismatch: expected shape {self.frame_shape} dtype {self.dtype}, "
                f"got shape {shape} dtype {dtype}. The ring never casts or reshapes (that would recompile); "
                f"convert the frame first, e.g. `frame.astype({self.dtype.name!r})`."
            )

    def _commit_payload(self, payload: Any) -> "ArrayRing":
        storage = self.storage.at[self.head].set(payload)
        return replace(
            self,
            storage=storage,
            head=(self.head + 1) % self.capacity,
            size=jnp.minimum(self.size + 1, self.capacity).astype(jnp.int32),
        )

    def _indices(self, k: int) -> jax.Array:
        return (self.head - k + jnp.arange(k, dtype=jnp.int32)) % self.capacity

    def latest(self, k: int) -> jax.Array:
        """The last ``k`` committed frames, oldest first, shape ``[k, *frame_shape]``.

        Raises:
          ValueError: ``k`` is not an int in ``[0, capacity]``, or (outside jit, where ``size`` is known)
            the ring holds fewer than ``k`` frames. A shorter window is never returned silently. Inside
            jit only the capacity bound can be checked: the caller must know ``k <= size`` there.
        """
        self._require_resident("latest")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= self.capacity:
            raise ValueError(
                f"`ArrayRing.latest`: k={k!r} is outside [0, capacity={self.capacity}]; this ring never "
                f"retains more than {self.capacity} frames. Build it with a larger capacity."
            )
        if not isinstance(self.size, jax.core.Tracer) and int(k) > int(self.size):
            raise ValueError(
                f"`ArrayRing.latest`: asked for k={k} frames but the ring holds only {int(self.size)} "
                f"(capacity {self.capacity}). Commit more frames first or ask for fewer."
            )
        return self.storage[self._indices(int(k))]

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

    def __repr__(self) -> str:
        state = "resident" if self.resident else ("evicted" if self.allocated else "unallocated")
        size = "?" if isinstance(self.size, jax.core.Tracer) else int(self.size)
        return (
            f"ArrayRing(capacity={self.capacity}, frame_shape={self.frame_shape}, dtype={self.dtype}, "
            f"{state}, size={size})"
        )
