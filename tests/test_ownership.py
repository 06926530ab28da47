"""Ownership epochs (`table.ownership`) and the save fence (`persist.fencing`): a claim raises the epoch, a
superseded owner's save is refused, and a checkpoint never goes back to a lower epoch."""

from __future__ import annotations

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState, StaleEpochError
from functional_state.persist.info import checkpoint_info
from functional_state.table.ownership import claim, epoch_of, model_of
from helpers import assert_unchanged, snapshot


def _session(step: int) -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "x", fs.DenseValue.create([np.full(4, step, np.float32)]))
    return fs.set_attr(s, "a", "step", step)


def test_a_claim_raises_the_epoch_past_its_own_and_the_callers_and_is_pure():
    s = _session(0)
    snap = snapshot(s)
    t = claim(s, "a", model="wm@1")
    assert_unchanged(s, snap)
    assert (epoch_of(s, "a"), epoch_of(t, "a"), model_of(t, "a"), model_of(s, "a")) == (0, 1, "wm@1", None)
    assert epoch_of(claim(t, "a"), "a") == 2
    assert epoch_of(claim(t, "a", above=9), "a") == 10
    assert epoch_of(claim(claim(t, "a", above=9), "a", above=3), "a") == 11  # never down
    with pytest.raises(fs.InvalidArgumentError, match="above must be an epoch"):
        claim(t, "a", above=-1)
    with pytest.raises(fs.SessionStateLostError):
        claim(t, "nobody")


def test_a_stale_owner_cannot_roll_a_checkpoint_back(tmp_path):
    """The issue's rollback: a slow replica that still believed it owned the session saved after the new owner
    did, and the checkpoint went back from step 16 to step 11. Now the stale save is refused."""
    path = tmp_path / "a"
    old = claim(_session(11), "a")  # epoch 1: the first owner, at step 11
    fs.save_session(old, "a", path)
    new = claim(fs.set_attr(old, "a", "step", 16), "a")  # the new owner claims (epoch 2) and saves step 16
    fs.save_session(new, "a", path)
    with pytest.raises(StaleEpochError, match="holds session 'a' at epoch 2, and this save is of epoch 1"):
        fs.save_session(old, "a", path)
    with pytest.raises(StaleEpochError):
        fs.save_session(old, "a", path, asynchronous=True)
    info = checkpoint_info(path).sessions["a"]
    assert (info.epoch, info.attrs["step"]) == (2, 16)
    t = fs.load_session(ManagerState.create(), "a", path)
    assert fs.get_attr(t, "a", "step") == 16 and epoch_of(t, "a") == 2
    fs.save_session(claim(t, "a"), "a", path)  # the owner at a higher epoch saves as ever
    assert checkpoint_info(path).sessions["a"].epoch == 3


def test_sessions_never_claimed_save_as_before(tmp_path):
    fs.save_session(_session(1), "a", tmp_path / "a")
    fs.save_session(_session(2), "a", tmp_path / "a")
    assert checkpoint_info(tmp_path / "a").sessions["a"].attrs == {"step": 2}
