"""An asynchronous save writes at a lower CPU priority than the model (persist/priority.py): tensorstore's pool
workers, which write and sync its bytes, run at `BACKGROUND_NICE` while it is in flight and get their priority
back when the last one ends (issue 24: a model step beside an asynchronous save took 1.5x its time without
one, on a machine with every core busy; the writers took an equal share of a core from the model)."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState
from functional_state.persist import store as store_module

LOWERED = (
    10  # what the fix lowers them to (persist.priority.BACKGROUND_NICE); a literal, so the test runs anywhere
)


def _can_restore_priority() -> bool:
    """Whether this process may give a thread its priority back after lowering it (root, CAP_SYS_NICE,
    RLIMIT_NICE); where it may not, saves are documented to leave priorities alone."""
    if not (sys.platform.startswith("linux") and os.path.isdir("/proc/self/task")):
        return False
    result = [False]

    def attempt() -> None:
        tid = threading.get_native_id()
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, before + 1)
            os.setpriority(os.PRIO_PROCESS, tid, before)
            result[0] = before < LOWERED
        except OSError:
            pass

    t = threading.Thread(target=attempt)
    t.start()
    t.join()
    return result[0]


pytestmark = pytest.mark.skipif(not _can_restore_priority(), reason="needs Linux and the right to raise priority")


def _workers() -> dict[int, int]:
    """``{thread id: niceness}`` of tensorstore's pool threads in this process."""
    out = {}
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/comm") as f:
                if f.read().strip() == "ts_pool_worker":
                    out[int(name)] = os.getpriority(os.PRIO_PROCESS, int(name))
        except OSError:
            continue
    return out


def _state() -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    return fs.put(s, "a", "v", fs.DenseValue.create(np.arange(1 << 16, dtype=np.float32)))


@pytest.fixture
def held(monkeypatch):
    """Asynchronous saves held in flight until their event is set (their writes are done; the handle waits)."""
    gates: list[threading.Event] = []
    original = store_module.orbax_manager

    def gated(*args, **kwargs):
        manager = original(*args, **kwargs)
        if not args[2].enable_async_checkpointing:  # (orbax_manager(ocp, root, options)): not held
            return manager
        gate = threading.Event()
        gates.append(gate)
        wait = manager.wait_until_finished

        def wait_until_finished():
            if threading.current_thread().name.startswith("functional_state save "):  # the handle's wait
                gate.wait(30)
            return wait()

        manager.wait_until_finished = wait_until_finished
        return manager

    monkeypatch.setattr(store_module, "orbax_manager", gated)
    yield gates
    for gate in gates:
        gate.set()


def _until(condition, timeout: float = 15.0) -> bool:  # (generous: CI machines are loaded)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_an_asynchronous_save_writes_at_lowered_priority_and_gives_it_back(tmp_path, held):
    s = _state()
    fs.save_session(s, "a", tmp_path / "warm")  # (tensorstore's pool has its workers now)
    before = _workers()
    assert before and all(n < LOWERED for n in before.values())
    handle = fs.save_session(s, "a", tmp_path / "ck", asynchronous=True)
    # Before: the workers wrote at the model's priority, taking an equal share of a busy core from it.
    assert _until(lambda: all(n == LOWERED for n in _workers().values())), _workers()
    assert not handle.done()
    held[0].set()
    handle.wait()
    after = _workers()
    assert {tid: after[tid] for tid in before if tid in after} == {tid: before[tid] for tid in before if tid in after}
    assert all(n < LOWERED for n in after.values())
    assert np.array_equal(
        fs.view(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v"), fs.view(s, "a", "v")
    )


def test_priority_comes_back_only_when_the_last_asynchronous_save_ends(tmp_path, held):
    s = _state()
    first = fs.save_session(s, "a", tmp_path / "one", asynchronous=True)
    second = fs.save_session(s, "a", tmp_path / "two", asynchronous=True)
    assert _until(lambda: bool(_workers()) and all(n == LOWERED for n in _workers().values()))
    held[0].set()
    first.wait()
    # The second is still writing (a worker the pool started since the last poll is lowered by the next).
    assert _until(lambda: all(n == LOWERED for n in _workers().values()))
    held[1].set()
    second.wait()
    assert all(n < LOWERED for n in _workers().values())


def test_a_synchronous_save_writes_at_normal_priority(tmp_path, monkeypatch):
    from orbax.checkpoint._src.serialization import type_handlers

    from functional_state.persist import handlers

    seen: list[dict[int, int]] = []
    # (the handler that writes byte leaves: `ByteLeaves`, or orbax's own where orbax is too old)
    handler = handlers._types()[0] if handlers.supported() else type_handlers.NumpyHandler
    original = handler._open_and_write

    async def spy(self, value, tspec, ts_context):
        seen.append(_workers())
        return await original(self, value, tspec, ts_context)

    monkeypatch.setattr(handler, "_open_and_write", spy)
    fs.save_session(_state(), "a", tmp_path / "ck")
    assert seen and all(n < LOWERED for workers in seen for n in workers.values())


def test_the_watcher_reads_each_threads_name_at_most_twice_while_saves_are_in_flight(tmp_path, held, monkeypatch):
    """Regression: every poll (each `_POLL_S`, beside the model) read the name of every thread of the process,
    ~0.7 ms of the interpreter per poll in a process with torch, JAX and tensorstore, for no new answer."""
    import builtins
    from collections import Counter

    from functional_state.persist import priority

    reads: list[str] = []

    def counting_open(path, *args, **kwargs):
        reads.append(str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(priority, "open", counting_open, raising=False)
    handle = fs.save_session(_state(), "a", tmp_path / "ck", asynchronous=True)
    time.sleep(20 * priority._POLL_S)  # twenty polls while the save is held in flight
    per_thread = Counter(path for path in reads if path.endswith("/comm"))
    held[0].set()
    handle.wait()
    assert per_thread and max(per_thread.values()) <= 2
    assert _until(lambda: all(n < LOWERED for n in _workers().values()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread niceness is Linux's")
@pytest.mark.parametrize("asynchronous", [True, False])
def test_an_asynchronous_saves_checksums_run_lowered_and_a_synchronous_saves_do_not(
    tmp_path, monkeypatch, asynchronous
):
    """Issue 39: an asynchronous save's checksums moved off the caller's thread onto the save's own, which runs
    at the writes' lowered priority (it ends with the work: nothing to give back); a synchronous save, which
    its caller waits for, hashes at full priority. Seen failing without `lower_this_thread` (niceness 0)."""
    from functional_state.persist import encode as encode_module

    seen: list[int] = []
    original = encode_module.checksum

    def recording(*args, **kwargs):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return original(*args, **kwargs)

    monkeypatch.setattr(encode_module, "checksum", recording)
    normal = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.set_attr(s, "a", "x", np.arange(1 << 10))
    fs.save_session(s, "a", tmp_path / "ck", asynchronous=asynchronous).wait()
    assert seen and all(n == (max(LOWERED, normal) if asynchronous else normal) for n in seen)
