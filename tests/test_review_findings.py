"""Findings of an adversarial review of issues 34 (forks stay snapshots under torch in-place writes) and 35
(hostile checkpoints and transfer blobs). Each test names what broke; an ``xfail(strict=True)`` one is a
defect left open, with the reason it is not fixed here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState
from functional_state.persist import manifest as manifest_module
from functional_state.transfer import export_session, import_session
from functional_state.transfer.blob import TRANSFER, SessionBlob

ROOT = Path(__file__).resolve().parents[1]


# --- issue 35: a tampered transfer blob raises only TransferError (a CheckpointError) ---------------------------


def _blob() -> SessionBlob:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    return export_session(fs.put(s, "a", "d", fs.DenseValue.create(np.zeros(4))), "a")


def _table_kind_without_sessions(m: dict) -> None:
    m.update(kind="table", sessions=[], leaves={})
    m[TRANSFER]["buffers"] = []
    m["table"] = {"max_sessions": 1, "byte_budget": None, "evict_when_full": True, "counters": [0] * 5}


def _table_kind_with_two_sessions(m: dict) -> None:
    m.update(kind="table", sessions=[m["sessions"][0], dict(m["sessions"][0], id="other")])
    m["table"] = {"max_sessions": 4, "byte_budget": None, "evict_when_full": True, "counters": [0] * 5}


def _buffer_keys_of_mixed_types(m: dict) -> None:
    m[TRANSFER]["buffers"] = [1, "leaf0"]


def _transfer_record_not_a_mapping(m: dict) -> None:
    m[TRANSFER] = [1]


@pytest.mark.parametrize(
    "edit",
    [
        _table_kind_without_sessions,
        _table_kind_with_two_sessions,
        _buffer_keys_of_mixed_types,
        _transfer_record_not_a_mapping,
    ],
)
def test_a_resealed_transfer_blob_is_refused_with_a_transfer_error_never_a_raw_one(edit):
    # Found: IndexError (a "table" blob of no sessions), TypeError (buffer keys sorted across types),
    # AssertionError (a transfer record that is not a mapping), and a "table" blob of two sessions imported
    # as its first (ambiguity accepted).
    blob = _blob()
    m = json.loads(blob.manifest_bytes())
    edit(m)
    manifest_module.seal(m)
    state = ManagerState.create()
    with pytest.raises(fs.TransferError):
        import_session(state, SessionBlob.from_parts(json.dumps(m).encode(), blob.buffers))
    assert len(state) == 0
