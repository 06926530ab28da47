"""`SessionReplica` in-process (no Ray): the epoch-fenced verbs, a move between two replicas, and an import the
budget cannot take refused with both replicas unchanged (`SessionStateManager.install_session`)."""

from __future__ import annotations

import pytest
import serving_model as model

import functional_state as fs
from functional_state import StaleEpochError
from functional_state.serving import SessionReplica


def _replica(name: str, **kw) -> SessionReplica:
    return SessionReplica(name, model="wm@1", step=model.step, init=model.init, **kw)


def test_a_move_carries_every_step_and_fences_the_source():
    a, b = _replica("a"), _replica("b")
    epoch = a.open("s")
    outs = [a.step("s", epoch, t) for t in range(3)]
    new = b.accept(*a.export("s", epoch), epoch)
    assert new == epoch + 1 and a.release("s", epoch) and "s" not in a.manager
    outs.append(b.step("s", new, 3))
    ref = _replica("ref")
    e = ref.open("s")
    assert outs == [ref.step("s", e, t) for t in range(4)] and b.steps("s") == 4
    with pytest.raises(StaleEpochError, match="b: step"):
        b.step("s", epoch, 4)
    assert b.placement().sessions["s"].epoch == new


def test_an_import_over_the_targets_budget_is_refused_and_nothing_moves():
    a, b = _replica("a"), _replica("b", byte_budget="512 KiB", release_levers=("evict",))  # (nothing evictable)
    epoch = a.open("s")
    a.step("s", epoch, 0)
    a.step("s", epoch, 1)  # 768 KiB: more than b may hold
    with pytest.raises(fs.BudgetExceededError):
        b.accept(*a.export("s", epoch), epoch)
    assert "s" not in b.manager and len(b.manager) == 0 and a.steps("s") == 2


def test_the_serving_package_imports_without_ray_and_names_it_on_the_router():
    # Regression: the Serve router's module (it subclasses Ray Serve's `RequestRouter`) was imported by the
    # package, so `SessionReplica` could not be imported where Ray is not installed (the newest-JAX CI leg).
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from functional_state.serving import SessionReplica, choose\n"
        "try:\n"
        "    from functional_state.serving import SessionAffinityRouter\n"
        "except ImportError as e:\n"
        "    print('refused:', type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused: ModuleNotFoundError"


class _InProcessPeers:
    """`Peers` over replicas in this process (what `ActorPeers` does over Ray actors)."""

    def __init__(self, *replicas: SessionReplica):
        self.replicas = {r.name: r for r in replicas}

    def figures(self):
        return {n: r.placement() for n, r in self.replicas.items()}

    def accept(self, peer, sid, manifest, buffers, epoch):
        return self.replicas[peer].accept(manifest, buffers, epoch, expect=sid)


def _pressed(a: SessionReplica) -> int:
    """s1 (768 KiB) and s2 (768 KiB) on ``a``, then s3 opened: over a 1.6 MiB budget, s1 must go."""
    e1 = a.open("s1")
    for t in range(2):
        a.step("s1", e1, t)
    e2 = a.open("s2")
    for t in range(2):
        a.step("s2", e2, t)
    a.open("s3")
    return e1


def test_a_replica_over_budget_spills_a_session_to_a_peer_with_headroom_instead_of_dropping_it():
    a = _replica("a", byte_budget="1600 KiB", release_levers=("drop",), spill=True, spill_store=None)
    b, full = _replica("b"), _replica("full", byte_budget="256 KiB")
    full.open("x")  # (its 256 KiB budget is full)
    a.connect(_InProcessPeers(a, b, full))  # (itself skipped; "full" has no room for s1)
    e1 = _pressed(a)
    went = a.where("s1")
    assert went is not None and (went.to, went.epoch) == ("b", e1 + 1)
    assert set(a.manager.state.session_ids) == {"s2", "s3"} and a.manager.stats()["evictions"] == 0
    with pytest.raises(StaleEpochError, match="spilled under budget pressure to 'b'"):
        a.step("s1", e1, 2)
    ref = _replica("ref")
    e = ref.open("s1")
    assert b.step("s1", went.epoch, 2) == [ref.step("s1", e, t) for t in range(3)][-1]  # the same rollout
    assert b.steps("s1") == 3


def test_a_session_no_peer_fits_goes_to_the_store_and_without_one_stays_unless_nothing_else_can_go():
    stored = []
    a = _replica(
        "a",
        byte_budget="1600 KiB",
        release_levers=("drop",),
        spill=True,
        spill_store=lambda m, b: stored.append(m) or ("m", "b"),
    )
    full = _replica("full", byte_budget="256 KiB")
    full.open("x")
    a.connect(_InProcessPeers(full))
    e1 = _pressed(a)
    went = a.where("s1")
    assert went is not None and (went.to, went.epoch, went.parts) == ("object store", e1, ("m", "b")) and stored
    assert a.manager.stats()["evictions"] == 0
    # No peer, no store: the spill declines, and the budget drops the session only as a last resort.
    lone = _replica("lone", byte_budget="1600 KiB", release_levers=("drop",), spill=True, spill_store=None)
    _pressed(lone)
    assert lone.where("s1") is None and lone.manager.stats()["evictions"] == 1
