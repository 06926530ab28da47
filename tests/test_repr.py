"""States render in notebooks (treescope) and as text without raising, also when they hold torch tensors."""

import dataclasses

import jax.numpy as jnp
import pytest

treescope = pytest.importorskip("treescope", reason="notebook rendering needs treescope (the [dev] extra)")
torch = pytest.importorskip("torch", reason="torch leaves need the [torch] extra")

import functional_state as fs  # noqa: E402


@dataclasses.dataclass
class _UserThing:  # an attr of a type we do not know, holding a tensor: treescope's own handlers reach it
    weights: object


@pytest.fixture
def plain_html(monkeypatch):
    """Uncompressed HTML renderings, so a test can read them (notebooks get the compressed ones)."""
    render = treescope.render_to_html
    monkeypatch.setattr(treescope, "render_to_html", lambda value, **kw: render(value, **{**kw, "compressed": False}))


def _states():
    s = fs.SessionState.empty()
    s = s.put("lat", fs.LatentBuffer.create()).update("lat", lambda b: b.commit(torch.ones(2, 3)))
    s = s.put("dv", fs.DenseValue.create([torch.ones(4)]))
    s = s.put("ring", fs.ArrayRing.create(2, (3,)))
    s = s.set_attr("history", [torch.zeros(4, dtype=torch.bfloat16)]).set_attr("thing", _UserThing(torch.ones(5)))
    table, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    table = fs.with_sessions(table, {"a": s})
    return {"session": s, "table": table, "latent_buffer": s.get("lat"), "dense_value": s.get("dv")}


@pytest.mark.parametrize("name", ["session", "table", "latent_buffer", "dense_value"])
def test_torch_states_render_with_treescope_as_text_and_html(name, plain_html):
    # Regression: treescope's torch handler reads Tensor.names (gone in torch 2.13), so any state holding a
    # tensor raised AttributeError from render_to_text and _repr_html_.
    value = _states()[name]
    text = treescope.render_to_text(value)
    assert "torch.Tensor float32(2, 3) cpu" in text or "torch.Tensor float32(4,) cpu" in text, text
    html = value._repr_html_()
    assert html is not None and "treescope" in html and "float32" in html


def test_session_text_shows_every_torch_leaf_by_shape_dtype_and_device():
    text = treescope.render_to_text(_states()["session"])
    for summary in ("float32(2, 3) cpu", "float32(4,) cpu", "bfloat16(4,) cpu"):
        assert f"<torch.Tensor {summary}>" in text, text
    assert "'thing': _UserThing(" in text  # an unknown type holding a tensor still renders, summarized
    assert "jax.Array float32(2, 3)" in text  # JAX leaves keep treescope's own rendering


def test_html_rendering_does_not_embed_a_second_rendering_per_nested_state(plain_html):
    html = _states()["table"]._repr_html_()
    assert "SessionState" in html and "Rich HTML representation" not in html


def test_a_repr_never_raises_when_treescope_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("treescope broke")

    monkeypatch.setattr(treescope, "render_to_html", broken)
    for value in _states().values():
        assert value._repr_html_() is None  # the notebook falls back to the plain repr
        assert repr(value)


def test_plain_reprs_summarize_arrays_and_never_print_values():
    s = _states()["session"]
    assert repr(s.get("ring")) == "ArrayRing(storage=f32[2,3], size=i32[], capacity=2)"
    assert "bf16[4]" in repr(s) and "1.0" not in repr(s)
    assert fs.SessionState.empty().put("r", fs.ArrayRing.create(1, (2,), jnp.float32))._repr_html_()
