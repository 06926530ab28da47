"""Moved to `functional_state.shell.config`; this path stays because users and notebooks import it."""

from .shell.config import (
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    SessionStateConfig,
    enable_override,
    parse_bool,
    resolve_session_state_config,
)

__all__ = [
    "ENV_ENABLE",
    "ENV_MAX_SESSIONS",
    "SessionStateConfig",
    "enable_override",
    "parse_bool",
    "resolve_session_state_config",
]
