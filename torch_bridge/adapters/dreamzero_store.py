"""`DreamZeroSessions`: the serving lifecycle of DreamZero sessions: begin, resume, close and export.

A serving runner sends each request either as the beginning of a session or as its continuation. A
continuation must find its session exactly as the previous request left it: DreamZero's VAE causal cache
(the 603 MiB feat map) has no recompute source, so a session that was evicted or released cannot be rebuilt,
and serving it fresh state would restart the rollout silently, producing normal-looking, wrong output. So:

* `begin` admits a new session (or restarts an existing one, clean). At the resident bound it *refuses*
  with `SessionAdmissionError`: a new session never costs a resident one its history (no LRU eviction).
* `resume` returns the session's state, or raises `SessionStateLostError` saying how to recover (it never
  creates anything); `close` releases a session (twice, or an unknown id: a no-op).
* a state handed out serves only the session incarnation it was made for: once that leaves the table
  (closed, restarted, dropped by the byte budget) it raises `SessionStateLostError` on every use rather
  than read stale history or write where nobody reads. The store holds its states weakly, so a dropped
  session's buffers are freed as soon as no caller holds them.
* the export helpers read and clear the accumulated video latents of a live session and never create one.

Both paths implement this, switched by ``OMNI_DIFFUSION_SESSION_STATE_MANAGER``: bespoke states in an
admission-controlled dict, manager-backed adapters over a `SessionStateManager(evict_when_full=False)`; the
A/B check routes its rollouts through this store, so both paths run under the same lifecycle.

The resident bound is sized by bytes: ``DEFAULT_RESIDENT_BYTES`` (8 GiB) divided by the bytes one
deploy-shape session holds (`estimate_session_nbytes`), not the bespoke cache's 64 slots (64 x 603 MiB =
38.6 GiB would exhaust a GPU long before the count cap fired); a runner publishes its own with
`set_resident_capacity`."""

from __future__ import annotations

import logging
import operator
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from functional_state import (
    LEVERS,
    InvalidArgumentError,
    InvalidTypeError,
    SessionAdmissionError,
    SessionStateLostError,
    SessionStateManager,
    resolve_session_id,
    resolve_session_state_config,
)
from functional_state.shell.config import parse_bool as _parse_bool

from .dreamzero import DreamZeroStateAdapter
from .dreamzero_bespoke import BespokeDreamZeroState

__all__ = [
    "DEFAULT_RESIDENT_BYTES",
    "DreamZeroSessions",
    "begins_session",
    "default_resident_bound",
    "estimate_session_nbytes",
]

_log = logging.getLogger("functional_state")

MIB = 2**20
DEFAULT_RESIDENT_BYTES = 8 * 2**30  # what resident DreamZero sessions may hold together, by default
TICK_KEY = "tick"  # a typed tick: extra_args[TICK_KEY] = {"reset": bool, ...}


def estimate_session_nbytes(
    *,
    feat_map_bytes: int = 603 * MIB,
    stitched_hw: tuple[int, int] = (352, 640),
    latent_hw: tuple[int, int] = (44, 80),
    encoder_channels: int = 32,
    latent_channels: int = 16,
    vae_encoder_window: int = 2,
    num_frame_per_block: int = 2,
    steps: int = 400,
) -> int:
    """Bytes one DreamZero session holds at ``steps`` steps with the manager-backed state (deploy shapes by
    default): the feat map, four stitched uint8 frames (the pending body frames are views of them), the
    encoder ring, and the video latents accumulated every four steps (``num_frame_per_block`` bf16 latent
    frames each). It matches the accounting of a 400-step rollout (BENCHMARKS.md, DreamZero memory).

    Example:
      >>> round(estimate_session_nbytes() / 2**20, 1)
      627.5
    """
    frame = stitched_hw[0] * stitched_hw[1] * 3
    latent = latent_hw[0] * latent_hw[1] * 2
    return (
        feat_map_bytes
        + 4 * frame
        + vae_encoder_window * encoder_channels * latent
        + (steps // 4) * num_frame_per_block * latent_channels * latent
    )


def default_resident_bound(per_session_bytes: int | None = None, budget: int = DEFAULT_RESIDENT_BYTES) -> int:
    """How many sessions fit in ``budget`` bytes (at least 1).

    Example:
      >>> default_resident_bound()
      13
    """
    per = estimate_session_nbytes() if per_session_bytes is None else per_session_bytes
    if per <= 0:
        raise InvalidArgumentError(f"`default_resident_bound`: per_session_bytes must be positive, got {per}.")
    return max(1, budget // per)


def _session_count(value: Any, what: str) -> int:
    """``value`` as a positive session count: any integer (``int``, ``np.int64``, anything `operator.index`
    accepts), never a bool or a float.

    Raises:
      InvalidTypeError: not an integer. InvalidArgumentError: below 1.
    """
    if isinstance(value, bool):
        raise InvalidTypeError(f"`{what}` must be a positive integer session count, got the bool {value!r}.")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidTypeError(
            f"`{what}` must be a positive integer session count, got {value!r} ({type(value).__name__}); pass "
            f"an int (round a computed capacity down with int())."
        ) from None
    if n < 1:
        raise InvalidArgumentError(f"`{what}` must be a positive integer session count (>= 1), got {n}.")
    return n


def _flag(value: Any) -> bool | None:
    """A reset flag as a runner sends it (bool, 0/1, or a 1/0/true/false/yes/no/on/off string); None if not."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return bool(value) if value in (0, 1) else None
    if isinstance(value, str):
        return _parse_bool(value)
    return None


def begins_session(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request begins a session (True) or continues one (False), as a runner sends it.

    Two sources: a flat ``reset`` key, and a typed tick, a mapping under ``"tick"`` carrying ``reset``. Either
    saying begin makes a begin. A malformed tick (not a mapping, or a reset that is not a flag) is ignored and
    the flat key decides.

    Raises:
      InvalidArgumentError: the flat ``reset`` is present but not a flag.

    Example:
      >>> begins_session({"reset": True}), begins_session({"tick": {"reset": 1}}), begins_session({})
      (True, True, False)
      >>> begins_session({"tick": "garbage", "reset": False})
      False
    """
    if not extra_args:
        return False
    flat = False
    if "reset" in extra_args:
        parsed = _flag(extra_args["reset"])
        if parsed is None:
            raise InvalidArgumentError(
                f"`begins_session`: extra_args['reset'] must be a flag (bool, 0/1, or true/false), got "
                f"{extra_args['reset']!r}."
            )
        flat = parsed
    tick = extra_args.get(TICK_KEY)
    tick_reset = _flag(tick.get("reset")) if isinstance(tick, Mapping) and "reset" in tick else None
    return flat or bool(tick_reset)


def _lost(sid: str, why: str) -> SessionStateLostError:
    return SessionStateLostError(
        f"DreamZero session {sid!r} cannot be continued: {why}. Its state (the VAE feat map above all) cannot be "
        f"rebuilt, so it is not restarted behind your back: send the request again as a session begin (reset=True), "
        f"which starts it clean."
    )


class DreamZeroSessions:
    """The DreamZero session store a pipeline calls: `begin`, `resume`, `close`, exports, capacity.

    Args:
      enable_session_state_manager: the config value of the flag; the environment overrides it (see
        `resolve_session_state_config`). Off: bespoke states; on: adapters over a `SessionStateManager`.
      resident_bound: sessions that may be resident at once (any positive integer). None: the
        ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS`` environment variable when it is set to a
        positive int (see `resolve_session_state_config`), else sized by bytes (`default_resident_bound`).
        An explicit value is code, not config, so the variable does not override it.
      vae_encoder_window: the manager-backed adapters' encoder ring length.
      byte_budget: the manager's byte budget (see `SessionStateManager`): under pressure the planner parks
        the feat maps of the least recently used sessions (restored on their next request) before it
        would drop a session.
      release_levers: the levers that budget may use (drop a session only if ``"drop"`` is among them; a
        dropped session's continuation then raises `SessionStateLostError`).

    Example:
      >>> store = DreamZeroSessions(enable_session_state_manager=True, resident_bound=1)
      >>> state = store.begin("robot-0")
      >>> store.resume("robot-0") is state
      True
      >>> store.begin("robot-1")
      Traceback (most recent call last):
      ...
      functional_state.errors.SessionAdmissionError: DreamZero session 'robot-1' refused: 1 of 1 resident sessions ...
    """

    def __init__(
        self,
        enable_session_state_manager: bool | None = None,
        *,
        resident_bound: int | None = None,
        vae_encoder_window: int = 2,
        byte_budget: Any = None,
        release_levers: Iterable[str] = LEVERS,
    ):
        # The byte-sized bound is the "config" value the environment's cap overrides (the resolver owns the
        # parsing and the warning on a bad value); an explicit resident_bound overrides both.
        config = resolve_session_state_config(enable_session_state_manager, default_resident_bound())
        self.enabled = config.enabled
        if resident_bound is None:
            bound = config.max_sessions
        else:
            bound = _session_count(resident_bound, "DreamZeroSessions: resident_bound")
        self._bound = bound
        self._window = vae_encoder_window
        # The two stores share one bound and one policy; the flag picks which one serves.
        self._bespoke: OrderedDict[str, BespokeDreamZeroState] = OrderedDict()
        self.manager = SessionStateManager(
            max_sessions=bound, evict_when_full=False, byte_budget=byte_budget, release_levers=release_levers
        )
        # The adapters handed out, weakly: the store never keeps a session's data alive (the table does, and
        # the callers holding its state), so a session the budget drops is freed once no caller holds it. A
        # cached adapter is served only while its incarnation is the one in the table (`_adapter`).
        self._adapters: weakref.WeakValueDictionary[str, DreamZeroStateAdapter] = weakref.WeakValueDictionary()
        self.current_session_id: str | None = None  # the pipeline-level alias: the session being served

    # --- capacity --------------------------------------------------------------------------------------
    @property
    def resident_bound(self) -> int:
        return self._bound

    def set_resident_capacity(self, n: Any) -> None:
        """A runner publishes how many sessions its memory holds: the bound of both stores rises to ``n``
        (any positive integer, e.g. ``np.int64``). A value at or below the bound leaves it as it is: lowering
        it would have to drop sessions.

        Raises:
          InvalidTypeError: ``n`` is not an integer (a bool, a float, a string). InvalidArgumentError:
            ``n`` < 1. The bound is unchanged then.
        """
        count = _session_count(n, "DreamZeroSessions.set_resident_capacity: n")
        if count <= self._bound:
            return
        self.manager.raise_max_sessions(count)
        self._bound = count

    def __len__(self) -> int:
        return len(self.manager) if self.enabled else len(self._bespoke)

    def __contains__(self, session_id: object) -> bool:
        sid = session_id if session_id is not None else resolve_session_id(None)
        return sid in self.manager if self.enabled else sid in self._bespoke

    @property
    def current(self) -> Any:
        """The state of the session being served (the pipeline's alias), or None."""
        sid = self.current_session_id
        return None if sid is None or sid not in self else self._state(sid)

    # --- lifecycle -------------------------------------------------------------------------------------
    def begin(self, session_id: str | None) -> Any:
        """Admit a session and return its state, clean: a new one, or an existing one restarted.

        Raises:
          SessionAdmissionError: ``resident_bound`` sessions are resident and this is a new one. Nothing is
            evicted and every resident session is left exactly as it was.
        """
        sid = resolve_session_id(session_id)
        if sid not in self and len(self) >= self._bound:
            raise SessionAdmissionError(
                f"DreamZero session {sid!r} refused: {len(self)} of {self._bound} resident sessions are in use, and "
                f"a new session never evicts one (its feat map cannot be rebuilt). Close a finished session, or "
                f"raise the bound with set_resident_capacity if memory allows."
            )
        self.close(sid)  # a begin of an existing session restarts it clean
        state: Any
        if self.enabled:
            handle = self.manager.get_or_create_session(sid)  # admission is checked above; this cannot evict
            self._adapters[sid] = state = self._new_adapter(handle)
        else:
            self._bespoke[sid] = state = BespokeDreamZeroState()
        self.current_session_id = sid
        return state

    def resume(self, session_id: str | None) -> Any:
        """The state of a live session, for a continuation; the same object each time while a caller holds
        it (the store itself holds its states weakly).

        Raises:
          SessionStateLostError: the session is unknown, was closed, or is gone; nothing is created.
        """
        sid = resolve_session_id(session_id)
        if sid not in self:
            raise _lost(sid, "it is not resident (never begun, closed, or lost)")
        if self.enabled:
            handle = self.manager.get_session(sid)  # a use: keeps recency meaningful for a later planner
            state: Any = self._adapter(sid, handle)
        else:
            self._bespoke.move_to_end(sid)
            state = self._bespoke[sid]
        self.current_session_id = sid
        return state

    def close(self, session_id: str | None) -> bool:
        """Release a session and its buffers. Returns whether it was resident; closing again is a no-op.
        The pipeline alias is cleared if it named this session, and kept otherwise."""
        sid = resolve_session_id(session_id)
        if self.enabled:
            self._adapters.pop(sid, None)
            existed = self.manager.drop_session(sid)
        else:
            existed = self._bespoke.pop(sid, None) is not None
        if self.current_session_id == sid:
            self.current_session_id = None
        return existed

    reset_session = close

    # --- checkpoints ---------------------------------------------------------------------------------
    def save(self, session_id: str | None, path: Any, *, asynchronous: bool = False, **hooks: Any) -> Any:
        """Checkpoint a live session (manager path) to ``path``; see `functional_state.save_session`. Pass
        ``object_hooks={"self_attn_kv": engine.checkpoint_hooks()}`` when the session holds engine KV.

        Raises:
          SessionStateLostError: no such session. InvalidArgumentError: the bespoke path (it has no
          checkpoint format; that is what the manager path adds).
        """
        sid = resolve_session_id(session_id)
        self._require_manager("save")
        self._live(sid, "save")
        return self.manager.save_session(sid, path, asynchronous=asynchronous, **hooks)

    def load(self, session_id: str | None, path: Any, **kwargs: Any) -> Any:
        """Admit a session from the checkpoint at ``path`` (after a restart, or moved from another worker)
        and return its state; continuations then `resume` it. Admission follows `begin`'s bound.

        Raises:
          SessionAdmissionError: the store is full. CheckpointError, SessionExistsError: see
          `functional_state.load_session`.
        """
        sid = resolve_session_id(session_id)
        self._require_manager("load")
        if sid not in self and len(self) >= self._bound:
            raise SessionAdmissionError(
                f"DreamZero session {sid!r} refused: {len(self)} of {self._bound} resident sessions are in use."
            )
        self.manager.load_session(sid, path, **kwargs)
        return self.resume(sid)  # a new incarnation: `_adapter` never serves an adapter of the old one

    def _require_manager(self, what: str) -> None:
        if not self.enabled:
            raise InvalidArgumentError(
                f"`DreamZeroSessions.{what}`: checkpoints need the manager-backed state "
                f"(enable_session_state_manager); the bespoke state has no checkpoint format."
            )

    def _new_adapter(self, handle: Any) -> DreamZeroStateAdapter:
        # strict: once its session leaves the table the adapter raises instead of working on a detached copy
        return DreamZeroStateAdapter.from_handle(handle, vae_encoder_window=self._window, strict=True)

    def _adapter(self, sid: str, handle: Any = None) -> DreamZeroStateAdapter:
        """The adapter of the session ``sid`` the table holds now: the cached one if it was made for that very
        incarnation, else a new one over it. An adapter of an incarnation that left the table (closed, dropped
        by the budget, or replaced by a new session under the same id) is never served.

        Raises:
          SessionStateLostError: the table holds no session ``sid``; nothing is created.
        """
        adapter = self._adapters.get(sid)
        if adapter is not None and adapter.in_table:
            return adapter
        if adapter is not None:
            _log.debug("DreamZero store: session %r was replaced or dropped in the manager; new adapter", sid)
        handle = handle if handle is not None else self.manager.get_session(sid)
        self._adapters[sid] = adapter = self._new_adapter(handle)
        return adapter

    def _state(self, sid: str) -> Any:
        return self._adapter(sid) if self.enabled else self._bespoke[sid]

    def _live(self, session_id: str | None, what: str) -> Any:
        sid = resolve_session_id(session_id)
        if sid not in self:
            raise _lost(sid, f"`{what}` found no resident session")
        return self._state(sid)

    # --- exports ---------------------------------------------------------------------------------------
    def decode_accumulated_video_latents(self, session_id: str | None) -> torch.Tensor | None:
        """The session's accumulated video latents (time on dim 2), for decoding; None when there are none.

        Raises:
          SessionStateLostError: no such session (export never creates one).
        """
        return self._live(session_id, "decode_accumulated_video_latents").get_concatenated_video_latents()

    def clear_accumulated_video_latents(self, session_id: str | None) -> None:
        """Drop exported latents; the session stays continuable (its stream, frames and counters survive).

        Raises:
          SessionStateLostError: no such session.
        """
        self._live(session_id, "clear_accumulated_video_latents").clear_video_latents()

    def __repr__(self) -> str:
        path = "manager" if self.enabled else "bespoke"
        return f"DreamZeroSessions({path}, {len(self)}/{self._bound} resident)"
