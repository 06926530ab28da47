"""Tests of `table/torch_writes.py`: forks stay snapshots under torch in-place writes.

Found by an adversarial review of issue 34. Each test names what broke; an ``xfail(strict=True)`` one is a
defect left open, with the reason it is not fixed here. (That review's hostile-checkpoint findings are in
test_checkpoint_hostile.py, its transfer-blob ones in test_transfer.py.)"""

from __future__ import annotations

import pytest
import torch

import functional_state as fs
from functional_state import ManagerState, SharedStorageWrittenError

# --- issue 35: a tampered transfer blob raises only TransferError (a CheckpointError) ---------------------------


# --- issue 34: a fork stays a snapshot under torch in-place writes ----------------------------------------------


def _forked(value: torch.Tensor | None = None, **table: int | bool) -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(**table), "p")  # type: ignore[arg-type]
    s = fs.put(s, "p", "kv", fs.PytreeValue.create({"k": torch.zeros(4) if value is None else value}))
    return fs.fork_session(s, "p", "c")


def test_a_shell_handles_get_refuses_an_object_a_sharer_wrote_in_place():
    # Found: `SessionHandle.view` checked, `SessionHandle.get` (the object, "an immutable snapshot") did not,
    # so `fork.get("kv").view()` served the parent's in-place write silently.
    m = fs.SessionStateManager()
    parent = m.get_or_create_session("p")
    parent.put("kv", fs.PytreeValue.create({"k": torch.zeros(4)}))
    fork = m.fork_session("p", "c")
    parent.view("kv")["k"][0] = 1.0  # in place, outside `writable`
    with pytest.raises(SharedStorageWrittenError, match="SessionHandle.get"):
        fork.get("kv")
    with pytest.raises(SharedStorageWrittenError, match="SessionHandle.view"):
        fork.view("kv")


def _drop_writer(s: ManagerState) -> ManagerState:
    return fs.drop_session(s, "p")[0]


def _replace_writers_object(s: ManagerState) -> ManagerState:
    return fs.put(s, "p", "kv", fs.PytreeValue.create({"k": torch.zeros(4)}))


def _remove_writers_object(s: ManagerState) -> ManagerState:
    return fs.update_session(s, "p", lambda session: session.remove("kv"))


def _evict_writer_by_admission(s: ManagerState) -> ManagerState:
    s, _ = fs.get_or_create(s, "c")  # (the fork most recent: admission evicts the writer)
    return fs.get_or_create(s, "x")[0]


@pytest.mark.parametrize(
    "release", [_drop_writer, _replace_writers_object, _remove_writers_object, _evict_writer_by_admission]
)
def test_a_fork_refuses_a_write_in_place_after_the_writer_released_its_holder(release):
    # Found: once the writer's holder left the table, the survivor accepted the write as its own.
    s = _forked(max_sessions=2, evict_when_full=True)
    fs.view(s, "p", "kv")["k"][0] = 1.0  # in place, outside `writable`
    s = release(s)
    with pytest.raises(SharedStorageWrittenError):
        got = fs.view(s, "c", "kv")["k"].tolist()
        assert got == [0.0] * 4, f"the fork serves the writer's write silently: {got}"


def test_a_write_in_place_to_a_storage_nobody_shared_when_written_stays_the_owners_own():
    # The release check remembers only storages written while shared: a fork dropped before the write, or an
    # object put over after a private write, leaves the owner's writes accepted.
    s = fs.drop_session(_forked(), "c")[0]
    k = fs.view(s, "p", "kv")["k"]
    k[0] = 1.0
    s = fs.put(s, "p", "kv", fs.PytreeValue.create({"k": k}))
    k[1] = 2.0
    s = fs.put(s, "p", "other", fs.PytreeValue.create({"k": torch.zeros(2)}))
    assert fs.view(s, "p", "kv")["k"].tolist() == [1.0, 2.0, 0.0, 0.0]


def test_a_write_in_place_under_inference_mode_never_reaches_the_fork():
    # Found: an inference-mode tensor keeps no version counter (recorded as -1), yet it can be written in place
    # inside `torch.inference_mode()`, so a write to a storage the fork shared was silent. The fork now holds
    # its own copy of each inference-mode storage (a view stays a view of the one copy).
    with torch.inference_mode():
        base = torch.zeros(6)
        s = _forked()
        s = fs.put(s, "p", "kv", fs.PytreeValue.create({"k": base[:4], "v": base[2:]}))
        s = fs.fork_session(s, "p", "c2")
        fs.view(s, "p", "kv")["k"][0] = 1.0
        fs.view(s, "p", "kv")["v"][3] = 5.0
        fork = fs.view(s, "c2", "kv")
        assert fork["k"].tolist() == [0.0] * 4, f"the fork serves the writer's write silently: {fork['k']}"
        assert fork["v"].tolist() == [0.0] * 4
        fork["k"][2] = 7.0  # the fork's two views share its one copy, as the source's share its storage
        assert fork["v"][0].item() == 7.0 and base[2].item() == 0.0
    assert fs.total_nbytes(s) >= 2 * base.nbytes


@pytest.mark.parametrize("check", ["view", "commit"])
def test_an_object_holding_an_inference_mode_tensor_still_refuses_a_write_to_its_other_shared_tensor(check):
    # The recorded versions are compared in one pass over the counters; an inference-mode tensor keeps none
    # (reading it raises), so that pass falls back to reading them one by one. A fallback that gave up on the
    # whole object would let this write reach the fork unseen.
    with torch.inference_mode():
        frozen = torch.zeros(4)
    live = torch.zeros(4)
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "kv", fs.PytreeValue.create({"a": frozen, "k": live}))
    s = fs.fork_session(s, "p", "c")  # shares `live` (the inference-mode storage is copied for the fork)
    live[0] = 1.0  # in place, outside `writable`
    with pytest.raises(SharedStorageWrittenError, match="'kv' of session 'p'"):
        if check == "view":
            fs.view(s, "p", "kv")
        else:
            fs.commit(s, "p", "kv", {"a": frozen, "k": torch.ones(4)})
    with pytest.raises(SharedStorageWrittenError, match="'kv' of session 'c'"):
        fs.view(s, "c", "kv")


def _through_data(k: torch.Tensor) -> None:
    k.data[0] = 1.0  # `.data` is a tensor with a version counter of its own


def _data_assigned(k: torch.Tensor) -> None:
    k.data = torch.ones(4)  # the tensor object both sessions hold now views other memory; no version bump


def _second_tensor_over_the_storage(k: torch.Tensor) -> None:
    torch.empty(0).set_(k.untyped_storage())[0] = 1.0  # another tensor object: its own counter


def _numpy_round_trip(k: torch.Tensor) -> None:
    torch.from_numpy(k.numpy())[0] = 1.0


@pytest.mark.xfail(
    strict=True,
    reason="open: the check reads the version counter of the tensor the table took in; a torch write through "
    "`.data`, `.data = ...`, or another tensor object over the same storage (`set_(untyped_storage())`, "
    "`from_numpy(t.numpy())`) bumps no counter it reads, so the fork changes silently. Inherent to version "
    "counters; would need a storage-level mark (or a digest) to detect.",
)
@pytest.mark.parametrize("write", [_through_data, _data_assigned, _second_tensor_over_the_storage, _numpy_round_trip])
def test_a_torch_write_that_bypasses_the_recorded_version_counter_is_refused(write):
    s = _forked()
    k = fs.view(s, "p", "kv")["k"]
    write(k)
    with pytest.raises(SharedStorageWrittenError):
        s = fs.commit(s, "p", "kv", {"k": k})
        got = fs.view(s, "c", "kv")["k"].tolist()
        assert got == [0.0] * 4, f"the fork serves the writer's write silently: {got}"


# --- issue 35: memory of a refused hostile load ------------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="open: `torch_writes` records and copies torch.Tensor leaves only; a JAX leaf the torch bridge "
    "imported (`to_jax`/`wrap`, as the cosmos3 adapter stores K/V) aliases its torch owner, which `to_torch` "
    "hands back writable. `writable` returns it uncopied ('JAX values: nothing writes them in place') and no "
    "version is recorded, so a write through the sanctioned path reaches the fork silently.",
)
def test_writable_copies_a_bridge_alias_so_a_write_through_to_torch_never_reaches_the_fork():
    from torch_bridge import to_jax, to_torch

    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "kv", fs.PytreeValue.create({"k": to_jax(torch.zeros(4))}))
    s = fs.fork_session(s, "p", "c")
    s, tree = fs.writable(s, "p", "kv")
    to_torch(tree["k"])[0] = 1.0  # in place, into what `writable` returned
    s = fs.commit(s, "p", "kv", tree)
    assert fs.view(s, "p", "kv")["k"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert fs.view(s, "c", "kv")["k"].tolist() == [0.0] * 4, "the fork serves the parent's write"


@pytest.mark.parametrize("reader", ["parent", "fork"])
def test_forks_loaded_from_a_checkpoint_still_refuse_a_write_in_place_to_the_storage_they_share(tmp_path, reader):
    # Found: a table saved with a fork loads its sessions sharing one torch storage (as saved), but the loaded
    # objects had no version record and each tensor its own counter (`set_` over the storage), so the parent's
    # in-place write reached the fork silently.
    s = _forked()
    fs.save(s, tmp_path / "ck")
    t = fs.load(tmp_path / "ck")
    fs.view(t, "p", "kv")["k"][0] = 1.0  # in place, outside `writable`
    with pytest.raises(SharedStorageWrittenError):
        if reader == "fork":
            got = fs.view(t, "c", "kv")["k"].tolist()
            assert got == [0.0] * 4, f"the loaded fork serves the parent's write silently: {got}"
        else:
            fs.commit(t, "p", "kv", {"k": fs.view(t, "p", "kv")["k"]})


# --- the per-step commit of one tensor: its record, found without flattening it -------------------------------


class _Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(1, 2, 1, 3),
        lambda: torch.nn.Parameter(torch.zeros(1, 2, 1, 3), requires_grad=False),
        lambda: torch.zeros(1, 2, 1, 3).as_subclass(_Tagged),
        lambda: torch.zeros(2, 2, 3)[1:].unsqueeze(2),  # a view, of a storage larger than itself
    ],
    ids=["tensor", "parameter", "subclass", "view"],
)
def test_one_tensor_committed_into_two_sessions_then_written_in_place_is_refused(make):
    # A bare tensor payload (a frame into a ring, one token's K/V) is its own only torch leaf: the record a
    # commit takes of it is what catches a later in-place write to the storage both sessions now hold.
    from functional_state.table.torch_versions import torch_leaves

    t = make()
    assert len(leaves := torch_leaves(t)) == 1 and leaves[0] is t
    m = fs.SessionStateManager()
    handles = [m.get_or_create_session(sid).put("ring", fs.LatentBuffer.create(maxlen=2)) for sid in ("a", "b")]
    for h in handles:  # (each ring made empty: no record before the commit, so only the payload's counts)
        h.commit("ring", t)
    t.add_(1.0)  # in place, outside `writable`
    for h in handles:
        with pytest.raises(SharedStorageWrittenError, match="'ring' of session"):
            h.get("ring")
