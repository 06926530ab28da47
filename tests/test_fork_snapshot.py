"""A fork stays a snapshot when torch values are written in place (issue 34, item 1).

`fork_session` shares buffers, and torch models write their caches in place (transformers' `StaticCache.update`
is ``index_copy_``). Before the fix, a write in place through a parent's view changed its fork silently, through
`DenseValue` and `PytreeValue`, through the shell, and a fork's checkpoint then saved the parent's write. Now:
`writable` copies the shared storages first, and a write in place made outside it to a storage something else
shares is refused with `SharedStorageWrittenError` at the next call on either session, before anything is read.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_holder_index import HolderMachine
from test_planner_machine import SIDS, PlannerMachine

import functional_state as fs
from functional_state import ArrayRing, DenseValue, LatentBuffer, ManagerState, PytreeValue, SharedStorageWrittenError
from functional_state.memory.holders import buffer_keys, holders_except
from functional_state.table import torch_writes
from functional_state.table.manager_state import session_map
from helpers import assert_unchanged, snapshot

# --- the reproduction of the issue, and what each verb does with a shared storage written in place ---------


def _forked(obj):
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    return fs.fork_session(fs.put(s, "p", "kv", obj), "p", "c")


def _first(tree):
    return tree["k"] if isinstance(tree, dict) else tree[0]


OBJECTS = {
    "pytree": lambda: PytreeValue.create({"k": torch.zeros(4)}),
    "dense": lambda: DenseValue.create([torch.zeros(4)]),
}


@pytest.mark.parametrize("kind", sorted(OBJECTS))
def test_a_write_in_place_through_a_parents_view_is_refused_at_the_next_call_on_either_session(kind):
    s = _forked(OBJECTS[kind]())
    k = _first(fs.view(s, "p", "kv"))
    k[0] = 1.0  # the write: outside `writable`, into the storage the fork shares
    snap = snapshot(s)
    with pytest.raises(SharedStorageWrittenError) as e:
        fs.commit(s, "p", "kv", {"k": k} if kind == "pytree" else [k])
    message = str(e.value)
    assert "'kv'" in message and "'p'" in message and f"{k.untyped_storage().data_ptr():#x}" in message
    assert "version 0 -> 1" in message and "writable" in message
    for call in (
        lambda: fs.view(s, "c", "kv"),
        lambda: fs.view(s, "p", "kv"),
        lambda: fs.park(s, "c", "kv"),
        lambda: fs.fork_session(s, "p", "d"),
        lambda: fs.stage(s, "c", "kv", {"k": torch.ones(4)} if kind == "pytree" else [torch.ones(4)]),
    ):
        with pytest.raises(SharedStorageWrittenError):
            call()
    assert_unchanged(s, snap)  # every refusal left the table as it was


def test_a_fork_is_never_saved_holding_its_parents_write_in_place(tmp_path):
    s = _forked(DenseValue.create([torch.zeros(4)]))
    fs.view(s, "p", "kv")[0].add_(1.0)
    with pytest.raises(SharedStorageWrittenError, match="'c'"):
        fs.save_session(s, "c", tmp_path / "c")
    with pytest.raises(SharedStorageWrittenError):
        fs.save(s, tmp_path / "all")
    assert not fs.has_checkpoint(tmp_path / "c") and not fs.has_checkpoint(tmp_path / "all")


def test_a_write_in_place_to_storage_only_one_session_holds_is_its_own_and_a_later_fork_is_recorded_anew():
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "kv", DenseValue.create([torch.zeros(4)]))
    fs.view(s, "p", "kv")[0].add_(1.0)  # nobody shares it: the owner's own write (what models did before)
    s = fs.commit(s, "p", "kv", fs.view(s, "p", "kv"))
    s = fs.fork_session(s, "p", "c")  # records the versions it now shares
    assert fs.view(s, "c", "kv")[0].tolist() == [1.0] * 4
    fs.view(s, "p", "kv")[0].add_(1.0)  # shared now: refused
    with pytest.raises(SharedStorageWrittenError, match="'c'"):
        fs.view(s, "c", "kv")


def test_putting_the_written_object_into_another_session_does_not_hide_the_write():
    s = _forked(DenseValue.create([torch.zeros(4)]))
    fs.view(s, "p", "kv")[0].add_(1.0)
    s, _ = fs.get_or_create(s, "d")
    with pytest.raises(SharedStorageWrittenError, match="`put`"):
        fs.put(s, "d", "kv", fs.lookup(s, "p").objects["kv"])  # the very object, shared a third time
    with pytest.raises(SharedStorageWrittenError):
        fs.view(s, "c", "kv")


def test_an_object_written_in_place_while_nothing_shared_it_may_be_put_elsewhere():
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "kv", DenseValue.create([torch.zeros(4)]))
    fs.view(s, "p", "kv")[0].add_(1.0)  # the owner's own write
    s, _ = fs.get_or_create(s, "d")
    s = fs.put(s, "d", "kv", fs.lookup(s, "p").objects["kv"])  # now shared, as written: both read the same
    assert fs.view(s, "d", "kv")[0].tolist() == fs.view(s, "p", "kv")[0].tolist() == [1.0] * 4


def test_forks_parked_together_and_restored_share_one_copy_that_a_write_in_place_is_refused_on():
    s = _forked(DenseValue.create([torch.zeros(4)]))
    s, _ = fs.park(s, "p", "kv", with_sharers=True)
    s, _ = fs.restore(s, "p", "kv")
    s, _ = fs.restore(s, "c", "kv")  # the same device copy (see `restore`)
    fs.view(s, "p", "kv")[0].add_(1.0)
    with pytest.raises(SharedStorageWrittenError, match="'c'"):
        fs.view(s, "c", "kv")


def test_a_write_in_place_between_two_restores_of_forks_parked_together_never_reaches_the_second():
    # The first fork restored, wrote its (then private) copy in place, and was accepted; the second fork's
    # restore must not hand it that written copy (it reused the memoised device copy, silently).
    s = _forked(DenseValue.create([torch.zeros(4)]))
    s, _ = fs.park(s, "p", "kv", with_sharers=True)
    s, _ = fs.restore(s, "p", "kv")
    fs.view(s, "p", "kv")[0].add_(1.0)  # nothing else holds the restored copy yet: the owner's own write
    assert fs.view(s, "p", "kv")[0].tolist() == [1.0] * 4
    s, _ = fs.restore(s, "c", "kv")
    assert fs.view(s, "c", "kv")[0].tolist() == [0.0] * 4
    assert fs.stats(s) == fs.stats(s, exact=True)


def test_a_fork_records_the_tensors_an_object_holds_that_no_put_or_commit_took_in():
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.update_session(s, "p", lambda session: session.put("kv", DenseValue.create([torch.zeros(4)])))
    s = fs.fork_session(s, "p", "c")  # the object was never taken in by `put`: the fork reads it
    fs.view(s, "p", "kv")[0].add_(1.0)
    with pytest.raises(SharedStorageWrittenError, match="'c'"):
        fs.view(s, "c", "kv")


def test_writable_copies_the_shared_storage_once_and_keeps_its_views_views_of_that_copy():
    base = torch.zeros(8)
    obj = PytreeValue.create({"a": base[:4], "b": base[4:], "own": torch.zeros(2)})
    s = _forked(obj)
    before = snapshot(s)
    s2, tree = fs.writable(s, "p", "kv")
    assert_unchanged(s, before)  # pure: the input table is untouched
    a, b = tree["a"], tree["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert (a.storage_offset(), b.storage_offset()) == (0, 4)
    a.add_(1.0)
    b.add_(2.0)
    s2 = fs.commit(s2, "p", "kv", tree)
    assert fs.view(s2, "p", "kv")["a"].tolist() == [1.0] * 4 and fs.view(s2, "p", "kv")["b"].tolist() == [2.0] * 4
    assert fs.view(s2, "c", "kv")["a"].tolist() == [0.0] * 4 and base.tolist() == [0.0] * 8  # the fork: a snapshot
    # Once nothing else holds them, writable copies nothing: the same object, the same table.
    s3, again = fs.writable(s2, "p", "kv")
    assert s3 is s2 and again["a"] is fs.view(s2, "p", "kv")["a"]


def test_writable_copies_what_an_attr_or_another_object_holds_and_leaves_jax_values_alone():
    t = torch.zeros(4)
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "kv", DenseValue.create([t, jnp.zeros(3)]))
    s = fs.set_attr(s, "p", "prompt", t)
    s, tree = fs.writable(s, "p", "kv")
    assert tree[0].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert tree[1] is fs.lookup(s, "p").objects["kv"].value[1]  # the JAX array: never written in place


def test_writable_refuses_a_parked_object_and_a_shared_storage_already_written():
    s = _forked(DenseValue.create([torch.zeros(4)]))
    parked, _ = fs.park(s, "p", "kv", with_sharers=True)
    with pytest.raises(fs.ObjectParkedError):
        fs.writable(parked, "p", "kv")
    fs.view(s, "p", "kv")[0].add_(1.0)
    with pytest.raises(SharedStorageWrittenError):
        fs.writable(s, "p", "kv")


def test_the_shell_refuses_the_write_and_its_handles_writable_keeps_the_fork_a_snapshot():
    m = fs.SessionStateManager()
    p = m.get_or_create_session("p")
    p.put("kv", PytreeValue.create({"k": torch.zeros(4)}))
    c = m.fork_session("p", "c")
    k = p.view("kv")["k"]
    k[0] = 1.0
    with pytest.raises(SharedStorageWrittenError):
        c.view("kv")
    with pytest.raises(SharedStorageWrittenError):
        p.commit("kv", {"k": k})
    k[0] = 0.0  # (the values back; the version stays newer, so the table is rebuilt fresh below)
    m2 = fs.SessionStateManager()
    p = m2.get_or_create_session("p")
    p.put("kv", PytreeValue.create({"k": torch.zeros(4)}))
    c = m2.fork_session("p", "c")
    tree = p.writable("kv")
    tree["k"][0] = 1.0
    p.commit("kv", tree)
    assert p.view("kv")["k"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert c.view("kv")["k"].tolist() == [0.0] * 4


def test_jax_values_get_no_record_and_commits_stay_unrecorded():
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "ring", fs.ArrayRing.create(2, (3,)))
    s = fs.put(s, "p", "tree", PytreeValue.create({"k": jnp.zeros(3)}))
    s = fs.fork_session(s, "p", "c")
    s = fs.commit(fs.commit(s, "p", "ring", jnp.ones(3)), "p", "tree", {"k": jnp.ones(3)})
    for name in ("ring", "tree"):
        for sid in ("p", "c"):
            assert torch_writes.recorded(fs.lookup(s, sid).objects[name]) == ()


def test_a_record_is_dropped_with_its_object():
    obj = DenseValue.create([torch.zeros(4)])
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "kv", obj)
    key = id(obj)
    assert key in torch_writes.RECORDS
    del s, obj
    assert key not in torch_writes.RECORDS


# --- transformers: a beam forked from a StaticCache decode equals that beam decoded alone ----------------------

try:
    import transformers
except ImportError:  # (the dev extra installs it)
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers (the dev extra)")
MAX_LEN = 16


def _llama():
    from torch_bridge.harness.text_models import tiny_llama

    return tiny_llama()


def _cache(model, tree=None):
    """A `StaticCache` whose layers are the session's tensors (``tree``), or a fresh one."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    if tree is not None:
        for layer, k, v, n in zip(cache.layers, tree["keys"], tree["values"], tree["length"]):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values, layer.cumulative_length = k, v, n  # the session's, written in place
    return cache


def _tree(cache):
    layers = cache.layers
    return {
        "keys": [layer.keys for layer in layers],
        "values": [layer.values for layer in layers],
        "length": [layer.cumulative_length for layer in layers],
    }


@torch.no_grad()
def _decode(model, cache, token):
    return model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


def _step(model, state, sid, token, write_path):
    """One decode step of session ``sid``, its cache written in place by the model, then committed."""
    state, tree = write_path(state, sid, "kv")
    logits = _decode(model, _cache(model, tree), token)
    return fs.commit(state, sid, "kv", tree), logits


PROMPT = [5, 17, 42, 8]
STEPS = 4


@torch.no_grad()
def _prefilled(model):
    cache = _cache(model)
    logits = model(input_ids=torch.tensor([PROMPT]), past_key_values=cache, use_cache=True).logits[0, -1]
    return cache, logits


def _beam_alone(model, first):
    """The reference: the beam decoded from the prompt with nobody else sharing its cache."""
    cache, _ = _prefilled(model)
    tokens, logits, token = [], [], first
    for _ in range(STEPS):
        out = _decode(model, cache, token)
        tokens.append(token)
        logits.append(out)
        token = int(out.argmax())
    return tokens, logits


def _served(model, write_path):
    """Prefill in session "p", fork beam "b" on the second-best token, decode the parent a step ahead of the
    beam each round (its in-place cache writes first), and return the beam's tokens and logits."""
    cache, logits = _prefilled(model)
    s, _ = fs.get_or_create(ManagerState.create(), "p")
    s = fs.put(s, "p", "kv", PytreeValue.create(_tree(cache)))
    s = fs.fork_session(s, "p", "b")
    top2 = logits.topk(2).indices.tolist()
    parent, beam = top2
    tokens, beam_logits = [], []
    for _ in range(STEPS):
        s, out = _step(model, s, "p", parent, write_path)
        parent = int(out.argmax())
        s, out = _step(model, s, "b", beam, write_path)
        tokens.append(beam)
        beam_logits.append(out)
        beam = int(out.argmax())
    return top2[1], tokens, beam_logits


@needs_transformers
def test_a_static_cache_beam_forked_from_a_decode_equals_that_beam_decoded_alone():
    model = _llama()
    first, tokens, logits = _served(model, fs.writable)
    ref_tokens, ref_logits = _beam_alone(model, first)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert torch.equal(got, want)


@needs_transformers
def test_a_static_cache_decoded_through_a_plain_view_after_a_fork_is_refused_not_served():
    def through_view(state, sid, name):  # what a model did before `writable`: the parent's view, written in place
        return state, fs.view(state, sid, name)

    with pytest.raises(SharedStorageWrittenError, match="'p'"):
        _served(_llama(), through_view)


# --- the planner machine, extended: in-place writes and forks never change another session's values -----------


def _content(obj):
    """What ``obj`` holds, bytes per leaf (None: nothing comparable, e.g. evicted, parked or engine-backed)."""
    if not isinstance(obj, (DenseValue, LatentBuffer, PytreeValue)) or not obj.resident:
        return None
    out = []
    for leaf in jax.tree_util.tree_leaves(obj.view()):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf.detach().numpy().tobytes())
        else:
            out.append(np.asarray(leaf).tobytes())
    return tuple(out)


class ForkSnapshotMachine(PlannerMachine):
    """`PlannerMachine` (objects of every type, forks, shared objects, views of one storage as two objects,
    attrs, budgets that park and evict) plus writes in place through `writable`: every object's values change
    only when that object of that session was written."""

    def _contents(self):
        return {
            (sid, name): _content(obj)
            for sid in SIDS
            if sid in self.state
            for name, obj in fs.lookup(self.state, sid).objects.items()
        }

    def _writable_objects(self):
        return [
            (sid, name, obj)
            for sid in SIDS
            if sid in self.state
            for name, obj in fs.lookup(self.state, sid).objects.items()
            if isinstance(obj, (DenseValue, LatentBuffer)) and obj.resident
        ]

    @rule(pick=st.integers(0, 64), amount=st.integers(1, 3))
    def write_in_place(self, pick, amount):
        """A model's step: the object's view from `writable`, its torch tensors written in place, committed."""
        candidates = self._writable_objects()
        if not candidates:
            return
        sid, name, obj = candidates[pick % len(candidates)]
        before = self._contents()

        def fn(state):
            state, view = fs.writable(state, sid, name)
            for leaf in view:
                if isinstance(leaf, torch.Tensor):
                    leaf.add_(float(amount))  # in place, as a model's cache update writes
            return fs.commit(state, sid, name, view) if isinstance(obj, DenseValue) else state

        self._write(sid, fn)
        after = self._contents()
        compared = 0
        for key, value in before.items():
            if key != (sid, name) and value is not None and after.get(key) is not None:
                assert after[key] == value, f"{key} changed by a write to {(sid, name)}"
                compared += 1
        event(f"written in place, beside {min(compared, 3)}+ other objects compared")

    @invariant()
    def every_object_reads_without_a_shared_write(self):
        for sid in SIDS:
            if sid in self.state:
                for name, obj in fs.lookup(self.state, sid).objects.items():
                    if obj.resident:
                        fs.view(self.state, sid, name)  # raises SharedStorageWrittenError on a shared write


ForkSnapshotMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
TestForkSnapshotMachine = ForkSnapshotMachine.TestCase


# --- the holders machine, extended: torch objects, views of one storage, attrs, and writes in place ------------


class TorchHolderMachine(HolderMachine):
    """`HolderMachine` (rings, forks, shared objects and attrs, parking, donation, drops) plus torch objects:
    `DenseValue`s of a tensor, of a view of another's tensor, and torch attrs viewing them, written in place
    through `writable` or outside it. Through `writable` no other holder ever changes; outside it, a write to a
    storage another holder shares is refused on every holder, and one nobody shares is the owner's own."""

    def _objects(self):  # what the base rules step, park and alias: the rings
        return [(s, n) for s, n in super()._objects() if isinstance(fs.lookup(self.state, s).get(n), ArrayRing)]

    def _torch(self):
        return [
            (s, n)
            for s, n in super()._objects()
            if isinstance(obj := fs.lookup(self.state, s).get(n), DenseValue) and obj.resident
        ]

    def _contents(self):
        return {(s, n): _content(fs.lookup(self.state, s).get(n)) for s, n in super()._objects()}

    @rule(data=st.data(), sid=st.sampled_from(SIDS), view=st.booleans())
    def new_torch(self, data, sid, view):
        self.n += 1
        sources = self._torch()
        value = torch.full((4,), float(self.n))
        if view and sources:
            src, name = data.draw(st.sampled_from(sources))
            value = fs.lookup(self.state, src).get(name).value[0][:2]  # a second object over one storage
        self.state, _ = fs.get_or_create(self.state, sid)
        self.state = fs.put(self.state, sid, f"t{self.n % 2}", DenseValue.create([value]))

    @precondition(lambda self: self._torch())
    @rule(data=st.data(), to=st.sampled_from(SIDS))
    def torch_attr(self, data, to):
        sid, name = data.draw(st.sampled_from(self._torch()))
        self.state, _ = fs.get_or_create(self.state, to)
        self.state = fs.set_attr(self.state, to, "prompt", fs.lookup(self.state, sid).get(name).value[0][1:])

    @precondition(lambda self: self._torch())
    @rule(data=st.data(), sanctioned=st.booleans())
    def write_in_place(self, data, sanctioned):
        sid, name = data.draw(st.sampled_from(self._torch()))
        before = self._contents()
        if sanctioned:
            self.state, value = fs.writable(self.state, sid, name)
            value[0].add_(1.0)
            self.state = fs.commit(self.state, sid, name, value)
            shared = False
            event("written through writable")
        else:
            tensor = fs.view(self.state, sid, name)[0]
            others = holders_except(session_map(self.state), {sid: name})
            shared = bool(buffer_keys([v for vs in others.values() for v in vs]) & buffer_keys(tensor))
            tensor.add_(1.0)
            event(f"written outside writable, {'shared' if shared else 'private'}")
            if shared:  # refused wherever it is held, then the sessions holding the storage are let go
                keys = buffer_keys(tensor)
                holding = [s for s, session in session_map(self.state).items() if buffer_keys(session) & keys]
                for s, n in self._torch():
                    if s in holding and buffer_keys(fs.lookup(self.state, s).get(n)) & keys:
                        with pytest.raises(SharedStorageWrittenError):
                            fs.view(self.state, s, n)
                for s in holding:
                    self.state, _ = fs.drop_session(self.state, s)
                return
            fs.view(self.state, sid, name)  # the owner's own write: accepted
        after = self._contents()
        for key, value in before.items():
            if key != (sid, name) and key in after:
                assert after[key] == value, f"{key} changed by a write to {(sid, name)} (shared={shared})"


TestTorchHolderMachine = TorchHolderMachine.TestCase
TestTorchHolderMachine.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
