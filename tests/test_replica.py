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
