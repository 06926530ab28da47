"""`export_session`: one session of a table as a `SessionBlob`, with no filesystem and no extra copy of host
storages (the buffers are views of them, registered as read outside the table while the blob lives)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import table as ms
from .._version import __version__
from ..memory.outside_readers import read_by
from ..persist.encode import AttrHooks, Writer
from ..persist.manifest import FORMAT, LAYOUT, in_arrays_item, seal
from ..table.manager_state import ManagerState
from ..table.ownership import MODEL_ATTR, check_epoch
from ..table.torch_writes import check_sessions
from .blob import TRANSFER, SessionBlob

__all__ = ["export_session"]


def export_session(
    state: ManagerState,
    session_id: str | None,
    *,
    epoch: int | None = None,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> SessionBlob:
    """Session ``session_id`` of ``state`` as a `SessionBlob`: everything `save_session` would write, in memory.

    The buffers of host torch storages are views of them, not copies, and the blob stays a snapshot: while it
    lives, `writable` copies such a storage before the session writes it in place (as for a storage a fork
    shares), and a write outside `writable` is refused. Drop the blob once it is sent (``ray.put`` copied it
    into the object store) so that later writes copy nothing. A JAX array becomes host bytes (a
    device array is copied to the host once). Engine-owned KV (`PagedKVHandle`) goes through the engine's
    export hook, as for a checkpoint: pass ``object_hooks={name: (export, import)}``; without one it is refused.

    Args:
      epoch: the ownership epoch the caller holds the session at (`claim`); None skips the check.
      attr_hooks, object_hooks: as for `save_session`.

    Returns:
      The blob; ``state`` is unchanged (recency too).

    Raises:
      SessionStateLostError: no such session. StaleEpochError: the session is at another epoch than ``epoch``.
      CheckpointError: an object or attr a checkpoint cannot hold (named), or a KV handle without a hook.
      SharedStorageWrittenError: a storage a fork shares was written in place outside `writable`.

    Example:
      >>> import numpy as np, functional_state as fs
      >>> from functional_state.transfer import export_session
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
      >>> s = fs.commit(fs.put(s, "robot", "ring", fs.LatentBuffer.create(maxlen=2)), "robot", "ring", np.ones(4))
      >>> export_session(s, "robot").nbytes
      32
    """
    sid, node = ms.locate(state, session_id, "export_session")
    at = check_epoch(state, sid, epoch, "export_session")
    session = ms.node_session(node)
    check_sessions(state, [(sid, session)], "export_session")
    writer = Writer(attr_hooks, False, object_hooks)
    entry = writer.session(session, sid)
    writer.checksums()
    keys = [key for key, info in writer.leaves.items() if in_arrays_item(info)]
    model = session.attrs.get(MODEL_ATTR)
    manifest = {
        "format": FORMAT,
        "layout": LAYOUT,
        "library_version": __version__,
        "kind": "session",
        "sessions": [entry],
        "leaves": writer.leaves,
        TRANSFER: {
            "session_id": sid,
            "epoch": at,
            "model": model if isinstance(model, str) else None,
            "buffers": keys,
        },
    }
    seal(manifest)
    buffers = tuple(_host_bytes(writer.arrays[key]) for key in keys)
    # The buffers of host storages are views of them: while the blob lives, `writable` copies such a storage
    # before the session writes it in place, so the blob keeps holding the state it exported.
    exported = {key: (ptr, n) for (device, ptr, n), key in writer.storages.items() if device == "cpu"}
    for key, buf in zip(keys, buffers):
        if key in exported:
            read_by(exported[key][0], exported[key][1], buf)
    return SessionBlob(manifest, buffers)


def _host_bytes(data: Any) -> np.ndarray:
    """``data`` as 1-D host uint8: a view where it is contiguous host memory already."""
    if isinstance(data, jax.Array):
        data = np.asarray(data)  # (a CPU array: a view; a device array: its one host copy)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
