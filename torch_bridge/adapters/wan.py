"""`WanEncoderStream`: diffusers' Wan 2.1 causal VAE encoder, streamed chunk by chunk, its feat cache per session.

`AutoencoderKLWan._encode` encodes a whole video at once: the first frame alone, then groups of 4, each
chunk reading and replacing the conv feature cache (``_enc_feat_map``, passed as ``feat_cache=`` with a fresh
``feat_idx=[0]`` per chunk), then ``quant_conv``. A serving loop gets frames as they arrive, for many
sessions at once. This stream owns that chunking per session: frames that do not yet make a whole group wait
(carried in the session), and every call returns the latents of the chunks it completed, so the
concatenated outputs of a session equal ``vae.encode(whole_video).latent_dist.parameters`` bit for bit.

Each session's feat cache is one `DenseValue` in a `SessionStateManager` session, read once and written once
per call (one transaction, whatever the number of cached layers), so it parks, forks and checkpoints as one
object:

===========================  ==========================================  ===================================
name                         bucket                                      why
===========================  ==========================================  ===================================
``wan_enc_feat_map``         `DenseValue` (a tuple of tensors and Nones)  the conv cache; parkable, exact
``wan_pending_frames``       attr (a tensor of < 4 frames, or None)      a group still waiting for frames
``wan_frames_in``            attr (int)                                  frames accepted so far
``wan_frame_spec``           attr (batch, channels, height, width,       what every later chunk must match
                             dtype)
===========================  ==========================================  ===================================

Needs diffusers: ``pip install 'functional-state[diffusers]'``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from functional_state import (
    DenseValue,
    InvalidArgumentError,
    InvalidTypeError,
    ObjectNotFoundError,
    SessionExistsError,
    SessionHandle,
    SessionState,
    SessionStateError,
    SessionStateManager,
    StateShapeError,
)

__all__ = ["FEAT_MAP", "FRAMES_PER_GROUP", "MissingExtraError", "WanEncoderStream", "require_diffusers"]

_log = logging.getLogger("functional_state")

FEAT_MAP = "wan_enc_feat_map"
_PENDING = "wan_pending_frames"
_FRAMES_IN = "wan_frames_in"
_SPEC = "wan_frame_spec"
FRAMES_PER_GROUP = 4  # frames per chunk after the first (Wan's temporal compression)


class MissingExtraError(SessionStateError, ImportError):
    """A feature needs a package of an optional extra that is not installed."""


def require_diffusers() -> Any:
    """The ``diffusers.models.autoencoders.autoencoder_kl_wan`` module.

    Raises:
      MissingExtraError: diffusers is not installed (the message names the ``[diffusers]`` extra).
    """
    try:
        from diffusers.models.autoencoders import autoencoder_kl_wan
    except ImportError as e:
        raise MissingExtraError(
            "`WanEncoderStream` runs diffusers' `AutoencoderKLWan`, and diffusers is not installed: "
            "`pip install 'functional-state[diffusers]'`."
        ) from e
    return autoencoder_kl_wan


def _manager_of(store_or_manager: Any) -> SessionStateManager:
    if isinstance(store_or_manager, SessionStateManager):
        return store_or_manager
    manager = getattr(store_or_manager, "manager", None)  # a DreamZeroSessions on the manager path
    if isinstance(manager, SessionStateManager):
        return manager
    raise InvalidTypeError(
        f"`WanEncoderStream`: store_or_manager must be a `SessionStateManager` or a store with one (a "
        f"`DreamZeroSessions` on the manager path), got {type(store_or_manager).__name__}."
    )


class WanEncoderStream:
    """Per-session streaming of a Wan causal VAE encoder over a `SessionStateManager`.

    Args:
      vae: a diffusers ``AutoencoderKLWan`` (its ``encoder`` and ``quant_conv`` are used; patchified
        Wan 2.2 VAEs and tiled encoding are not supported).
      store_or_manager: the `SessionStateManager` holding the sessions, or a store exposing one as
        ``.manager`` (`DreamZeroSessions` on the manager path).
      park_between_calls: park each session's feat cache in host memory after every call (restored on the
        next); a byte budget on the manager may also park it when it needs the room.

    Raises:
      MissingExtraError: diffusers is not installed.
      InvalidTypeError: ``vae`` is not an ``AutoencoderKLWan``, or ``store_or_manager`` holds no manager.
      InvalidArgumentError: ``vae`` is patchified (``patch_size`` set).

    Example:
      >>> from diffusers import AutoencoderKLWan
      >>> _ = torch.manual_seed(0)
      >>> vae = AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=1).eval()
      >>> stream = WanEncoderStream(vae, SessionStateManager())
      >>> stream.begin("robot-0")
      >>> video = torch.randn(1, 3, 5, 16, 16)
      >>> [tuple(stream.encode("robot-0", video[:, :, t : t + 1]).shape) for t in range(5)]
      [(1, 8, 1, 2, 2), (1, 8, 0, 2, 2), (1, 8, 0, 2, 2), (1, 8, 0, 2, 2), (1, 8, 1, 2, 2)]
      >>> stream.close("robot-0")
    """

    def __init__(self, vae: Any, store_or_manager: Any, *, park_between_calls: bool = False):
        wan = require_diffusers()
        if not isinstance(vae, wan.AutoencoderKLWan):
            raise InvalidTypeError(
                f"`WanEncoderStream`: vae must be a diffusers `AutoencoderKLWan`, got {type(vae).__name__}."
            )
        if vae.config.patch_size is not None:
            raise InvalidArgumentError(
                f"`WanEncoderStream`: patchified VAEs (patch_size={vae.config.patch_size}) are not supported."
            )
        if not isinstance(park_between_calls, bool):
            raise InvalidTypeError(
                f"`WanEncoderStream`: park_between_calls must be a bool, got {park_between_calls!r}."
            )
        self.vae = vae
        self.manager = _manager_of(store_or_manager)
        self.park_between_calls = park_between_calls
        self._conv_count = sum(isinstance(m, wan.WanCausalConv3d) for m in vae.encoder.modules())
        # Halvings of height and width, read off the encoder itself: `vae.spatial_compression_ratio` is a config
        # value (default 8) that need not match `dim_mult`, and an empty output must have the grid of the others.
        self._halvings = sum(
            isinstance(m, wan.WanResample) and m.mode.startswith("downsample") for m in vae.encoder.modules()
        )
        self._in_channels = vae.config.in_channels
        self._dtype = next(vae.parameters()).dtype

    # --- sessions ----------------------------------------------------------------------------------
    def begin(self, session_id: str) -> None:
        """Start a stream in session ``session_id`` (created if absent) with an empty feat cache.

        Raises:
          SessionExistsError: the session already has a stream (`close` it first).
        """
        handle = self.manager.get_or_create_session(session_id)

        def start(s: SessionState) -> SessionState:
            if FEAT_MAP in s:
                raise SessionExistsError(
                    f"`WanEncoderStream.begin`: session {session_id!r} already has a stream; `close` it first."
                )
            s = s.put(FEAT_MAP, DenseValue.create([None] * self._conv_count))
            return s.set_attr(_PENDING, None).set_attr(_FRAMES_IN, 0).set_attr(_SPEC, None)

        handle.transact(start)

    def close(self, session_id: str) -> None:
        """End the stream of ``session_id``: its feat cache and pending frames leave the session (the session
        itself stays; drop it with the manager). Unknown sessions raise as in `encode`."""
        handle = self._handle(session_id, "close")
        handle.transact(lambda s: s.remove(FEAT_MAP).del_attr(_PENDING).del_attr(_FRAMES_IN).del_attr(_SPEC))

    def fork(self, source_id: str, new_id: str) -> None:
        """Fork session ``source_id`` (its stream included) as ``new_id``: both continue independently.

        The fork shares the cached tensors (never written in place), so it costs no copy."""
        self._handle(source_id, "fork")
        self.manager.fork_session(source_id, new_id)

    def pending_frames(self, session_id: str) -> int:
        """Frames of ``session_id`` waiting for their group to fill (0 to 3)."""
        pending = self._handle(session_id, "pending_frames").get_attr(_PENDING)
        return 0 if pending is None else int(pending.shape[2])

    def frames_in(self, session_id: str) -> int:
        """Frames ``session_id`` has accepted so far."""
        return int(self._handle(session_id, "frames_in").get_attr(_FRAMES_IN))

    def _handle(self, session_id: str, what: str) -> SessionHandle:
        handle = self.manager.get_session(session_id)  # SessionStateLostError for an unknown session
        if FEAT_MAP not in handle.state:
            raise ObjectNotFoundError(
                f"`WanEncoderStream.{what}`: session {session_id!r} has no stream; start one with `begin`."
            )
        return handle

    # --- encoding ----------------------------------------------------------------------------------
    def _check_frames(self, frames: Any, spec: tuple[Any, ...] | None, session_id: str) -> tuple[Any, ...]:
        if not isinstance(frames, torch.Tensor):
            raise InvalidTypeError(
                f"`WanEncoderStream.encode`: frames must be a torch tensor (batch, channels, time, height, "
                f"width), got {type(frames).__name__}."
            )
        if frames.ndim != 5 or frames.shape[2] < 1:
            raise StateShapeError(
                f"`WanEncoderStream.encode`: frames must be (batch, channels, time >= 1, height, width), got "
                f"shape {tuple(frames.shape)}."
            )
        got = (frames.shape[0], frames.shape[1], frames.shape[3], frames.shape[4], str(frames.dtype))
        if frames.shape[1] != self._in_channels:
            raise StateShapeError(
                f"`WanEncoderStream.encode`: the VAE takes {self._in_channels} channels, got frames of shape "
                f"{tuple(frames.shape)}."
            )
        if frames.dtype != self._dtype:
            raise StateShapeError(
                f"`WanEncoderStream.encode`: frames must be {self._dtype} (the VAE's dtype), got {frames.dtype}."
            )
        if spec is not None and got != spec:
            raise StateShapeError(
                f"`WanEncoderStream.encode`: session {session_id!r} streams (batch, channels, height, width, "
                f"dtype) = {spec}, got {got}. Start another session for another video shape."
            )
        return got

    def encode(self, session_id: str, frames: torch.Tensor) -> torch.Tensor:
        """Encode the frames that arrived for ``session_id``; returns the latents of the chunks they completed.

        Args:
          session_id: a session started with `begin`.
          frames: (batch, channels, time, height, width), the VAE's dtype; every call of a session has the
            same batch, channels, height and width.

        Returns:
          ``(batch, 2 * z_dim, n, height / 8, width / 8)`` (a factor of 2 per encoder downsampling: 8 for the
          default ``dim_mult``): the ``quant_conv`` output (the latent distribution's parameters: mean, then
          log-variance) of the ``n`` chunks completed by this call (``n`` may be 0).

        Raises:
          SessionStateLostError: the session is unknown.
          ObjectNotFoundError: the session has no stream (`begin` it).
          InvalidTypeError, StateShapeError: ``frames`` is not a 5-d tensor of the VAE's channels and dtype,
            or differs in shape from the session's earlier frames. Nothing changes then.
        """
        handle = self._handle(session_id, "encode")
        s = handle.state
        spec = self._check_frames(frames, s.get_attr(_SPEC), session_id)
        cache = list(handle.get(FEAT_MAP).value)  # restored here if it was parked
        pending = s.get_attr(_PENDING)
        done = int(s.get_attr(_FRAMES_IN))
        x = frames if pending is None else torch.cat([pending, frames], dim=2)

        chunks = []
        start = 0
        if done == 0:  # the first frame of the video is a chunk of its own
            chunks.append(x[:, :, :1])
            start = 1
        while x.shape[2] - start >= FRAMES_PER_GROUP:
            chunks.append(x[:, :, start : start + FRAMES_PER_GROUP])
            start += FRAMES_PER_GROUP
        # A view would pin the whole concatenation; the rest is < 4 frames, so copy it into its own storage.
        rest = x[:, :, start:].clone() if start < x.shape[2] else None

        with torch.no_grad():
            outs = [self.vae.encoder(chunk, feat_cache=cache, feat_idx=[0]) for chunk in chunks]
            if outs:
                latents = self.vae.quant_conv(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])
            else:
                latents = self._empty_latents(frames)

        total = done + frames.shape[2]
        handle.transact(
            lambda st: (
                st.update(FEAT_MAP, lambda obj: obj.commit(tuple(cache)))
                .set_attr(_PENDING, rest)
                .set_attr(_FRAMES_IN, total)
                .set_attr(_SPEC, spec)
            )
        )
        if self.park_between_calls:
            moved = handle.park(FEAT_MAP)
            _log.debug("wan stream %r: parked the feat cache (%s)", session_id, moved)
        return latents

    def _empty_latents(self, frames: torch.Tensor) -> torch.Tensor:
        b, _, _, h, w = frames.shape
        h, w = h >> self._halvings, w >> self._halvings  # (pad right and bottom by 1, 3x3 conv of stride 2: h // 2)
        z2 = self.vae.quant_conv.out_channels
        return torch.empty((b, z2, 0, h, w), dtype=self._dtype, device=frames.device)

    def __repr__(self) -> str:
        return f"WanEncoderStream({self._conv_count} cached convs, park_between_calls={self.park_between_calls})"
