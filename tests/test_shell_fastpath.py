"""The shell's lock-free reads and one-step installs against a table `load` replaced meanwhile (issue 24).

A loaded table numbers its incarnations from 0 again, so a session of the loaded table may carry the very
incarnation number a handle's old incarnation had. A handle that asked whether its cell left *before*
reading the table (the order the lock-free paths had) could then read the table a `load` installed in
between and take the loaded session for its own: `get_or_create` returned the loaded object, `held` did
not refuse, `in_table` said True, `state` was the loaded session, and `put_absent` put a factory's object
into the loaded session (a write through a handle whose session was dropped, which must be refused). Each
interleaving here is made deterministic by running the `load` at the exact
moment the handle reads the table (or from inside the factory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state import table as ms
from functional_state.shell.slot import Slot

_TABLE = Slot.__dict__["table"]  # the slot's own storage of its installed table


def _load_on_read(m: SessionStateManager, load: Any) -> list[bool]:
    """Make the next read of the manager's installed table run ``load()`` first (a `load` installed between
    a handle's other checks and its read of the table); returns a flag set once it ran."""
    fired: list[bool] = []

    class LoadOnRead(Slot):
        __slots__ = ()

        @property  # type: ignore[override]
        def table(self) -> Any:
            if not fired:
                fired.append(True)
                load()
            return _TABLE.__get__(self)

        @table.setter
        def table(self, value: Any) -> None:
            _TABLE.__set__(self, value)

    m._slot.__class__ = LoadOnRead
    return fired


def _saved_then_advanced(tmp_path: Path) -> tuple[SessionStateManager, fs.SessionHandle, Any]:
    """A manager whose table was saved with "a" holding x = (1.0,), then "a" advanced to x = (1.0, 2.0);
    returns ``(manager, handle on "a", load)``: ``load()`` puts the saved table back."""
    m = SessionStateManager(max_sessions=4)
    h = m.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", 1.0)
    path = tmp_path / "ckpt"
    m.save(path)
    h.commit("x", 2.0)
    assert ms.incarnation_of(m.state, "a") == 0  # (the loaded "a" has it too: the collision under test)
    return m, h, lambda: m.load(path)


def test_get_or_create_never_returns_the_object_of_a_table_loaded_meanwhile(tmp_path: Path) -> None:
    m, h, load = _saved_then_advanced(tmp_path)
    fired = _load_on_read(m, load)
    obj = h.get_or_create("x", lambda: LatentBuffer.create(maxlen=2))
    assert fired and not h.in_table
    assert obj.view() == (1.0, 2.0)  # the handle's own incarnation (its copy), not the loaded (1.0,)
    assert m.get_or_create_session("a").view("x") == (1.0,)


def test_held_refuses_once_a_load_replaced_the_table_meanwhile(tmp_path: Path) -> None:
    m, h, load = _saved_then_advanced(tmp_path)
    fired = _load_on_read(m, load)
    with pytest.raises(fs.SessionStateLostError, match="replaced by `load`"):
        h.held("x")
    assert fired


@pytest.mark.parametrize("read", ["in_table", "state"])
def test_a_handle_never_reads_a_table_loaded_meanwhile_as_its_own(tmp_path: Path, read: str) -> None:
    m, h, load = _saved_then_advanced(tmp_path)
    fired = _load_on_read(m, load)
    if read == "in_table":
        assert h.in_table is False
    else:
        assert h.state.get("x").view() == (1.0, 2.0)
    assert fired


def test_a_factory_object_never_lands_in_a_session_loaded_while_it_ran(tmp_path: Path) -> None:
    m, h, load = _saved_then_advanced(tmp_path)

    def factory() -> LatentBuffer:
        load()  # the table is replaced while the factory runs (outside the lock)
        return LatentBuffer.create(maxlen=3)

    with pytest.raises(fs.SessionStateLostError, match="replaced by `load`"):
        h.get_or_create("y", factory)  # a write through a handle whose session was dropped: refused
    assert not h.in_table and "y" not in h.state.objects
    assert "y" not in m.get_or_create_session("a").state.objects  # the loaded session is as saved
