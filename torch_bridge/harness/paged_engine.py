"""A small reference paged-KV engine: per-layer block pools and a free-block queue, as a serving engine has.

It stands in for the engine side of `functional_state.PagedKVPool` in tests, the DreamZero rollout and the
benchmarks: it allocates blocks, writes K/V into them, and takes them back through ``free``, raising on a
double free or on a block it never handed out, so a manager that frees too early, too late or twice is
caught. Blocks come off the free queue lowest id first and go back at its end, like vLLM's free-block
queue, so reuse is visible.

Example:
  >>> engine = ReferenceKVEngine(num_blocks=8, block_size=4, heads=2, head_dim=8)
  >>> ids = engine.allocate(2)
  >>> ids, engine.free_block_count()
  ((0, 1), 6)
  >>> engine.free(ids); engine.free_block_count()
  8
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from functional_state import PagedKVHandle, PagedKVPool

__all__ = ["EngineError", "ReferenceKVEngine"]


class EngineError(RuntimeError):
    """The engine was asked for something it cannot do: a double free, a block it never allocated, no room."""


class ReferenceKVEngine:
    """Per-layer K and V pools ``[num_blocks, block_size, heads, head_dim]`` and an allocator.

    Args:
      num_blocks, block_size, heads, head_dim: the pool geometry.
      layers: transformer layers (a K and a V pool each).
      dtype, device: of the pools.
      offload: whether `pool` offers offload/reload (parking through the engine).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        heads: int,
        head_dim: int,
        *,
        layers: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
        offload: bool = False,
        name: str = "engine-kv",
    ):
        shape = (num_blocks, block_size, heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.block_size = block_size
        self._free = collections.deque(range(num_blocks))
        self.allocated: set[int] = set()
        self.freed_log: list[tuple[int, ...]] = []  # every free call, in order
        self.fail_next_free = False  # a test switch: the next free raises, changing nothing
        self.pool = PagedKVPool(
            [t for pair in zip(self.k, self.v) for t in pair],
            free=self.free,
            block_size=block_size,
            device=device if device != "cuda" else f"cuda:{torch.cuda.current_device()}",
            offload=self.offload if offload else None,
            reload=self.reload if offload else None,
            free_block_count=self.free_block_count,
            name=name,
        )

    def free_block_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> tuple[int, ...]:
        """``n`` blocks off the free queue (lowest first); raises `EngineError` when there is no room."""
        if n > len(self._free):
            raise EngineError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        ids = tuple(self._free.popleft() for _ in range(n))
        self.allocated.update(ids)
        return ids

    def free(self, ids: tuple[int, ...]) -> None:
        """Take blocks back. Raises `EngineError` (changing nothing) for a block not allocated: a double free."""
        if self.fail_next_free:
            self.fail_next_free = False
            raise EngineError("free failed (injected)")
        bad = [b for b in ids if b not in self.allocated]
        if bad:
            raise EngineError(f"double free or foreign block: {bad}")
        self.allocated.difference_update(ids)
        self._free.extend(ids)
        self.freed_log.append(tuple(ids))

    def write(self, block: int, slot: int, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> None:
        """Write one token's K and V (``[heads, head_dim]``) at ``slot`` of ``block``."""
        if block not in self.allocated:
            raise EngineError(f"write to block {block}, which is not allocated")
        self.k[layer][block, slot] = k
        self.v[layer][block, slot] = v

    def offload(self, ids: tuple[int, ...]) -> dict[str, Any]:
        """Host copies of the blocks' K and V (the blocks stay allocated until freed)."""
        return {
            "k": [layer[list(ids)].to("cpu", copy=True) for layer in self.k],
            "v": [layer[list(ids)].to("cpu", copy=True) for layer in self.v],
        }

    def reload(self, token: dict[str, Any]) -> tuple[int, ...]:
        """Fresh blocks holding an offloaded token's K and V."""
        n = token["k"][0].shape[0]
        ids = self.allocate(n)
        for layer, (k, v) in enumerate(zip(token["k"], token["v"])):
            self.k[layer][list(ids)] = k.to(self.k[layer].device)
            self.v[layer][list(ids)] = v.to(self.v[layer].device)
        return ids

    def checkpoint_hooks(self) -> tuple[Any, Any]:
        """``(export, import)`` for a checkpoint's ``object_hooks``: export gathers a handle's K/V per pool
        layer; import allocates blocks in this engine (another process's, after a restart or a migration),
        writes the K/V into them and returns a handle on them."""

        def export(handle: PagedKVHandle) -> dict[str, Any]:
            if not handle.resident:
                return {"status": handle.status, "layers": []}
            layers = handle.view() if len(self.pool.layer_block_bytes) > 1 else [handle.view()]
            return {"status": handle.status, "layers": [t.detach().clone() for t in layers]}

        def import_(saved: dict[str, Any]) -> PagedKVHandle:
            handle = PagedKVHandle.create(self.pool)
            if saved["status"] != "resident":
                return handle.evict()[0]
            layers = saved["layers"]
            n = layers[0].shape[0] // self.block_size if layers else 0
            ids = self.allocate(n)
            pools = [t for pair in zip(self.k, self.v) for t in pair]
            for pool, values in zip(pools, layers):
                pool[list(ids)] = values.reshape(n, self.block_size, *values.shape[1:]).to(pool.device)
            return handle.commit(list(ids)) if ids else handle

        return export, import_
