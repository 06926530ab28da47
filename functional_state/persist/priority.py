"""An asynchronous save's writes at a lower CPU priority than the model's threads (Linux, per thread)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

__all__ = ["BACKGROUND_NICE", "background_begin", "background_end", "lower_this_thread"]

_log = logging.getLogger("functional_state")

# An asynchronous save is meant to run beside the model. Its bytes are written by tensorstore's pool threads,
# and writing and syncing 600 MiB is ~1.5 s of kernel CPU on those threads: on a machine whose cores are all
# busy (the model's threads, other processes), each such thread takes an equal share from the model step
# (measured in benchmarks/bench_checkpoint.py, interleaved on 2 shared cores: a step beside the save 1.5-2.5x
# its time without one; beside a plain write + fsync of the same bytes on a thread of its own 1.3-1.9x; with
# the writers at nice 10 or 19, 0.99x). So while an asynchronous save is in flight, tensorstore's workers run
# at `BACKGROUND_NICE` (Linux: niceness is per thread), and get their priority back when the last one ends.
# The workers are a pool shared by the whole process: a synchronous save or a load during that time runs at
# that priority too (it only loses where other work wants the same cores). Where the process may not raise a
# thread's priority back (no root, CAP_SYS_NICE or RLIMIT_NICE), nothing is lowered: a pool left at low
# priority would slow every later load on a busy machine.
BACKGROUND_NICE = 10  # ~1/10 of a nice-0 thread's CPU share when both want one core; 19 (1/70) starves a save
# on a saturated machine for no measured gain

_WORKER = "ts_pool_worker"  # the name tensorstore gives its pool threads

_POLL_S = 0.025  # how soon a worker the pool starts during a save is lowered too

_NICE_LOCK = threading.Lock()

_in_flight = 0  # asynchronous saves holding the workers lowered (one watcher serves them all)

_watch_stop: threading.Event | None = None  # the watcher's, while any is in flight

_nice_before: dict[int, int] = {}  # worker thread id -> its niceness before it was lowered

_normal = [0]  # the niceness of the thread that began the first save in flight: what a new worker gets back


def _can_restore() -> bool:
    """Whether this process can lower a thread's niceness again after raising it (tried on a thread of its own)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "setpriority") and os.path.isdir("/proc/self/task")):
        return False
    if _CAN_RESTORE:
        return _CAN_RESTORE[0]
    result = [False]

    def attempt() -> None:
        tid = threading.get_native_id()
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            if before >= BACKGROUND_NICE:
                return  # the process runs at low priority already: nothing to lower
            os.setpriority(os.PRIO_PROCESS, tid, before + 1)
            os.setpriority(os.PRIO_PROCESS, tid, before)
            result[0] = True
        except OSError:
            pass

    thread = threading.Thread(target=attempt, name="functional_state nice check")
    thread.start()
    thread.join()
    _CAN_RESTORE.append(result[0])
    if not result[0]:
        _log.debug("asynchronous saves write at normal priority: this process cannot raise a thread's back")
    return result[0]


_CAN_RESTORE: list[bool] = []


def _workers() -> dict[int, int]:
    """``{thread id: niceness}`` of this process's tensorstore pool workers."""
    found = {}
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/comm") as f:
                if f.read().strip() != _WORKER:
                    continue
            found[int(name)] = os.getpriority(os.PRIO_PROCESS, int(name))
        except OSError:  # the thread ended
            continue
    return found


def _new_workers() -> dict[int, int]:
    """`_workers`, less the threads already lowered and those twice seen not to be workers (`_looked`): the
    watcher runs beside the model every `_POLL_S`, and reading every thread's name each time (a process with
    torch, JAX and tensorstore runs dozens) took the interpreter from the model's step for no new answer. A
    thread is looked at twice, a poll apart, because a new thread is named by itself after it starts."""
    found = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in _nice_before or _looked.get(tid, 0) >= 2:
            continue
        try:
            with open(f"/proc/self/task/{name}/comm") as f:
                if f.read().strip() != _WORKER:
                    _looked[tid] = _looked.get(tid, 0) + 1
                    continue
            found[tid] = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:  # the thread ended
            continue
    return found


_looked: dict[int, int] = {}  # thread id -> how often `_new_workers` found it not a worker, this stretch of saves


def _lower_workers(normal: int) -> None:
    for tid, nice in _new_workers().items():
        if tid in _nice_before or nice >= BACKGROUND_NICE:
            # (a worker started by a lowered one inherits its niceness: it gets the process's normal one back)
            _nice_before.setdefault(tid, normal)
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
            _nice_before[tid] = nice
        except OSError:
            continue


def _watch(stop: threading.Event) -> None:
    """Lower the workers the pool starts while asynchronous saves are in flight, every `_POLL_S`."""
    while not stop.wait(_POLL_S):
        with _NICE_LOCK:
            if stop.is_set():
                return
            _lower_workers(_normal[0])


def background_begin() -> bool:
    """Lower tensorstore's workers for an asynchronous save (and keep lowering the ones the pool starts until
    `background_end`); False where nothing was lowered."""
    global _in_flight, _watch_stop
    if not _can_restore():
        return False
    with _NICE_LOCK:
        if not _in_flight:
            _normal[:] = [os.getpriority(os.PRIO_PROCESS, threading.get_native_id())]
            _watch_stop = threading.Event()
            threading.Thread(
                target=_watch, args=(_watch_stop,), name="functional_state save priority", daemon=True
            ).start()
        _in_flight += 1
        _lower_workers(_normal[0])
    return True


def background_end() -> None:
    """One asynchronous save less in flight; the last one gives the workers their priority back."""
    global _in_flight, _watch_stop
    with _NICE_LOCK:
        _in_flight = max(0, _in_flight - 1)
        if _in_flight:
            return
        if _watch_stop is not None:
            _watch_stop.set()
            _watch_stop = None
        # Every worker at the lowered niceness: also one the pool started from a lowered worker after the
        # last poll (it inherited it).
        for tid, nice in _workers().items():
            if nice == BACKGROUND_NICE:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, tid, _nice_before.get(tid, _normal[0]))
        _nice_before.clear()
        _looked.clear()


def lower_this_thread() -> None:
    """Run the calling thread, one of a save's own that ends with it, at `BACKGROUND_NICE` (Linux; threads it
    starts inherit it). Raising a thread's niceness needs no privilege, and nothing gives it back: the thread
    ends with the work it was started for."""
    if sys.platform.startswith("linux") and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
