"""`DreamZeroStateAdapter`: DreamZero's session-state surface over the functional core.

Same public surface as `BespokeDreamZeroState`, so a pipeline can use either. What the manager can act
on is a `StateObject`; what it only carries is an attr, declared once with `SessionAttr`:

=========================  ================================================  ===========================
name                       bucket                                            why
=========================  ================================================  ===========================
``stitched_frames``        `LatentBuffer` ring of 4                          accumulated, reset per window
``video_latents``          `LatentBuffer` append buffer (host memory)        accumulated over the session
``vae_encoder_out``        `LatentBuffer` ring of ``vae_encoder_window``      bounded: the reader needs only
                           latent frames (torch tensors, copied in)          the last few frames
``vae_enc_feat_map``       `DenseValue` (603 MiB at deploy shapes)           replaced whole or item by item,
                                                                             no recompute source: parkable
counters, conditioning     attrs                                             assigned wholesale by the model
pending body frames        attr (a list appended in place; forks copy it)    < 4 frames, views of the ring
=========================  ================================================  ===========================

The feat map reads and writes as before (``state.vae_enc_feat_map[i] = x``): the property returns a list
view whose item assignments commit into the `DenseValue`, so the manager can park the whole cache in host
memory between steps (`park_feat_map`) and restore it on the next access, bit for bit. Read the feat map
from the state each time it is used: the list a caller assigns is copied in, not kept by identity.

Torch tensors enter through `torch_bridge.wrap` (a JAX alias when DLPack allows, the tensor itself
otherwise; never a copy) and come back as torch tensors over the same storage, bit-identical. The encoder
ring is the exception: it is written and read back on every model step, where a JAX alias each way would cost
several times the step's own ``torch.cat`` (issue 24), so it keeps torch tensors (a `LatentBuffer` carries
any array type; accounting, park and checkpoint treat them alike): a copy of each frame it keeps, as the
bespoke history's ``torch.cat`` copies, so a caller reusing its output buffer never changes the window.
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

import torch

from functional_state import (
    DenseValue,
    InvalidArgumentError,
    LatentBuffer,
    NotAllocatedError,
    ObjectNotFoundError,
    PagedKVHandle,
    PagedKVPool,
    SessionAttr,
    SessionHandle,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
)

from ..bridge import unwrap, wrap
from ._dreamzero_rules import (
    FRAMES_PER_CHUNK,
    ResetRules,
    check_encoder_chunk,
    check_num_frames,
    check_video_out,
    split_frames,
    window_frames,
)
from .dreamzero_parts import (
    ENCODER,
    FRAMES,
    KV,
    LATENTS,
    StrictHandle,
    cat_time,
    check_window,
    dreamzero_component_nbytes,
    tensor_attr,
    to_state,
)
from .feat_map_view import FEAT_MAP, FeatMapView

__all__ = ["DreamZeroStateAdapter", "dreamzero_component_nbytes"]


def _lost_error(session_id: str) -> SessionStateLostError:
    return SessionStateLostError(
        f"DreamZero session {session_id!r}: this state object refers to a session that is no longer in the manager "
        f"(closed, restarted, or dropped by the byte budget); it neither reads nor writes any more, so nothing is "
        f"served stale or written nowhere. Get the session's state from the store again (`resume`), or begin it "
        f"anew (reset=True) if it is gone."
    )


class DreamZeroStateAdapter(ResetRules):
    """DreamZero session state backed by a `SessionStateManager` session.

    Args:
      session_id: the session (None means ``"default"``).
      manager: the manager holding the session.
      vae_encoder_window: latent frames the encoder ring retains (>= the largest ``num_frames`` the
        pipeline reads with `observation_latents`).
      strict: once the session incarnation leaves the table (closed, dropped, evicted, or replaced by a new
        session under the same id), every read and write raises `SessionStateLostError` instead of working
        on the detached copy (what `DreamZeroSessions` hands out: its continuations never restart silently).
        Off, the adapter keeps the state it holds, as the bespoke state does after an LRU eviction.

    Raises:
      ValueError: ``vae_encoder_window`` is not a positive int, or differs from the window the session
        was created with.

    Example:
      >>> manager = SessionStateManager()
      >>> state = DreamZeroStateAdapter("robot-0", manager, vae_encoder_window=2)
      >>> for i in range(3):
      ...     state.append_vae_encoder_chunk(torch.full((1, 32, 1, 4, 4), float(i)))
      >>> state.observation_latents(2)[0, 0, :, 0, 0].tolist()
      [1.0, 2.0]
    """

    FRAMES_PER_CHUNK = FRAMES_PER_CHUNK

    call_count = SessionAttr(default=0, coerce=int, doc="model calls in the current window")
    current_start_frame = SessionAttr(default=0, coerce=int, doc="first frame index of the current window")
    clip_feas = tensor_attr("image conditioning features")
    ys = tensor_attr("first-frame conditioning latents")
    language = tensor_attr("the prompt's text tokens")
    prompt_embeds = tensor_attr("encoded prompt")
    vae_stream_initialized = SessionAttr(default=False, coerce=bool, doc="the encoder stream has started")
    # A list the model appends to: a fork copies the list (not the tensors), so its appends stay its own.
    vae_pending_body_frames: SessionAttr[Any] = SessionAttr(
        default=None, on_fork="copy_container", doc="frames waiting for a full encoder chunk (appended in place)"
    )

    def __init__(
        self,
        session_id: str | None,
        manager: SessionStateManager,
        *,
        vae_encoder_window: int = 2,
        strict: bool = False,
    ):
        check_window(vae_encoder_window)
        self._attach(manager.get_or_create_session(session_id), vae_encoder_window, strict)

    @classmethod
    def from_handle(
        cls, handle: SessionHandle, *, vae_encoder_window: int = 2, strict: bool = False
    ) -> DreamZeroStateAdapter:
        """An adapter over the session incarnation ``handle`` names; creates nothing (what a store uses to serve
        an existing session). ``strict`` as for the constructor.

        Raises:
          ValueError: as the constructor.
        """
        check_window(vae_encoder_window)
        adapter = cls.__new__(cls)
        adapter._attach(handle, vae_encoder_window, strict)
        return adapter

    def _attach(self, handle: SessionHandle, vae_encoder_window: int, strict: bool) -> None:
        self._window = vae_encoder_window
        self._strict = bool(strict)
        self._handle = handle
        # Every read and write goes through ``_session`` (`SessionAttr` too). Strict, it refuses use once the
        # incarnation left the table (its writes would reach only a detached copy, its reads stale history),
        # each write deciding that under its own lock (`StrictHandle`).
        lost = partial(_lost_error, handle.session_id)  # (not a bound method: no cycle through the adapter)
        self._session = cast(SessionHandle, StrictHandle(handle, lost)) if self._strict else handle
        # Read without restoring: building an adapter (a store builds one per request when the caller keeps
        # none) must not pull parked buffers back into device memory; they are restored when used.
        state = handle.state
        existing = state.get(ENCODER, None)
        if existing is not None and (existing.resident or existing.parked) and existing.maxlen != vae_encoder_window:
            raise InvalidArgumentError(
                f"`DreamZeroStateAdapter`: session {handle.session_id!r} keeps a VAE encoder window of "
                f"{existing.maxlen} frames; this adapter asks for {vae_encoder_window}. Use the same window for "
                f"every adapter of a session."
            )
        for name in (FRAMES, LATENTS, ENCODER):
            if state.get(name, None) is None:
                self._buffer(name)  # a lost buffer (reset, eviction) is rebuilt by `_buffer` where it is used

    def _lost(self) -> SessionStateLostError:
        return _lost_error(self._handle.session_id)

    @property
    def in_table(self) -> bool:
        """Whether the session incarnation this adapter was made for is still in the manager's table."""
        return self._handle.in_table

    def _new_buffer(self, name: str) -> LatentBuffer:
        maxlen = {FRAMES: FRAMES_PER_CHUNK, LATENTS: None, ENCODER: self._window}[name]
        return LatentBuffer.create(maxlen=maxlen)

    def _buffer(self, name: str) -> LatentBuffer:
        """The buffer ``name``, rebuilt empty if the session lost it (reset or eviction)."""
        return self._session.get_or_create(name, lambda: self._new_buffer(name), LatentBuffer)

    def _commit_all(self, name: str, items: list[Any]) -> None:
        """Commit ``items`` into buffer ``name`` (rebuilt empty if the session lost it) in one transaction, so a
        reset from another adapter of the session can never land between the rebuild and the commits."""

        def commit_all(s: SessionState) -> SessionState:
            s, buf = s.get_or_create(name, lambda: self._new_buffer(name), LatentBuffer)
            for item in items:
                buf = buf.commit(item)
            return s.put(name, buf)

        self._session.transact(commit_all)

    @property
    def session_id(self) -> str:
        return self._handle.session_id

    # the VAE feat map: a DenseValue behind a list view
    @property
    def vae_enc_feat_map(self) -> FeatMapView | None:
        """The causal encoder's feature cache, or None: a list view (see `FeatMapView`)."""
        cache = self._session.get(FEAT_MAP, None)  # restored here if it was parked
        if cache is None or not cache.resident or cache.value is None:
            return None
        return FeatMapView(self._session)

    @vae_enc_feat_map.setter
    def vae_enc_feat_map(self, value: Any) -> None:
        if value is None:
            self._session.remove(FEAT_MAP)
        else:
            self._session.put(FEAT_MAP, DenseValue.create(list(value)))

    def park_feat_map(self) -> dict[str, int]:
        """Park the feat map in host memory until its next access (which restores it); returns the bytes moved
        per pool, or {} when there is none to park."""
        cache = self._session.get(FEAT_MAP, None)
        if cache is None or not cache.resident or cache.value is None:
            return {}
        return self._session.park(FEAT_MAP)

    @property
    def vae_encoder_window(self) -> int:
        return self._window

    # frames
    def accumulate_frames(self, stitched: Any) -> Any:
        """Add stitched frame(s); return the model's window (1 frame on the first call, then 4)."""
        new = split_frames(stitched)
        first_call = len(self._buffer(FRAMES)) == 0
        self._commit_all(FRAMES, [to_state(f) for f in new])
        return window_frames([unwrap(f) for f in self._buffer(FRAMES).view()], first_call)

    # video latents
    def append_video_latents(self, video_out: torch.Tensor) -> None:
        check_video_out(video_out)
        self._commit_all(LATENTS, [wrap(video_out.transpose(1, 2).detach().cpu())])

    def get_concatenated_video_latents(self) -> torch.Tensor | None:
        return cat_time(self._buffer(LATENTS).view())

    def clear_video_latents(self) -> None:
        self._session.put(LATENTS, self._new_buffer(LATENTS))

    # VAE encoder ring
    def _encoder_frames(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        # Each frame the ring keeps is its own copy, as the bespoke history's torch.cat makes one: a caller that
        # reuses its output buffer must not change the window. Only the frames the ring keeps are copied (a view
        # would keep the whole chunk alive and the ring would no longer bound memory).
        t = chunk.shape[2]
        keep = range(max(0, t - self._window), t)
        return [chunk[:, :, i : i + 1].clone(memory_format=torch.contiguous_format) for i in keep]

    def append_vae_encoder_chunk(self, chunk: torch.Tensor) -> None:
        """Append an encoded chunk (B, C, T, H, W); frames beyond the window are dropped, oldest first."""
        # The steady state (one latent frame per chunk) in one commit into the ring, of a copy of the tensor.
        # A ring the session lost (reset, eviction) is rebuilt in one transaction instead, as is a multi-frame chunk.
        if type(chunk) is torch.Tensor and chunk.dim() == 5 and chunk.size(2) == 1:
            try:
                frame = chunk.clone(memory_format=torch.contiguous_format)  # ours: see `_encoder_frames`
                (self._handle.commit_held if self._strict else self._handle.commit)(ENCODER, frame)
                return
            except (ObjectNotFoundError, NotAllocatedError):
                pass
            except SessionStateLostError as e:  # strict: `commit_held` refused a detached handle, under its lock
                if self._strict:
                    raise self._lost() from e
                raise
        check_encoder_chunk(chunk, "append_vae_encoder_chunk")
        self._commit_all(ENCODER, self._encoder_frames(chunk))

    @property
    def vae_encoder_out(self) -> torch.Tensor | None:
        """The retained encoder frames concatenated along time (dim 2), or None."""
        return cat_time(self._buffer(ENCODER).view())

    @vae_encoder_out.setter
    def vae_encoder_out(self, value: torch.Tensor | None) -> None:
        """Replace the ring wholesale: None clears it, a tensor seeds it with its last frames."""
        if value is not None:
            check_encoder_chunk(value, "vae_encoder_out")
            frames = self._encoder_frames(value)
        self._session.put(ENCODER, self._new_buffer(ENCODER))
        if value is not None:
            self._commit_all(ENCODER, frames)

    def observation_latents(self, num_frames: int) -> torch.Tensor | None:
        """The last ``num_frames`` latent frames (fewer if fewer were encoded), or None.

        Two or more frames come back as a fresh tensor (one ``torch.cat``), which no later append and no write
        into it can change; one frame is the ring's tensor itself (the bespoke path returns a view of its
        history), so write into a copy.

        Raises:
          ValueError: ``num_frames`` exceeds the window: the ring never returns a silently shorter window.
        """
        if type(num_frames) is not int or not 0 < num_frames <= self._window:
            self._check_window_read(num_frames)
        # A plain read of the table (strict: `held`, the table only); a parked or lost ring is restored or rebuilt.
        try:
            ring = self._handle.held(ENCODER) if self._strict else self._handle.state.get(ENCODER, None)
        except SessionStateLostError as e:
            raise self._lost() from e
        if ring is None or not ring.resident:
            ring = self._buffer(ENCODER)
        items = ring.view()[-num_frames:]
        if len(items) > 1:
            try:
                return torch.cat(items, 2)  # a fresh tensor: a later append never changes it
            except TypeError:
                pass  # not all torch tensors (JAX aliases put by another writer): converted below
        return cat_time(items)

    def _check_window_read(self, num_frames: Any) -> None:
        check_num_frames(num_frames)
        if num_frames > self._window:
            raise InvalidArgumentError(
                f"`observation_latents`: asked for {num_frames} latent frames but the encoder ring retains "
                f"{self._window} (vae_encoder_window). Build the adapter with vae_encoder_window >= {num_frames}."
            )

    def reset_vae_encoder_stream(self) -> None:
        for name in ("vae_stream_initialized", "vae_pending_body_frames"):
            self._session.del_attr(name)
        self._session.remove(FEAT_MAP)
        self._session.put(ENCODER, self._new_buffer(ENCODER))

    # self-attention KV: the engine owns the blocks, the session holds their ids
    @property
    def self_attn_kv_blocks(self) -> tuple[int, ...]:
        """Block ids of the session's self-attention KV in the engine's pool, oldest first."""
        handle = self._session.get(KV, None)
        return handle.block_ids if handle is not None and handle.resident else ()

    def append_self_attn_kv(self, pool: PagedKVPool, block_ids: Any) -> None:
        """Record blocks the engine filled with this session's K/V (a handle on ``pool``, made on first use)."""
        self._session.get_or_create(KV, lambda: PagedKVHandle.create(pool), PagedKVHandle)
        self._session.commit(KV, block_ids)

    def self_attn_kv(self) -> Any:
        """The session's K/V gathered from the pool in order (per pool layer), or None when it holds none."""
        handle = self._session.get(KV, None)
        return handle.view() if handle is not None and handle.resident and handle.block_ids else None

    def reset_self_attn_kv(self) -> None:
        """Let go of the KV blocks: the manager hands them back to the engine (when no fork holds them)."""
        self._session.remove(KV)

    # resets
    def reset(self, clear_video_latents: bool = True) -> None:
        """Session reset (everything back to defaults) or, with ``clear_video_latents=False``, a window
        reset that keeps the video latents, language, prompt_embeds and the VAE stream. Both let go of
        the self-attention KV (a window reset starts attention afresh)."""
        if clear_video_latents:
            self._session.reset()
        else:
            self._session.put(FRAMES, self._new_buffer(FRAMES))
            for name in ("call_count", "current_start_frame", "clip_feas", "ys"):
                self._session.del_attr(name)
            self._session.remove(KV)

    # accounting
    def component_nbytes(self) -> dict[str, int]:
        """Bytes held per component (each allocation once within a component; components may share one,
        e.g. the pending frames are views of the stitched frames, so they do not add up to the total)."""
        return dreamzero_component_nbytes(self._session.state)

    def total_nbytes(self) -> int:
        """Every byte the session holds, each allocation counted once (the accounting's figure)."""
        return sum(self._session.state.nbytes_by_device().values())

    def __repr__(self) -> str:
        return f"DreamZeroStateAdapter({self.session_id!r}, window={self._window}, {self._handle!r})"
