"""Defects found by the wave-8 review (issue 24), each with the case that showed it."""

import numpy as np
import pytest

import functional_state as fs
from functional_state import SessionStateManager


def test_a_list_attr_grown_in_place_is_counted_at_the_sessions_next_attr_write():
    """The fast budget check once added only the values a write set: a list attr the model had grown in place
    (kept by identity) stayed at the bytes it was counted with, and the write was admitted over the budget."""
    m = SessionStateManager(byte_budget=8192)
    h = m.get_or_create_session("a")
    h.set_attr("frames", [np.zeros(256, np.float32)])  # 1 KiB in a list (a container: it may grow)
    h.set_attr("step", np.zeros(16, np.float32))  # the bound now holds that 1 KiB
    frames = h.get_attr("frames")
    for _ in range(8):
        frames.append(np.zeros(256, np.float32))  # 9 KiB in all now, in place
    assert m.stats(exact=True)["nbytes:cpu"] > 8192
    with pytest.raises(fs.BudgetExceededError):  # the session's own attrs are over: nothing to release
        h.set_attr("step2", np.zeros(16, np.float32))


def test_replace_runs_no_base_init():
    """`_replace` built a draft by calling it, which ran a base class's ``__init__`` on every copy (a mixin that
    counts, registers or validates); the generated replace promises never to re-run an ``__init__``."""
    from functional_state.core.pytree import pytree_dataclass

    calls = []

    class Mixin:
        def __init__(self):
            calls.append(1)

    @pytree_dataclass()
    class Point(Mixin):
        x: object
        y: object

    p = Point(1, 2)
    calls.clear()
    q = p._replace(x=3)
    assert type(q) is Point and (q.x, q.y) == (3, 2) and not calls


def test_a_base_hook_that_refuses_the_draft_class_leaves_the_decorator_working():
    """The draft class `pytree_dataclass` makes is a subclass of the class's bases: a base whose
    ``__init_subclass__`` checks what a subclass declares raised out of the decorator (only TypeError and
    AttributeError were taken as "no draft")."""
    from functional_state.core.pytree import pytree_dataclass

    class Kinded:
        def __init_subclass__(cls, **kw):
            super().__init_subclass__(**kw)
            if "kind" not in cls.__dict__:
                raise ValueError(f"{cls.__name__} must declare `kind`")

    @pytree_dataclass()
    class Frame(Kinded):
        kind = "frame"
        x: object

    q = Frame(1)._replace(x=2)
    assert type(q) is Frame and q.x == 2
