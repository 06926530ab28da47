"""Handing engine blocks back outside the shell's lock: what an installed write released, what a refused
restore took, and the debts of changes whose engine ``free`` raised after others were built on them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import KVFreeError
from ..table.engine_blocks import free_acquired, free_released
from ..table.manager_state import ManagerState

__all__ = ["Debts", "hand_back"]

_log = logging.getLogger("functional_state")


def hand_back(base: ManagerState, grabbed: ManagerState) -> None:
    """The engine blocks the library took for ``grabbed`` (a restore's ``reload``), which will not be
    installed, go back (`free_acquired`); the parked copies in ``base`` stay restorable. A failing ``free``
    is logged: the caller is already raising the reason the change was refused."""
    if grabbed is not base:
        try:
            free_acquired(base, grabbed)
        except KVFreeError:
            _log.warning("a refused restore could not hand its reloaded blocks back", exc_info=True)


class Debts:
    """Installed changes whose blocks an engine did not take back yet; each retry frees only what is still
    owed (`free_released` keeps that per pool). Its own small lock guards only the list: no callback runs
    under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owed: list[tuple[ManagerState, ManagerState]] = []  # (read without the lock: truthiness only)

    def settle(
        self, before: ManagerState, after: ManagerState, released: object, take_back: Callable[[], bool]
    ) -> None:
        """Outside the lock, after installing ``before`` -> ``after``: pay earlier debts, then hand the blocks
        it ``released`` back to their engines, each once. If an engine's ``free`` raises, ``take_back()``
        reinstalls ``before`` when nothing was built on the change (then `KVFreeError` propagates: a retry
        frees only what is still owed); otherwise the change stays and its blocks become a debt."""
        if self.owed:
            self.pay()
        if not released:
            return
        try:
            free_released(before, after)
        except KVFreeError:
            if take_back():
                raise
            self.owe(before, after)

    def owe(self, before: ManagerState, after: ManagerState) -> None:
        """Free what ``before`` -> ``after`` released, keeping the change as a debt if an engine refuses."""
        try:
            free_released(before, after)
        except KVFreeError:
            _log.warning("an installed change could not hand its engine blocks back yet; retried later", exc_info=True)
            with self._lock:
                self.owed.append((before, after))

    def pay(self) -> None:
        """Retry every debt (outside any lock)."""
        with self._lock:
            owed, self.owed = self.owed, []
        for before, after in owed:
            self.owe(before, after)
