"""`LatentBuffer`: an append buffer or a bounded ring of items (numpy arrays, torch tensors, JAX arrays)."""

from __future__ import annotations

from typing import Any

from ._pytree import pytree_dataclass, replace
from .state_object import StateObject

__all__ = ["LatentBuffer"]


@pytree_dataclass(static=("maxlen", "allocated", "resident", "recompute_source"))
class LatentBuffer(StateObject):
    """Items in commit order; unbounded, or a ring of ``maxlen`` that drops the oldest.

    Items are carried by reference (never copied) and may be of any array type. ``view()`` returns them
    oldest first as a tuple; ``len()`` is the number committed.

    Example:
      >>> import numpy as np
      >>> ring = LatentBuffer.create(maxlen=2)
      >>> for i in range(3):
      ...     ring = ring.commit(np.full((2,), i))
      >>> [int(x[0]) for x in ring.view()]
      [1, 2]
    """

    items: tuple[Any, ...]  # committed items, oldest first
    staged: Any  # the staged item, or None
    maxlen: int | None  # ring capacity; None for an unbounded append buffer
    allocated: bool
    resident: bool
    recompute_source: Any

    @classmethod
    def create(
        cls, maxlen: int | None = None, *, allocate: bool = True, recompute_source: Any = None
    ) -> "LatentBuffer":
        """Build an empty buffer.

        Args:
          maxlen: ring capacity (a positive int), or None for an unbounded append buffer.
          allocate: start resident (True) or unallocated (False).
          recompute_source: an object with a ``resident`` property this buffer can be rebuilt from.

        Raises:
          ValueError: ``maxlen`` is not a positive int or None.
        """
        if maxlen is not None and (isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen <= 0):
            raise ValueError(f"`LatentBuffer.create`: maxlen must be a positive int or None, got {maxlen!r}.")
        return cls(
            items=(),
            staged=None,
            maxlen=maxlen,
            allocated=allocate,
            resident=allocate,
            recompute_source=recompute_source,
        )

    def __len__(self) -> int:
        self._require_resident("__len__")
        return len(self.items)

    def _trim(self, items: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.maxlen is not None and len(items) > self.maxlen:
            return items[len(items) - self.maxlen :]
        return items

    def _commit_payload(self, payload: Any) -> "LatentBuffer":
        return replace(self, items=self._trim(self.items + (payload,)))

    def _committed_view(self) -> tuple[Any, ...]:
        return self.items

    def _view_with(self, payload: Any) -> tuple[Any, ...]:
        return self._trim(self.items + (payload,))

    def _allocated_storage(self) -> dict[str, Any]:
        return {"items": ()}

    def _released_storage(self) -> dict[str, Any]:
        return {"items": ()}

    def _committed_roots(self) -> Any:
        return self.items

    def __repr__(self) -> str:
        kind = "append" if self.maxlen is None else f"ring(maxlen={self.maxlen})"
        state = "resident" if self.resident else ("evicted" if self.allocated else "unallocated")
        staged = ", staged" if self.staged is not None else ""
        return f"LatentBuffer({kind}, {state}, items={len(self.items)}{staged})"
