"""What a mistaken attribute of `SessionStateManager` is told: the verbs of one session live on its handle.

``manager.commit(...)`` was a bare ``AttributeError``; the per-session verbs (`commit`, `stage`, `view`,
`put`, ...) are methods of the `SessionHandle` that ``manager.get_or_create_session(sid)`` returns, and the pure
functions of the same names take a `ManagerState`.
"""

from __future__ import annotations

import difflib

from .. import table as verbs
from .handle import SessionHandle

__all__ = ["manager_attribute_error"]


def manager_attribute_error(owner: object, name: str) -> AttributeError:
    """The `AttributeError` for ``owner.name``: it names the handle's method, or the nearest attributes.

    Example:
      >>> print(manager_attribute_error(object(), "commit"))  # doctest: +ELLIPSIS
      `SessionStateManager` has no `commit`: ... `manager.get_or_create_session(sid).commit(...)` ...
    """
    if not name.startswith("_") and callable(getattr(SessionHandle, name, None)):
        pure = f", or the pure `functional_state.{name}(manager.state, sid, ...)`" if name in verbs.__all__ else ""
        return AttributeError(
            f"`SessionStateManager` has no `{name}`: the verbs of one session are methods of its handle. Call "
            f"`manager.get_or_create_session(sid).{name}(...)` (or `manager.get_session(sid)` for a session "
            f"that must exist already){pure}."
        )
    public = [n for n in dir(type(owner)) if not n.startswith("_")]
    near = difflib.get_close_matches(name, public, n=3)
    hint = f" Did you mean {', '.join(f'`{n}`' for n in near)}?" if near else ""
    return AttributeError(f"`{type(owner).__name__}` has no attribute `{name}`.{hint}")
