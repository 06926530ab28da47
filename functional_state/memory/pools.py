"""Memory pools as typed keys: a device's own memory, or a host memory kind parked storage lives in.

The accounting files every buffer under a pool and `stats()` prints pools as text (``"cpu"``, ``"cuda:0"``,
``"cpu/pinned_host"``). `Pool` is that key with its parts named, so that "is this a host pool" is a field,
never a search for ``"/"`` in a string. `Pool.of` reads the accounting's text, `Pool.parse` a pool a user
wrote (a budget, a plan), and ``str(pool)`` writes the text back: the three places the text form lives.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from ..errors import InvalidArgumentError

__all__ = ["ANY_DEVICE", "HOST", "PINNED_HOST", "POOL_FORMS", "POOL_PATTERN", "UNPINNED_HOST", "Pool"]

ANY_DEVICE = "*"  # in a budget: every device pool (the ones without a memory kind)
# Pools exactly as `stats()` names them: the host ("cpu") and its two memory kinds for parked storage, and
# devices as "<platform>:<index>" ("cuda:0", "tpu:3"). Never "cpu:0" (one host pool) nor "gpu:0" (JAX's GPU
# platform is filed as "cuda"), and memory kinds exist only for the host.
POOL_PATTERN = re.compile(r"^(cpu(/(pinned_host|unpinned_host))?|(?!cpu:|gpu:)[a-z][a-z0-9_]*:\d+)$")
POOL_FORMS = "'cpu', 'cpu/pinned_host', 'cpu/unpinned_host', or a device such as 'cuda:0' or 'tpu:0'"


@dataclasses.dataclass(frozen=True)
class Pool:
    """A memory pool: ``device`` (``"cpu"``, ``"cuda:0"``) and, for host memory that parked storage fills,
    its ``memory_kind`` (``"pinned_host"``, ``"unpinned_host"``); None is the device's own memory.

    Example:
      >>> p = Pool.parse("cpu/pinned_host")
      >>> p, str(p), p.is_device, Pool("cuda:0").is_device
      (Pool(device='cpu', memory_kind='pinned_host'), 'cpu/pinned_host', False, True)
    """

    device: str
    memory_kind: str | None = None

    def __str__(self) -> str:
        return self.name

    @functools.cached_property
    def name(self) -> str:
        """The pool as `stats()` writes it (``"cpu"``, ``"cpu/pinned_host"``); kept, as budgets read it per write."""
        return self.device if self.memory_kind is None else f"{self.device}/{self.memory_kind}"

    @property
    def is_device(self) -> bool:
        """A device's own memory (what a ``"*"`` budget covers), not a host memory kind."""
        return self.memory_kind is None

    @staticmethod
    def of(text: str) -> Pool:
        """The pool the accounting files under ``text`` (trusted: the accounting names only real pools)."""
        return _of(text)

    @staticmethod
    def parse(text: object, what: str = "pool") -> Pool:
        """The pool a user named, as `stats()` names pools.

        Raises:
          InvalidArgumentError: a name `stats()` never reports (``"cpu:0"``, ``"gpu:0"``,
            ``"cuda:0/pinned_host"``: host memory kinds exist only under ``"cpu"``), or not a str.
        """
        if isinstance(text, str) and POOL_PATTERN.match(text):
            return _of(text)
        raise InvalidArgumentError(f"`{what}`: {text!r} is not a pool as stats() names them ({POOL_FORMS}).")


@functools.lru_cache(maxsize=256)  # a handful of pools, read on every stats() call
def _of(text: str) -> Pool:
    device, _, kind = text.partition("/")
    return Pool(device, kind or None)


HOST = Pool("cpu")  # the host's own memory (every CPU device is one pool)
PINNED_HOST = Pool("cpu", "pinned_host")  # where a GPU's parked storage goes (JAX's pinned_host memory kind)
UNPINNED_HOST = Pool("cpu", "unpinned_host")  # where a CPU torch tensor's parked storage goes (pageable)
