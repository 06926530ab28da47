"""`resolve_session_state_config`: the enable flag, the session cap and the byte budget.

The flag and the cap may be overridden from the environment; the byte budget is a config field only. The
spec keeps environment variables for the A/B switch and for stressing the cap in tests; the budget is the
knob a deployment sets in its config, so it gets no variable.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..errors import InvalidArgumentError
from ..memory.budget import normalize_budget
from ..table.manager_state import DEFAULT_MAX_SESSIONS

__all__ = ["ENV_ENABLE", "ENV_MAX_SESSIONS", "SessionStateConfig", "enable_override", "resolve_session_state_config"]

ENV_ENABLE = "OMNI_DIFFUSION_SESSION_STATE_MANAGER"
ENV_MAX_SESSIONS = "OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

logger = logging.getLogger(__name__)


def parse_bool(raw: str) -> bool | None:
    """`raw` as a boolean environment value ("1", "true", "yes", "on" and their opposites), or None if neither."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


class SessionStateConfig(NamedTuple):
    """The resolved session-state config."""

    enabled: bool
    max_sessions: int
    byte_budget: dict[str, int] | None  # {pool: bytes}; see `functional_state.memory.budget`


def resolve_session_state_config(
    enable: bool | None = None, max_sessions: int | None = None, byte_budget: Any = None
) -> SessionStateConfig:
    """Decide whether the manager-backed path is on, its session cap and its byte budget.

    A set, parsable environment variable overrides ``enable`` and ``max_sessions`` in both directions
    (``=0`` turns the manager off even when ``enable=True``): that is how an A/B run flips only the flag. An
    unparsable enable value is ignored (with a warning); an unparsable or non-positive cap logs a warning and
    is ignored. ``byte_budget`` has no environment variable: it is config only.

    Args:
      enable: the config value; None means off.
      max_sessions: the config cap; None means 64.
      byte_budget: bytes per pool, e.g. ``{"cuda:0": "40GiB"}`` or one size for every device pool; None for
        none (see `functional_state.memory.budget.normalize_budget`).

    Returns:
      ``SessionStateConfig(enabled, max_sessions, byte_budget)``, the budget normalized to ``{pool: bytes}``.

    Raises:
      InvalidArgumentError: ``max_sessions`` is not a positive int, or ``byte_budget`` is not a budget.

    Example:
      >>> import os
      >>> os.environ.pop(ENV_ENABLE, None); os.environ.pop(ENV_MAX_SESSIONS, None)
      >>> resolve_session_state_config(enable=True, byte_budget={"cuda:0": "40GiB"})
      SessionStateConfig(enabled=True, max_sessions=64, byte_budget={'cuda:0': 42949672960})
    """
    budget = normalize_budget(byte_budget, "resolve_session_state_config: byte_budget")
    if max_sessions is None:
        max_sessions = DEFAULT_MAX_SESSIONS
    elif isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions <= 0:
        raise InvalidArgumentError(
            f"`resolve_session_state_config`: max_sessions must be a positive int, got {max_sessions!r}."
        )
    enabled = bool(enable)

    raw = os.environ.get(ENV_ENABLE)
    if raw is not None:
        parsed = parse_bool(raw)
        if parsed is None:
            logger.warning(
                "%s=%r is not one of 1/0/true/false/yes/no/on/off; ignored (using enable=%s).", ENV_ENABLE, raw, enabled
            )
        else:
            enabled = parsed

    raw = os.environ.get(ENV_MAX_SESSIONS)
    if raw is not None:
        try:
            cap = int(raw.strip())
        except ValueError:
            cap = None
        if cap is None or cap <= 0:
            logger.warning("%s=%r is not a positive int; ignored (using %d).", ENV_MAX_SESSIONS, raw, max_sessions)
        else:
            max_sessions = cap
    return SessionStateConfig(enabled, max_sessions, budget)


@contextlib.contextmanager
def enable_override(enabled: bool) -> Iterator[None]:
    """Set ``OMNI_DIFFUSION_SESSION_STATE_MANAGER`` for the block and restore it afterwards.

    For in-process A/B comparisons and notebooks; the A/B proper runs fresh processes.

    Example:
      >>> with enable_override(True):
      ...     resolve_session_state_config(enable=False)[0]
      True
    """
    old = os.environ.get(ENV_ENABLE)
    os.environ[ENV_ENABLE] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_ENABLE, None)
        else:
            os.environ[ENV_ENABLE] = old
