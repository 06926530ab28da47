"""Fencing saves by ownership epoch: a checkpoint never goes back to a lower epoch of a session it holds.

A replica that still believes it owns a session after another one claimed it (a slow or partitioned owner)
holds the lower epoch (`table.ownership`); its save would replace the new owner's checkpoint with an older
state. `check_not_behind` runs under the directory's save lock, against the newest step there, and refuses.
The lock is per process: two processes saving one directory at once are ordered by their claims (the router
hands a session to one owner per epoch), not by this check alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import StaleEpochError
from ..table.ownership import EPOCH_ATTR
from .directory import list_steps

__all__ = ["check_newest_not_behind", "check_not_behind", "manifest_epoch"]


def manifest_epoch(entry: Any) -> int:
    """The epoch a manifest's session entry records (0 when never claimed, or not a readable count)."""
    node = entry.get("attrs", {}).get(EPOCH_ATTR) if isinstance(entry, dict) else None
    value = node.get("v") if isinstance(node, dict) and node.get("t") == "v" else 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def check_not_behind(root: Path, manifest: dict[str, Any]) -> None:
    """Refuse to write ``manifest`` over a checkpoint at ``root`` holding a session at a higher epoch.

    Raises:
      StaleEpochError: naming the session, both epochs and what to do.
    """
    steps = list_steps(root)
    check_newest_not_behind(steps.get(max(steps)) if steps else None, manifest, str(root))


def check_newest_not_behind(newest: Any, manifest: dict[str, Any], where: str) -> None:
    """Refuse to write ``manifest`` over a checkpoint whose newest manifest is ``newest`` (None: there is none)
    holding a session at a higher epoch; ``where`` names the checkpoint (a directory or a URL).

    Raises:
      StaleEpochError: naming the session, both epochs and what to do.
    """
    if not isinstance(newest, dict) or not isinstance(newest.get("sessions"), list):
        return
    there = {e.get("id"): manifest_epoch(e) for e in newest["sessions"] if isinstance(e, dict)}
    for entry in manifest["sessions"]:
        held, saving = there.get(entry["id"], 0), manifest_epoch(entry)
        if saving < held:
            raise StaleEpochError(
                f"saving {where}: it holds session {entry['id']!r} at epoch {held}, and this save is of epoch "
                f"{saving}: the saving replica no longer owns the session (another claimed it and saved). Nothing "
                f"was written; drop this copy and ask the router for the current owner."
            )
