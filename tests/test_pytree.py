"""Tests of `core/pytree.py`.

Regression (issue 24, wave 9): `pytree_dataclass` made a hidden "draft" class per decorated class (a
sibling built for `_replace`), so a user's ``Base.__subclasses__()`` and ``__init_subclass__`` hooks saw a
class nobody wrote. No class a user did not write may enter their hierarchy."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest

import functional_state as fs
from functional_state.core.pytree import pytree_dataclass


def _tree(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


def test_a_user_registry_sees_only_the_classes_the_user_wrote():
    seen: list[str] = []

    class Base:
        def __init_subclass__(cls, **kw):
            super().__init_subclass__(**kw)
            seen.append(cls.__name__)

    @pytree_dataclass(static=("tag",))
    class Point(Base):
        x: object
        tag: str

    p = Point(1, "a")._replace(x=2)
    assert type(p) is Point and (p.x, p.tag) == (2, "a")
    gc.collect()  # (dataclass(slots=True) rebuilds the class: the unslotted original is garbage)
    assert Base.__subclasses__() == [Point]
    # The hook runs for Point as declared and for its slotted rebuild (CPython's dataclass), never for another.
    assert set(seen) == {"Point"}


def test_a_user_state_object_enters_no_hidden_class_into_the_state_object_tree():
    class MyBase(fs.StateObject):
        __slots__ = ()

    @pytree_dataclass(static=("status", "recompute_source", "recompute_cost"))
    class Box(MyBase):
        value: object
        staged: object
        host_copy: object
        status: str
        recompute_source: str | None
        recompute_cost: float

        def _commit_payload(self, payload):
            return self._replace(value=payload)

        def _committed_view(self):
            return self.value

        def _view_with(self, payload):
            return payload

        def _allocated_storage(self):
            return {"value": None}

        def _released_storage(self):
            return {"value": None}

        def _committed_roots(self):
            return (self.value,)

        def _parkable_fields(self):
            return {"value": self.value}

    box = Box(None, None, None, "resident", None, 1.0).commit(np.ones(2))
    assert type(box) is Box
    with pytest.raises(dataclasses.FrozenInstanceError):
        box.value = None  # type: ignore[misc]
    gc.collect()
    assert MyBase.__subclasses__() == [Box]
    names = {c.__qualname__ for c in _tree(fs.StateObject)}
    assert not {n for n in names if "Draft" in n}, names
    for cls in (fs.LatentBuffer, fs.ArrayRing, fs.DenseValue):
        assert [c for c in fs.StateObject.__subclasses__() if c.__name__.endswith(cls.__name__ + "Draft")] == []


def test_the_library_ring_commit_stays_a_frozen_latent_buffer():
    buf = fs.LatentBuffer.create(maxlen=2)
    for i in range(3):
        buf = buf.commit(i)
    assert type(buf) is fs.LatentBuffer and buf.view() == (1, 2) and buf._acct_cache is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        buf.items = ()  # type: ignore[misc]


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
