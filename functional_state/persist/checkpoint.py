"""Checkpoint, restore and migrate sessions: complete snapshots written by orbax-checkpoint.

A checkpoint is an orbax `CheckpointManager` directory (one step kept): an ``arrays`` item holding every
buffer (JAX arrays as they are, sharded or not; each torch *storage* once, as raw bytes; numpy arrays as raw
bytes; a leaf of zero size, which orbax refuses, is the manifest's alone and rebuilt from its dtype and
shape, and a checkpoint with no other leaf has no ``arrays`` item) and a ``manifest`` item (JSON) recording
the library version, the layout, each session's structure (objects with their lifecycle status and ring
positions, staged payloads, attrs and fork policies) and, per leaf, its dtype, shape and checksum (XXH3-128);
the manifest carries a checksum of its own, and a load checks it and every leaf's before it builds anything.
orbax writes a step to a temporary directory and renames it when complete, so a checkpoint is complete or
absent, and a save that dies part-way (killed, out of space) leaves the previous one, which is deleted only
once the new one is complete and synced to the disk.

A save writes only into a directory it made (marked ``_FUNCTIONAL_STATE``) or one holding its checkpoints, and
refuses one holding anything that looks like a step but is not one of ours. Saves into one directory
are serialised within a process: a second waits for the first, an asynchronous one included. An
asynchronous save nobody waits for still completes: its handle finishes on a thread of its own, and one still
running at interpreter exit is waited for then (a failure nobody heard is printed to stderr).

Restoring is not recomputing: counters, ring order, staged payloads, parked objects (parked again on load)
and views that shared one torch storage (one storage again; a JAX array that aliased a torch tensor through
the bridge aliases the restored storage) come back as they were, in the framework,
dtype and shape they had, on the device they had or the ``placement`` asked for. Attrs are saved when they
are arrays, tensors, scalars, str, bytes, None, or lists/tuples/dicts of those; anything else raises
`CheckpointError` before a byte is written, unless an ``attr_hooks`` entry exports it (never pickle).

Example:
  >>> import tempfile, numpy as np, functional_state as fs
  >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
  >>> s = fs.commit(fs.put(s, "robot", "ring", fs.LatentBuffer.create(maxlen=2)), "robot", "ring", np.arange(3))
  >>> path = tempfile.mkdtemp() + "/robot"
  >>> save_session(s, "robot", path).done()
  True
  >>> t = load_session(fs.ManagerState.create(), "robot", path)
  >>> fs.view(t, "robot", "ring")[0].tolist()
  [0, 1, 2]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .. import table as ms
from .._version import __version__
from ..core.codec import register_checkpoint_type
from ..core.session import SessionState
from ..errors import (
    CheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    SessionExistsError,
    SessionStateError,
)
from ..table.manager_state import ManagerState
from ..table.session_edits import update_session
from ..table.torch_writes import check_sessions, record, recorded
from .decode import Reader, check_templates, release_sessions
from .directory import has_checkpoint
from .encode import AttrHooks, Writer
from .manifest import (
    FORMAT,
    LAYOUT,
)
from .read import read_checkpoint
from .store import SaveHandle, write

__all__ = [
    "SaveHandle",
    "has_checkpoint",
    "install_session",
    "load",
    "load_session",
    "read_session",
    "register_checkpoint_type",
    "save",
    "save_session",
]


_log = logging.getLogger("functional_state")


# --- the public functions -----------------------------------------------------------------------------------


def save_session(
    state: ManagerState,
    session_id: str | None,
    path: Any,
    *,
    asynchronous: bool = False,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> SaveHandle:
    """Write session ``session_id`` of ``state`` to the checkpoint directory ``path`` (replacing an earlier
    checkpoint there only once the new one is complete).

    Args:
      asynchronous: return once the values are captured; the write completes in the background
        (``handle.wait()``), even if nobody waits: at exit, Python waits for it. The call waits for one copy of
        the host buffers a model could change in place (torch CPU storages, numpy views; a JAX array is
        immutable and only referenced) and the checks that refuse a save before anything is written; orbax's
        manager, its save and the checksums run on the save's own threads, and a failure there is raised by
        ``handle.wait()``. A save to a path with a save in flight waits for that one first.
        On Linux the background writes run at lower CPU priority than the model's threads (tensorstore's
        pool at nice ``persist.priority.BACKGROUND_NICE``, 10, while any asynchronous save is in flight; set it
        to 0 for none), where the process may give the threads their priority back afterwards.
      attr_hooks: ``{attr: (export, import)}`` for attrs of other types: ``export(value)`` returns a
        checkpointable value, and `load_session` calls ``import`` on it.
      object_hooks: the same for objects by name (an engine-owned `PagedKVHandle`: export its K/V, import it
        into the new engine's blocks).

    Returns:
      A `SaveHandle` (already complete unless ``asynchronous``).

    Raises:
      CheckpointError: an object or attr that cannot be checkpointed (named, before anything is written),
        ``path`` is something other than a checkpoint directory (a file, a broken link, another tool's
        directory), or the write failed (out of space, say: an asynchronous save's ``handle.wait()`` raises
        that); the previous checkpoint at ``path`` stays.
      SessionStateLostError: no such session.
      SharedStorageWrittenError: a torch storage a fork shares was written in place outside `writable`.
    """
    sid, node = ms.locate(state, session_id, "save_session")
    check_sessions(state, [(sid, ms.node_session(node))], "save_session")  # (never save a shared write)
    writer = Writer(attr_hooks, asynchronous, object_hooks)
    manifest = _manifest("session", [writer.session(ms.node_session(node), sid)])
    return write(path, manifest, writer, asynchronous)


def read_session(
    session_id: str | None,
    path: Any,
    *,
    placement: Any = None,
    torch_device: Any = None,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
    templates: Mapping[str, Any] | None = None,
) -> SessionState:
    """The `SessionState` of ``session_id`` in the checkpoint at ``path`` (what `load_session` installs).

    Raises:
      CheckpointError: see `load_session`.
    """
    sid = ms.resolve_id(session_id, "read_session")
    check_templates(templates)
    manifest, arrays = read_checkpoint(path, placement, torch_device)
    entries = {e["id"]: e for e in manifest["sessions"]}
    if sid not in entries:
        raise CheckpointError(f"{path}: holds sessions {sorted(entries)[:8]}, not {sid!r}.")
    try:
        return Reader(arrays, attr_hooks, torch_device, object_hooks, templates).session(entries[sid])
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e  # (the reader knows the node, not the path)
    except Exception as e:
        raise CheckpointError(f"{path}: session {sid!r} cannot be rebuilt ({type(e).__name__}: {e}).") from e


def load_session(
    state: ManagerState,
    session_id: str | None,
    path: Any,
    *,
    placement: Any = None,
    torch_device: Any = None,
    as_id: str | None = None,
    replace: bool = False,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
    templates: Mapping[str, Any] | None = None,
) -> ManagerState:
    """``state`` with session ``session_id`` loaded from the checkpoint at ``path`` (under ``as_id`` if given),
    as the most recently used session.

    Args:
      placement: where JAX leaves go: None (the devices and sharding they were saved with, when present),
        a ``jax.Device``, a ``jax.sharding.Sharding``, or a callable from leaf key to one of those.
      torch_device: where torch tensors go (default: the device each was saved from).
      replace: load over a session of that id (default: refuse; the caller decides what a clash means).
      attr_hooks, object_hooks: the import halves of the hooks the save used.
      templates: ``{object name: abstract tree}`` for `PytreeValue` objects whose tree is not made of plain
        containers (an ``nnx.State``, an ``eqx.nn.State``, a NamedTuple, a pytree dataclass): a tree of that
        type and structure whose leaves are arrays or ``jax.ShapeDtypeStruct`` (``jax.eval_shape`` gives
        one), orbax's abstract-target idea. The loaded value has the template's type and structure; its
        leaf shapes, dtypes and key paths must be the saved ones. Plain containers (dict, list, tuple, None)
        need none, nor do pytree types whose module is imported and whose static data is plain; a tree
        that needs one and has none is refused, naming the object and this option. Nothing is unpickled.

    Raises:
      CheckpointError: ``path`` is not a checkpoint, is damaged (the leaf is named), was written with another
        layout, or does not hold ``session_id``. SessionExistsError: the id is taken and not ``replace``.
      Nothing changes unless the load fully succeeds (this is a pure function), and a load that fails hands
      the KV blocks its import hooks took back to their engines.
    """
    target = ms.resolve_id(as_id if as_id is not None else session_id, "load_session")
    check_free(state, target, replace)
    session = read_session(
        session_id,
        path,
        placement=placement,
        torch_device=torch_device,
        attr_hooks=attr_hooks,
        object_hooks=object_hooks,
        templates=templates,
    )
    try:
        return install_session(state, target, session, replace=replace)
    except BaseException as e:
        release_sessions([session], e)
        raise


def check_free(state: ManagerState, sid: str, replace: bool) -> None:
    if type(state) is not ManagerState:
        ms.check_state(state, "load_session")
    if sid in state and not replace:
        raise SessionExistsError(
            f"`load_session`: session {sid!r} is already in the table; drop it first, load under another id "
            f"(as_id=...), or pass replace=True."
        )


def install_session(state: ManagerState, sid: str, session: SessionState, *, replace: bool = False) -> ManagerState:
    """``state`` holding ``session`` under ``sid`` as its most recent session (a loaded one, say)."""
    check_free(state, sid, replace)
    if sid in state:
        state, _ = ms.drop_session(state, sid)
    state, _ = ms.get_or_create(state, sid)

    def install(_: SessionState) -> SessionState:
        return session

    out = update_session(state, sid, install)
    for obj in session._objects.values():  # (loaded torch tensors may share storages: see `torch_writes`)
        if not recorded(obj):
            record(obj)
    return out


def save(
    state: ManagerState,
    path: Any,
    *,
    asynchronous: bool = False,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> SaveHandle:
    """Write the whole table: every session, their recency order, the counters and the configuration.

    See `save_session` for the arguments and errors.
    """
    if type(state) is not ManagerState:
        ms.check_state(state, "save")
    check_sessions(state, ms.sessions(state).items(), "save")
    writer = Writer(attr_hooks, asynchronous, object_hooks)
    sessions = [writer.session(session, sid) for sid, session in ms.sessions(state).items()]
    manifest = _manifest("table", sessions)
    manifest["table"] = {
        "max_sessions": state.max_sessions,
        "byte_budget": state.byte_budget,
        "evict_when_full": state.evict_when_full,
        "counters": list(state.counters),
    }
    return write(path, manifest, writer, asynchronous)


def load(
    path: Any,
    *,
    placement: Any = None,
    torch_device: Any = None,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
    templates: Mapping[str, Any] | None = None,
) -> ManagerState:
    """The table a `save` wrote: sessions in their recency order, counters and configuration as they were.

    See `load_session` for the arguments (``templates`` apply to the objects of that name in every session).

    Raises:
      CheckpointError: see `load_session`; also a checkpoint of one session (use `load_session`).
    """
    check_templates(templates)
    manifest, arrays = read_checkpoint(path, placement, torch_device)
    table = manifest.get("table")
    if manifest["kind"] != "table" or table is None:
        raise CheckpointError(f"{path} holds a session checkpoint, not a table; use load_session.")
    reader = Reader(arrays, attr_hooks, torch_device, object_hooks, templates)
    try:
        state = ManagerState.create(table["max_sessions"], table["byte_budget"], table["evict_when_full"])
    except SessionStateError as e:
        raise CheckpointError(f"{path}: the table's configuration is not one a table can have ({e}).") from e
    try:
        for entry in manifest["sessions"]:  # least recently used first: each insertion is the most recent
            state = install_session(state, entry["id"], reader.session(entry))
    except BaseException as e:
        release_sessions(ms.sessions(state).values(), e)
        if isinstance(e, CheckpointError):
            raise CheckpointError(f"{path}: {e}") from e  # (the reader knows the node, not the path)
        # (a name or value a crafted manifest gives is refused as damage: InvalidTypeError, InvalidArgumentError)
        data = isinstance(e, (InvalidTypeError, InvalidArgumentError))
        if (isinstance(e, (SessionStateError, KeyboardInterrupt)) and not data) or not isinstance(e, Exception):
            raise
        raise CheckpointError(f"{path}: a session cannot be rebuilt ({type(e).__name__}: {e}).") from e
    return ms.with_counters(state, table["counters"])


def _manifest(kind: str, sessions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT, "layout": LAYOUT, "library_version": __version__, "kind": kind, "sessions": sessions}
