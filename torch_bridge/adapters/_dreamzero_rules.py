"""DreamZero rules shared by the bespoke state and the adapter: frame windows and reset decisions.

These are pure functions of values, so both paths decide identically; what the A/B check compares is
where and how each path keeps its state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from functional_state import InvalidArgumentError

FRAMES_PER_CHUNK = 4  # stitched frames the encoder consumes per latent frame
MAX_DREAMZERO_SESSIONS = 64  # the bespoke session cache's fixed cap


def split_frames(stitched: Any) -> list[Any]:
    """``(H, W, C)`` -> one frame; ``(T, H, W, C)`` -> T frames (views, not copies)."""
    ndim = getattr(stitched, "ndim", None)
    if ndim == 3:
        return [stitched]
    if ndim == 4:
        return [stitched[i] for i in range(stitched.shape[0])]
    raise InvalidArgumentError(
        f"`accumulate_frames`: expected a stitched frame (H, W, C) or a clip (T, H, W, C), got shape "
        f"{tuple(getattr(stitched, 'shape', ()))} ({ndim} dims)."
    )


def window_frames(frames: Sequence[Any], first_call: bool) -> Any:
    """Stack the model's input window: the newest frame alone on the first call, else
    `FRAMES_PER_CHUNK` frames, padded at the front by repeating the oldest."""
    if first_call:
        chosen = [frames[-1]]
    else:
        chosen = list(frames[-FRAMES_PER_CHUNK:])
        chosen = [chosen[0]] * (FRAMES_PER_CHUNK - len(chosen)) + chosen
    if isinstance(chosen[0], torch.Tensor):
        return torch.stack(chosen)
    return np.stack(chosen)


def check_video_out(video_out: Any) -> None:
    if not isinstance(video_out, torch.Tensor) or video_out.ndim != 5:
        raise InvalidArgumentError(
            f"`append_video_latents`: expected a torch tensor (B, T, C, H, W), got "
            f"{type(video_out).__name__} of shape {tuple(getattr(video_out, 'shape', ()))}."
        )


def check_encoder_chunk(chunk: Any, what: str) -> None:
    if not isinstance(chunk, torch.Tensor) or chunk.ndim != 5:
        raise InvalidArgumentError(
            f"`{what}`: expected a torch tensor (B, C, T, H, W) of encoder output, got "
            f"{type(chunk).__name__} of shape {tuple(getattr(chunk, 'shape', ()))}."
        )


def check_num_frames(num_frames: Any) -> int:
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames <= 0:
        raise InvalidArgumentError(f"`observation_latents`: num_frames must be a positive int, got {num_frames!r}.")
    return num_frames


def same_tokens(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def reset_reason(
    language: Any, current_start_frame: int, text_tokens: Any, num_video_frames: int, local_attn_size: int
) -> str | None:
    """Which reset the next call needs, by four rules checked in order:

    1. nothing is conditioned yet (``language`` is None) -> ``"session"``;
    2. the prompt changed (``text_tokens`` differ from ``language`` in shape, dtype or value) -> ``"session"``;
    3. the local attention window would overflow (``local_attn_size > 0`` and
       ``current_start_frame + num_video_frames > local_attn_size``) -> ``"inference"``;
    4. otherwise -> None.
    """
    if language is None:
        return "session"
    if not same_tokens(language, text_tokens):
        return "session"
    if local_attn_size > 0 and current_start_frame + num_video_frames > local_attn_size:
        return "inference"
    return None


class ResetRules:
    """The reset-decision methods both DreamZero state classes expose, from their ``language``,
    ``current_start_frame`` and ``reset``."""

    language: Any
    current_start_frame: int

    def reset(self, clear_video_latents: bool = True) -> None:  # provided by the state class
        raise NotImplementedError

    def reset_inference_state(self) -> None:
        """A window reset: ``reset(clear_video_latents=False)``."""
        self.reset(clear_video_latents=False)

    def reset_reason(self, text_tokens: Any, num_video_frames: int, local_attn_size: int) -> str | None:
        """``"session"``, ``"inference"`` or None (see `reset_reason` for the four rules)."""
        return reset_reason(self.language, self.current_start_frame, text_tokens, num_video_frames, local_attn_size)

    def should_reset(self, text_tokens: Any, num_video_frames: int, local_attn_size: int) -> bool:
        return self.reset_reason(text_tokens, num_video_frames, local_attn_size) is not None
