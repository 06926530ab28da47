"""Private helpers for reprs: arrays print as ``f32[4,16]``, never as their values; treescope renderings."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

_log = logging.getLogger("functional_state")

_KIND = {"f": "f", "i": "i", "u": "u", "b": "bool", "c": "c", "V": "bf", "O": "obj"}


def _dtype_short(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    try:
        dt = np.dtype(dtype)
    except TypeError:  # torch dtypes, and anything numpy does not know
        aliases = {
            "float32": "f32",
            "float16": "f16",
            "bfloat16": "bf16",
            "float64": "f64",
            "bool": "bool",
            "int64": "i64",
            "int32": "i32",
            "int16": "i16",
            "int8": "i8",
            "uint8": "u8",
            "complex64": "c64",
            "complex128": "c128",
        }
        return aliases.get(name, name)
    if dt.name == "bfloat16":
        return "bf16"
    if dt.kind == "b":
        return "bool"
    kind = _KIND.get(dt.kind)
    return f"{kind}{dt.itemsize * 8}" if kind and dt.kind in "fiuc" else dt.name


def short(value: Any) -> str:
    """``f32[4,16]`` for anything with a shape and a dtype (JAX, numpy, torch), else a bounded ``repr``."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{_dtype_short(dtype)}[{','.join(str(int(d)) for d in shape)}]"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(short(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- treescope ---------------------------------------------------------------------------------------------
# States render in notebooks through treescope. Two things must hold: a rendering never raises (a repr that
# raises hides the state and the error alike), and treescope never sees a torch tensor, because its torch
# handler reads `Tensor.names`, which torch 2.13 no longer has. Our types render through treescope's own
# protocol (`__treescope_repr__`, below); torch leaves become one-line summaries before treescope meets them.


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported: never import it here
    return getattr(torch, "Tensor", None) if torch is not None else None


def torch_summary(tensor: Any) -> str:
    """``torch.Tensor bfloat16(1, 16) cpu``: dtype, shape and device, never the values."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"torch.Tensor {dtype}{tuple(int(d) for d in tensor.shape)} {tensor.device}"


class TorchLeaf:
    """Stands in for a torch tensor in a treescope rendering: its summary, in treescope's leaf style."""

    __slots__ = ("text",)

    def __init__(self, tensor: Any) -> None:
        self.text = torch_summary(tensor)

    def __repr__(self) -> str:
        return f"<{self.text}>"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import rendering_parts

        return rendering_parts.build_one_line_tree_node(
            rendering_parts.abbreviation_color(rendering_parts.text(repr(self))), path
        )


def displayable(value: Any) -> Any:
    """``value`` with every torch tensor (also inside dicts, lists and tuples) replaced by its summary."""
    tensor_type = _torch_tensor_type()
    return value if tensor_type is None else _swap_tensors(value, tensor_type)


def _swap_tensors(value: Any, tensor_type: type) -> Any:
    if isinstance(value, tensor_type):
        return TorchLeaf(value)
    if type(value) is dict:
        return {k: _swap_tensors(v, tensor_type) for k, v in value.items()}
    if type(value) is list:
        return [_swap_tensors(v, tensor_type) for v in value]
    if type(value) is tuple:
        return tuple(_swap_tensors(v, tensor_type) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple keeps its type and field names
        return type(value)(*(_swap_tensors(v, tensor_type) for v in value))
    return value


def _never_raising(subtree_renderer: Any) -> Any:
    """``subtree_renderer``, except that a child treescope cannot render shows as a bounded repr."""

    def render(node: Any, path: str | None = None) -> Any:
        try:
            return subtree_renderer(node, path=path)
        except Exception:
            _log.debug("treescope could not render a %s; showing a summary", type(node).__name__, exc_info=True)
            from treescope import rendering_parts

            return rendering_parts.build_one_line_tree_node(
                rendering_parts.error_color(rendering_parts.text(short(node))), path
            )

    return render


def treescope_repr(
    obj: Any, path: str | None, subtree_renderer: Any, attributes: Mapping[str, Any] | None = None
) -> Any:
    """The body of a ``__treescope_repr__``: ``Type(field=..., ...)`` with torch leaves summarized.

    Args:
        obj: the object rendered.
        path: and subtree_renderer: what treescope passed to ``__treescope_repr__``.
        attributes: the attributes to show; a dataclass's fields when None.
    """
    from treescope import repr_lib

    if attributes is None:
        if not dataclasses.is_dataclass(obj):
            return NotImplemented  # treescope's next handler renders it
        attributes = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    shown = {name: displayable(value) for name, value in attributes.items()}
    return repr_lib.render_object_constructor(type(obj), shown, path, _never_raising(subtree_renderer))


def repr_html(value: Any) -> str | None:
    """Jupyter's rich display: the treescope rendering when treescope is installed, else None (plain repr).

    Never raises: a value treescope cannot render shows its plain repr. The rendering leaves out treescope's
    hook that embeds nested values' own ``_repr_html_`` (our nested states render structurally, through
    ``__treescope_repr__``, instead of each embedding a second rendering).
    """
    try:
        import treescope
        from treescope import handlers
    except ImportError:
        return None
    try:
        renderer = treescope.active_renderer.get()
        hooks = [h for h in renderer.wrapper_hooks if h is not handlers.append_repr_html_when_present]
        with treescope.active_renderer.set_scoped(dataclasses.replace(renderer, wrapper_hooks=hooks)):
            return treescope.render_to_html(value)
    except Exception:
        _log.debug("treescope could not render a %s; showing its plain repr", type(value).__name__, exc_info=True)
        return None
