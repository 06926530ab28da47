"""`functional_state.equinox.SessionStates` with a real Equinox stateful model, and eqx State attrs on fork
(issue 21)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from helpers import assert_unchanged, snapshot

eqx = pytest.importorskip("equinox")
from functional_state.equinox import SessionStates  # noqa: E402

D = 8
TRACES = {"n": 0}


class Cell(eqx.Module):
    """A recurrent cell whose hidden state and step count live in an `eqx.nn.State`."""

    lin: eqx.nn.Linear
    out: eqx.nn.Linear
    hidden: eqx.nn.StateIndex
    count: eqx.nn.StateIndex

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin = eqx.nn.Linear(2 * D, D, key=k1)
        self.out = eqx.nn.Linear(D, D, key=k2)
        self.hidden = eqx.nn.StateIndex(jnp.zeros(D))
        self.count = eqx.nn.StateIndex(jnp.zeros((), jnp.int32))

    def __call__(self, x, state):
        TRACES["n"] += 1
        h = jnp.tanh(self.lin(jnp.concatenate([x, state.get(self.hidden)])))
        n = state.get(self.count) + 1
        state = state.set(self.hidden, h).set(self.count, n)
        return self.out(h), state


def make():
    return eqx.nn.make_with_state(Cell)(jax.random.key(0))


def xs(seed, n):
    return [jax.random.normal(jax.random.key(seed * 100 + i), (D,)) for i in range(n)]


def reference(inputs):
    model, state = make()
    call = jax.jit(lambda m, x, s: m(x, s))
    outs = []
    for x in inputs:
        out, state = call(model, x, state)
        outs.append(np.asarray(out))
    return outs


@pytest.fixture(scope="module")
def states():
    return SessionStates(*make())


def test_interleaved_sessions_are_bit_identical_to_the_model_with_one_trace(states):
    inputs = {sid: xs(i, 3 + i) for i, sid in enumerate("abcd")}
    s = fs.ManagerState.create()
    for sid in inputs:
        s = states.begin(s, sid)
    got: dict[str, list] = {sid: [] for sid in inputs}
    before = TRACES["n"]
    for i in range(6):
        for sid, seq in inputs.items():
            if i < len(seq):
                s, out = states.step(s, sid, seq[i])
                got[sid].append(np.asarray(out))
    assert TRACES["n"] - before <= 1
    for sid, seq in inputs.items():
        for r, g in zip(reference(seq), got[sid], strict=True):
            np.testing.assert_array_equal(g, r)


def test_forks_never_share_a_state_object_and_park_checkpoint_are_exact(states, tmp_path):
    seq = xs(7, 5)
    s = states.begin(fs.ManagerState.create(), "a")
    for x in seq[:2]:
        s, _ = states.step(s, "a", x)
    s = fs.fork_session(s, "a", "b")
    va, vb = fs.view(s, "a", states.name), fs.view(s, "b", states.name)
    assert va is not vb
    model, _ = make()
    model(seq[2], va)  # an eager use invalidates `va`; the other fork's state is another object
    model(seq[2], vb)
    s, _ = states.step(s, "b", seq[2])
    s, _ = fs.park(s, "a", states.name)
    s, out_a = states.step(s, "a", seq[2])
    ref = reference(seq[:3])
    np.testing.assert_array_equal(np.asarray(out_a), ref[-1])
    fs.save_session(s, "a", tmp_path / "ck")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, "tests")
        import numpy as np, functional_state as fs
        from functional_state.equinox import SessionStates
        from test_equinox import make, xs
        states = SessionStates(*make())
        s = fs.load_session(fs.ManagerState.create(), "a", {str(tmp_path / "ck")!r})
        s, out = states.step(s, "a", xs(7, 5)[3])
        np.save({str(tmp_path / "out.npy")!r}, np.asarray(out))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), reference(seq[:4])[-1])


def test_step_many_equals_single_steps(states):
    ids = ["a", "b", "c"]
    single = batched = fs.ManagerState.create()
    for sid in ids:
        single, batched = states.begin(single, sid), states.begin(batched, sid)
    for i in range(2):
        inputs = [xs(j, 2)[i] for j in range(len(ids))]
        outs = []
        for sid, x in zip(ids, inputs):
            single, out = states.step(single, sid, x)
            outs.append(np.asarray(out))
        batched, stacked = states.step_many(batched, ids, jnp.stack(inputs))
        np.testing.assert_allclose(np.asarray(stacked), np.stack(outs), rtol=1e-5, atol=1e-6)
    counts = [x for x in fs.lookup(batched, "c").get(states.name).leaves if x.dtype == jnp.int32]
    assert [int(c) for c in counts] == [2]


def test_bad_input_gives_library_errors_and_changes_nothing(states):
    s = states.begin(fs.ManagerState.create(), "a")
    s = fs.put(s, "a", "other", fs.PytreeValue.create([jnp.zeros(2)]))
    snap = snapshot(s)
    with pytest.raises(fs.SessionStateLostError):
        states.step(s, "zzz", jnp.zeros(D))
    with pytest.raises(fs.SessionExistsError):
        states.begin(s, "a")
    with pytest.raises(fs.InvalidArgumentError, match="layout"):
        SessionStates(*make(), name="other").step(s, "a", jnp.zeros(D))
    assert_unchanged(s, snap)


@pytest.mark.parametrize("policy", ["copy_container", "clone"])
def test_an_eqx_state_attr_is_not_shared_by_forks(policy):
    """Regression: the fork routine did not know `eqx.nn.State`, so both forks held one State object and
    one fork's eager use invalidated the other's ("Attempted to use old state")."""
    model, state = make()
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.set_attr(s, "a", "rnn", state, on_fork=policy)
    s = fs.fork_session(s, "a", "b")
    sa, sb = fs.get_attr(s, "a", "rnn"), fs.get_attr(s, "b", "rnn")
    assert sa is not sb
    out_a, _ = model(jnp.ones(D), sa)
    out_b, _ = model(jnp.ones(D), sb)  # raised before: sb was sa, invalidated by the call above
    np.testing.assert_array_equal(np.asarray(out_a), np.asarray(out_b))


def test_missing_equinox_names_the_extra():
    script = "import sys; sys.modules['equinox'] = None\ntry:\n import functional_state.equinox\nexcept ImportError as e:\n print(e)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "[equinox]" in out.stdout, out.stderr[-2000:]
