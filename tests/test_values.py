"""Tests of `memory/values.py`.

One set of values that hold no array buffer (issue 24, budget9): `values.NO_BUFFER_TYPES`, read by the
accounting's walk, the ledger's attr index and the shell's budget check alike. Python's own byte buffers
(``bytes``, ``bytearray``) are memory but not array memory: the walk counts them zero, so the index keeps
none of them (it once re-read a ``bytearray`` attr on every question, as a container) and the budget check
never reads them (it once read all but five scalar types on every write). (A ``memoryview`` counts what it
exports since the wave-9 review: tests/test_accounting.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state.memory import accounting
from functional_state.memory.values import NO_BUFFER_TYPES, fixed, holds_no_buffer, mutable
from functional_state.shell import admission
from functional_state.table.manager_state import ledger_of

SAMPLES: dict[type, Any] = {
    int: 7,
    float: 1.5,
    complex: 2j,
    bool: True,
    str: "prompt",
    bytes: b"\0" * 4096,
    bytearray: bytearray(4096),
    type(None): None,
    range: range(10),
    slice: slice(1, 2),
}


def test_the_samples_cover_every_type_of_the_set() -> None:
    assert set(SAMPLES) == NO_BUFFER_TYPES


@pytest.mark.parametrize("kind", sorted(SAMPLES, key=lambda t: t.__name__), ids=lambda t: t.__name__)
def test_a_value_that_holds_no_buffer_counts_zero_everywhere_and_is_not_kept(kind: type) -> None:
    value = SAMPLES[kind]
    assert holds_no_buffer(value) and fixed(value) and not mutable(value)
    assert accounting.nbytes_by_device([value]) == {}
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    state = fs.set_attr(state, "a", "v", value)
    index = ledger_of(state).attrs
    assert not index.memo and index.n_open == 0  # nothing to re-read on any holder question
    assert fs.stats(state) == fs.stats(state, exact=True)


@pytest.mark.parametrize("kind", sorted(SAMPLES, key=lambda t: t.__name__), ids=lambda t: t.__name__)
def test_the_budget_check_never_reads_a_value_that_holds_no_buffer(kind: type, monkeypatch: pytest.MonkeyPatch) -> None:
    m = SessionStateManager(byte_budget=1 << 20)
    h = m.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=2))
    h.commit("buf", np.zeros(4))  # (the first budgeted write checks in full)
    reads: list[Any] = []
    real = admission.attr_bytes
    monkeypatch.setattr(admission, "attr_bytes", lambda attrs: reads.append(dict(attrs)) or real(attrs))
    h.set_attr("v", SAMPLES[kind])
    h.commit("buf", np.zeros(4))
    assert reads == []


def test_a_bytearray_grown_in_place_changes_no_figure() -> None:
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    buf = bytearray(16)
    state = fs.set_attr(state, "a", "raw", buf)
    before = fs.stats(state)
    buf.extend(bytes(1 << 16))
    assert fs.stats(state) == before == fs.stats(state, exact=True)


def test_a_numpy_view_of_a_foreign_byte_buffer_is_counted_and_fixed() -> None:
    raw = bytearray(4096)
    view = np.frombuffer(raw, np.uint8)
    assert fixed(view) and accounting.nbytes_by_device([view]) == {"cpu": 4096}
