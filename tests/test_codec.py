"""The checkpoint codec registry (`core/codec.py`): one class per checkpoint type name (issue 34, item 3)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state import InvalidArgumentError
from functional_state.core import codec


@pytest.fixture(autouse=True)
def _registry(monkeypatch):
    """Each test registers into a copy of the registry: nothing it registers outlives it."""
    monkeypatch.setattr(codec, "_BY_TYPE", dict(codec._BY_TYPE))
    monkeypatch.setattr(codec, "_BY_NAME", dict(codec._BY_NAME))


def _user_class(qualname: str, module: str = "user_models"):
    """A StateObject subclass named ``DenseValue`` as a user's own module would define it."""
    cls = type("DenseValue", (fs.LatentBuffer,), {"__module__": module, "__qualname__": qualname})
    return cls


def _dense_table():
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    return fs.put(s, "a", "d", fs.DenseValue.create(jnp.arange(3.0)))


def test_a_user_class_cannot_take_a_builtin_types_name(tmp_path):
    # It popped the library's DenseValue from the registry: saving a real one then failed "not registered",
    # and a load could have built the user's class from the library's data.
    user = _user_class("DenseValue")
    with pytest.raises(InvalidArgumentError, match=r"'DenseValue' is taken by functional_state\..*name='user_models"):
        fs.register_checkpoint_type(user)
    assert codec.codec_named("DenseValue")[0] is fs.DenseValue
    assert codec.codec_for(fs.DenseValue)[0] == "DenseValue" and codec.codec_for(user) is None
    fs.save_session(_dense_table(), "a", tmp_path / "ck")
    loaded = fs.load_session(fs.ManagerState.create(), "a", tmp_path / "ck")
    assert type(fs.lookup(loaded, "a").get("d")) is fs.DenseValue
    np.testing.assert_array_equal(np.asarray(fs.view(loaded, "a", "d")), [0.0, 1.0, 2.0])


def test_an_explicit_taken_name_is_refused_and_a_name_of_its_own_is_kept():
    user = _user_class("DenseValue")
    with pytest.raises(InvalidArgumentError, match="is taken"):
        fs.register_checkpoint_type(user, name="LatentBuffer")
    assert codec.codec_named("LatentBuffer")[0] is fs.LatentBuffer
    fs.register_checkpoint_type(user, name="user_models.DenseValue")
    assert codec.codec_named("user_models.DenseValue")[0] is user
    assert codec.codec_named("DenseValue")[0] is fs.DenseValue


def test_the_same_class_defined_anew_takes_its_name_over():
    first = fs.register_checkpoint_type(_user_class("Model.DenseValue"), name="Cache")
    again = fs.register_checkpoint_type(_user_class("Model.DenseValue"), name="Cache")  # a reloaded module
    assert codec.codec_named("Cache")[0] is again and codec.codec_for(first) is None
    with pytest.raises(InvalidArgumentError, match="is taken"):  # same name, another qualname
        fs.register_checkpoint_type(_user_class("Other.DenseValue"), name="Cache")
