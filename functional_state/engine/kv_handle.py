"""PagedKVHandle: the blocks of an engine KV pool one session holds, as a state object, and paged_gather."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.codec import refuse, register_checkpoint_type
from ..core.pytree import pytree_dataclass
from ..core.state_object import (
    EVICTED,
    PARKED,
    RESIDENT,
    BlocksMoved,
    LedgerDelta,
    StateObject,
    Status,
    check_source,
)
from ..errors import (
    InvalidArgumentError,
    InvalidTypeError,
    NotParkedError,
)
from ..memory import accounting
from ..memory.extents import Extent
from .paged_kv import PagedKVPool, is_torch

__all__ = ["BlockIds", "OffloadToken", "PagedKVHandle", "paged_gather"]


def paged_gather(layer: Any, block_ids: Any) -> Any:
    """The rows of ``block_ids`` of one pool layer, in order, flattened to ``[len(ids) * block_size, ...]``.

    Pure and jittable for JAX layers (``block_ids`` an int array; one trace per number of blocks); torch
    layers use ``index_select``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layer = jnp.arange(24.0).reshape(4, 3, 2)
      >>> jax.jit(paged_gather)(layer, jnp.array([2, 0]))[:, 0].tolist()
      [12.0, 14.0, 16.0, 0.0, 2.0, 4.0]
    """
    if is_torch(layer):
        torch = accounting.torch_module()
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=layer.device)
        out = layer.index_select(0, ids)
        return out.reshape(-1, *layer.shape[2:]) if layer.ndim > 1 else out
    if isinstance(layer, np.ndarray):
        out = layer[np.asarray(block_ids, dtype=np.int64)]
        return out.reshape(-1, *layer.shape[2:]) if layer.ndim > 1 else out
    out = jnp.take(layer, jnp.asarray(block_ids, dtype=jnp.int32), axis=0)
    return out.reshape(-1, *layer.shape[2:]) if layer.ndim > 1 else out


class BlockIds(tuple[int, ...]):
    """A handle's block ids, oldest first: a tuple of ints on the host. As a pytree it is two leaves of fixed
    shape (the ids padded with -1 to the pool's block count, and how many there are), so a jitted function
    over sessions traces once whatever blocks a handle holds: as static aux data, each commit of a block was a
    new trace.

    Inside a trace the ids are tracers: `ids` and `count` hold them, and reading the tuple raises (a traced
    handle has no host ids; gather with `paged_gather(layer, ids[:n])` outside, or on the padded `ids`).
    """

    capacity: int  # the pool's block count: the padded leaf's length

    def __new__(cls, ids: Any = (), capacity: int = 0) -> BlockIds:
        out = super().__new__(cls, ids)
        out.capacity = capacity
        return out

    @property
    def ids(self) -> Any:
        """The ids as an int32 array of length `capacity`, padded with -1 (a tracer inside a trace)."""
        leaves = self.__dict__.get("_leaves")
        if leaves is None:
            padded = np.full(self.capacity, -1, np.int32)
            padded[: tuple.__len__(self)] = self
            leaves = self.__dict__["_leaves"] = (padded, np.int32(tuple.__len__(self)))
        return leaves[0]

    @property
    def count(self) -> Any:
        """How many ids there are, as an int32 scalar (a tracer inside a trace)."""
        self.ids  # noqa: B018 - builds the leaves
        return self.__dict__["_leaves"][1]

    def _check_host(self) -> None:
        if self.__dict__.get("_traced"):
            raise InvalidArgumentError(
                "a PagedKVHandle's block ids were read as a tuple inside a jitted function, where they are "
                "traced: use `handle.block_ids.ids` (int32, padded with -1) and `.count`, or read them outside."
            )

    def __len__(self) -> int:
        self._check_host()
        return tuple.__len__(self)

    def __iter__(self) -> Any:
        self._check_host()
        return tuple.__iter__(self)

    def __getitem__(self, i: Any) -> Any:
        self._check_host()
        return tuple.__getitem__(self, i)

    def __reduce__(self) -> Any:
        return (BlockIds, (tuple(self), self.capacity))


def _flatten_ids(b: BlockIds) -> tuple[tuple[Any, Any], int]:
    return (b.ids, b.count), b.capacity


def _unflatten_ids(capacity: int, children: Any) -> BlockIds:
    ids, count = children
    if isinstance(ids, (np.ndarray, jax.Array)) and not isinstance(ids, jax.core.Tracer):
        host = np.asarray(ids)
        if host.shape == (capacity,):
            return BlockIds(host[: int(np.asarray(count))].tolist(), capacity)
    out = BlockIds((), capacity)  # tracers, or a tree_map's other values: carried as they are
    out.__dict__.update(_leaves=(ids, count), _traced=True)
    return out


jax.tree_util.register_pytree_node(BlockIds, _flatten_ids, _unflatten_ids)


class OffloadToken:
    """The engine's ``offload`` token of a parked handle, in a box every table holding that parked handle
    shares: a restore that is not installed puts its reloaded blocks back through ``offload`` and stores the
    new token here (an engine's ``reload`` may consume the token it is given)."""

    __slots__ = ("token",)

    def __init__(self, token: Any) -> None:
        self.token = token

    def _accounting_children(self) -> tuple[Any, ...]:
        return (self.token,)  # a token of host arrays is host memory the accounting counts

    def __repr__(self) -> str:
        return f"OffloadToken({self.token!r})"


def _not_checkpointable(where: str) -> str:
    return (
        f"{where} is a PagedKVHandle: its K/V lives in an engine's pool, which a session checkpoint does not own. "
        f"Evict it before saving (it is recomputed on resume), or pass object_hooks with an export that gathers "
        f"its K/V and an import that writes it into the engine's new blocks."
    )


@register_checkpoint_type(codec=refuse(_not_checkpointable))
@pytree_dataclass(static=("pool", "status", "recompute_source", "recompute_cost"))
class PagedKVHandle(StateObject):
    """A session's blocks in an engine's paged KV pool: committing appends block ids, oldest first.

    The handle holds ids, never pool memory: its bytes are its blocks' (see the module docstring), and the
    engine frees them when the last handle referencing them in a manager lets go. ``stage(ids)`` holds the
    blocks of an in-progress window apart; ``view()`` gathers the K/V of every block, per layer.

    Example:
      >>> import jax.numpy as jnp
      >>> layer = jnp.zeros((16, 4, 8))
      >>> pool = PagedKVPool(layer, free=lambda ids: None, name="kv")
      >>> h = PagedKVHandle.create(pool).commit([0, 1]).commit([7])
      >>> h.block_ids, h.num_tokens, h.view().shape
      ((0, 1, 7), 12, (12, 8))
    """

    pool: PagedKVPool
    block_ids: BlockIds  # committed block ids (a tuple of ints): data, so a commit never retraces
    staged: BlockIds | None  # staged block ids, or None
    host_copy: OffloadToken | None  # the engine's offload token while parked, else None
    status: Status
    recompute_source: str | None
    recompute_cost: float

    @classmethod
    def create(
        cls,
        pool: PagedKVPool,
        block_ids: Sequence[int] = (),
        *,
        recompute_source: str | None = None,
        recompute_cost: float = 1.0,
    ) -> PagedKVHandle:
        """A handle on ``pool`` holding ``block_ids`` (the engine allocated them for this session).

        Raises:
          InvalidTypeError: ``pool`` is not a `PagedKVPool`. InvalidArgumentError: bad ids (see `PagedKVPool.check_ids`).
        """
        if not isinstance(pool, PagedKVPool):
            raise InvalidTypeError(f"`PagedKVHandle.create`: pool must be a PagedKVPool, got {type(pool).__name__}.")
        check_source(recompute_source, "PagedKVHandle.create", recompute_cost)
        ids = BlockIds(pool.check_ids(block_ids, "PagedKVHandle.create"), pool.num_blocks)
        return cls(pool, ids, None, None, RESIDENT, recompute_source, float(recompute_cost))

    @property
    def num_tokens(self) -> int:
        """Token slots of the committed blocks (``len(block_ids) * block_size``)."""
        return len(self.block_ids) * self.pool.block_size

    def held_blocks(self) -> tuple[int, ...]:
        """Every block id this handle keeps from the engine: committed, then staged."""
        return self.block_ids + (self.staged or ())

    def __len__(self) -> int:
        self._require_resident("__len__")
        return len(self.block_ids)

    # --- StateObject hooks ------------------------------------------------------------------------------
    def _check_payload(self, payload: Any) -> None:
        ids = self.pool.check_ids(payload, "PagedKVHandle.commit")
        again = sorted(set(ids) & set(self.block_ids))
        if again:
            raise InvalidArgumentError(
                f"`PagedKVHandle.commit`: blocks {again[:5]} are already in this handle; a block appears once."
            )

    def stage(self, payload: Any) -> PagedKVHandle:
        self._require_resident("stage")
        self._check_payload(payload)
        return self._replace(staged=self._ids(self.pool.check_ids(payload, "PagedKVHandle.stage")))

    def _commit_payload(self, payload: Any) -> PagedKVHandle:
        return self._replace(block_ids=self._ids(self.block_ids + self.pool.check_ids(payload, "PagedKVHandle.commit")))

    def _ids(self, ids: tuple[int, ...]) -> BlockIds:
        return BlockIds(ids, self.pool.num_blocks)

    def _committed_view(self) -> Any:
        return self._gather(self.block_ids)

    def _view_with(self, payload: Any) -> Any:
        return self._gather(self.block_ids + tuple(payload))

    def _gather(self, ids: tuple[int, ...]) -> Any:
        layers = [paged_gather(layer, ids) for layer in self.pool.layers()]
        return layers[0] if len(layers) == 1 else layers

    def _allocated_storage(self) -> dict[str, Any]:
        return {"block_ids": self._ids(())}

    def _released_storage(self) -> dict[str, Any]:
        return {"block_ids": self._ids(())}

    def _committed_roots(self) -> Any:
        return ()

    def _parkable_fields(self) -> dict[str, Any]:
        return {"block_ids": self.block_ids}

    # --- lifecycle: bytes and parking go through the engine ---------------------------------------------
    def evict(self) -> tuple[PagedKVHandle, int]:
        """Let go of the committed blocks (the manager frees them in the engine when no other handle holds
        them). Returns ``(evicted_handle, bytes_of_its_committed_blocks)``."""
        if self.status == PARKED:
            return self._replace(status=EVICTED, host_copy=None, block_ids=self._ids(())), 0
        if self.status != RESIDENT:
            return self, 0
        return self._replace(status=EVICTED, block_ids=self._ids(())), len(self.block_ids) * self.pool.block_nbytes

    def park(self, *, copy: bool = False, held: int = 0) -> PagedKVHandle:
        """The blocks copied to host by the engine's ``offload`` (the device blocks are then released); the
        engine copies, whatever ``copy`` and ``held`` say.

        Raises:
          NotResidentError, ObjectParkedError: nothing resident to park. InvalidArgumentError: the pool's
          engine offers no offload.
        """
        self._require_resident("park")
        if self.pool.offload_fn is None:
            raise InvalidArgumentError(
                f"`PagedKVHandle.park`: pool {self.pool.name!r} offers no offload; evict the handle instead "
                f"(its K/V can be recomputed from {self.recompute_source!r})."
            )
        token = OffloadToken(self.pool.offload_fn(self.block_ids))
        return self._replace(status=PARKED, host_copy=token, block_ids=self._ids(()))

    def restore(self, *, copy: bool = False) -> PagedKVHandle:
        """Blocks allocated again by the engine's ``reload`` and the K/V copied back (always a copy).

        Raises:
          NotParkedError: the handle is not parked.
        """
        if self.status != PARKED:
            raise NotParkedError(
                f"`PagedKVHandle.restore` called on a {self.status} handle: only a parked one can be restored."
            )
        assert self.pool.reload_fn is not None and self.host_copy is not None
        ids = self.pool.check_ids(self.pool.reload_fn(self.host_copy.token), "PagedKVPool reload")
        return self._replace(status=RESIDENT, host_copy=None, block_ids=self._ids(ids))

    @property
    def parkable(self) -> bool:
        return self.pool.offload_fn is not None

    def park_extents(self) -> tuple[list[Any], list[Any], int] | None:
        """The blocks leave for the engine's offload token: host memory of the size of the blocks."""
        host = len(self.block_ids) * self.pool.block_nbytes
        return list(self.pool.extents(self.block_ids)), list(self.pool.extents(self.staged or ())), host

    # --- accounting -------------------------------------------------------------------------------------
    def _accounting_extents(self) -> list[Extent]:
        return self.pool.extents(self.held_blocks())

    def _accounting_children(self) -> tuple[Any, ...]:
        return (self.host_copy,)

    def ledger_blocks(self) -> tuple[tuple[int, int], ...]:
        uid = self.pool.uid
        return tuple((uid, b) for b in self.held_blocks())

    def ledger_step(self, new: Any) -> LedgerDelta | None:
        """A commit of new blocks, priced by those blocks alone (a restore also only adds blocks, but lets
        go of its host copy: the ledger takes the difference then)."""
        if (
            type(new) is not type(self)
            or new.pool is not self.pool
            or new.staged != self.staged
            or new.host_copy is not self.host_copy
            or new.block_ids[: len(self.block_ids)] != self.block_ids
            or new.ledger_leaf_extents() != self.ledger_leaf_extents()
        ):
            return None
        tail = new.block_ids[len(self.block_ids) :]
        uid = new.pool.uid
        blocks = [(uid, b) for b in tail]
        return LedgerDelta(frozenset(self.pool.extents(tail)), (), BlocksMoved(blocks, ()))

    def nbytes_by_device(self) -> dict[str, int]:
        return {self.pool.device: len(self.block_ids) * self.pool.block_nbytes} if self.block_ids else {}

    def staged_nbytes_by_device(self) -> dict[str, int]:
        return {self.pool.device: len(self.staged) * self.pool.block_nbytes} if self.staged else {}

    def __repr__(self) -> str:
        ids = self.block_ids if len(self.block_ids) <= 8 else (*self.block_ids[:4], "...", *self.block_ids[-2:])
        return f"PagedKVHandle({self.pool.name!r}, blocks={ids}, status={self.status!r})"


def kv_keys(obj: Any) -> tuple[tuple[int, int], ...]:
    """``(pool uid, block id)`` of every engine block a state object keeps (see `StateObject.ledger_blocks`)."""
    return obj.ledger_blocks() if isinstance(obj, StateObject) else ()
