"""`Extent`: the bytes one buffer occupies in one memory pool, the unit every byte count is made of; and `Loose`,
the mark of an extent over memory its holder did not allocate.

Allocations proper (numpy arrays owning their data, storages torch allocated, JAX buffers) are plain
extents: two of them are equal or disjoint, so their bytes add up. A `Loose` extent (a torch storage made by
``torch.from_numpy`` or ``from_dlpack``, a numpy array over a foreign buffer) may overlap another without
being equal to it (``from_numpy(X[:5])`` beside ``from_numpy(X)``), and a pool holding one is counted as a
union (`functional_state.memory.overlaps`).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Extent", "Loose"]


class Extent(NamedTuple):
    """``[start, end)`` in pool ``pool`` (a `stats` pool name such as ``"cpu"`` or ``"cuda:0"``).

    A NamedTuple, so that maps keyed by extents hash and compare them as tuples, a `Loose` extent equal to
    the plain one over the same bytes.

    Example:
      >>> e = Extent("cpu", 4096, 4352)
      >>> e.pool, e.nbytes
      ('cpu', 256)
    """

    pool: str
    start: int  # address of the first byte
    end: int  # address one past the last byte

    @property
    def nbytes(self) -> int:
        """``end - start``."""
        return self.end - self.start


class Loose(Extent):
    """An `Extent` over memory its holder did not allocate: it may overlap another extent without being equal
    to it. Equal to, and hashing as, the plain extent over the same bytes, so counts keyed by extents are
    unchanged; only the incremental totals read the mark, to union what overlaps."""

    __slots__ = ()
