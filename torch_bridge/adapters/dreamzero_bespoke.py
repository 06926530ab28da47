"""The bespoke DreamZero session state: the reference (A side) that every A/B check compares against.

It keeps state the way the model did before the manager: plain fields on a Python object, an unbounded
VAE encoder history, and a fixed-size LRU cache of sessions.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import torch

from functional_state import nbytes_by_device

from ._dreamzero_rules import (
    FRAMES_PER_CHUNK,
    MAX_DREAMZERO_SESSIONS,
    ResetRules,
    check_encoder_chunk,
    check_num_frames,
    check_video_out,
    split_frames,
    window_frames,
)

__all__ = ["BespokeDreamZeroCache", "BespokeDreamZeroState"]


class BespokeDreamZeroState(ResetRules):
    """One DreamZero session, kept in plain fields (the pre-manager code path)."""

    FRAMES_PER_CHUNK = FRAMES_PER_CHUNK

    def __init__(self) -> None:
        self._frames: deque = deque(maxlen=FRAMES_PER_CHUNK)
        self._video_latents: list[torch.Tensor] = []
        self.vae_encoder_out: torch.Tensor | None = None
        self.vae_stream_initialized = False
        self.vae_enc_feat_map: Any = None
        self.vae_pending_body_frames: Any = None
        self.call_count = 0
        self.current_start_frame = 0
        self.clip_feas: Any = None
        self.ys: Any = None
        self.language: Any = None
        self.prompt_embeds: Any = None

    # frames
    def accumulate_frames(self, stitched: Any) -> Any:
        """Add stitched frame(s); return the model's window (1 frame on the first call, then 4)."""
        new = split_frames(stitched)
        first_call = len(self._frames) == 0
        self._frames.extend(new)
        return window_frames(list(self._frames), first_call)

    # video latents
    def append_video_latents(self, video_out: torch.Tensor) -> None:
        check_video_out(video_out)
        self._video_latents.append(video_out.transpose(1, 2).detach().cpu())

    def get_concatenated_video_latents(self) -> torch.Tensor | None:
        if not self._video_latents:
            return None
        if len(self._video_latents) == 1:
            return self._video_latents[0]
        return torch.cat(self._video_latents, dim=2)

    def clear_video_latents(self) -> None:
        self._video_latents = []

    # VAE encoder stream
    def append_vae_encoder_chunk(self, chunk: torch.Tensor) -> None:
        """Concatenate an encoded chunk (B, C, T, H, W) onto the session's whole history (dim 2)."""
        check_encoder_chunk(chunk, "append_vae_encoder_chunk")
        if self.vae_encoder_out is None:
            self.vae_encoder_out = chunk
        else:
            self.vae_encoder_out = torch.cat([self.vae_encoder_out, chunk], dim=2)

    def observation_latents(self, num_frames: int) -> torch.Tensor | None:
        """The last ``num_frames`` latent frames of the history (fewer if the history is shorter)."""
        check_num_frames(num_frames)
        if self.vae_encoder_out is None:
            return None
        return self.vae_encoder_out[:, :, -num_frames:]

    def reset_vae_encoder_stream(self) -> None:
        self.vae_stream_initialized = False
        self.vae_enc_feat_map = None
        self.vae_encoder_out = None
        self.vae_pending_body_frames = None

    # resets
    def reset(self, clear_video_latents: bool = True) -> None:
        """Session reset (everything) or, with ``clear_video_latents=False``, a window reset that keeps the
        video latents, language, prompt_embeds and the VAE stream."""
        self._frames.clear()
        self.call_count = 0
        self.current_start_frame = 0
        self.clip_feas = None
        self.ys = None
        if clear_video_latents:
            self.clear_video_latents()
            self.language = None
            self.prompt_embeds = None
            self.reset_vae_encoder_stream()

    # accounting
    def total_nbytes(self) -> int:
        """Every byte the session holds, each allocation counted once across components."""
        return sum(nbytes_by_device(list(self._parts().values())).values())

    def component_nbytes(self) -> dict[str, int]:
        """Bytes held per component (each allocation once within a component)."""
        return {name: sum(nbytes_by_device(value).values()) for name, value in self._parts().items()}

    def _parts(self) -> dict[str, Any]:
        return {
            "stitched_frames": list(self._frames),
            "video_latents": self._video_latents,
            "vae_encoder_out": self.vae_encoder_out,
            "vae_enc_feat_map": self.vae_enc_feat_map,
            "vae_pending_body_frames": self.vae_pending_body_frames,
            "conditioning": [self.clip_feas, self.ys, self.language, self.prompt_embeds],
        }


class BespokeDreamZeroCache:
    """The bespoke per-session cache: an LRU dict capped at `MAX_DREAMZERO_SESSIONS` (not configurable)."""

    def __init__(self, max_sessions: int = MAX_DREAMZERO_SESSIONS):
        self.max_sessions = max_sessions
        self._states: OrderedDict[str, BespokeDreamZeroState] = OrderedDict()

    def get_or_create(self, session_id: str) -> BespokeDreamZeroState:
        state = self._states.get(session_id)
        if state is not None:
            self._states.move_to_end(session_id)
            return state
        state = BespokeDreamZeroState()
        self._states[session_id] = state
        if len(self._states) > self.max_sessions:
            self._states.popitem(last=False)
        return state

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._states
