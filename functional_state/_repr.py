"""Private helpers for Equinox-style reprs: arrays print as ``f32[4,16]``, never as their values."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

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


def _inside_treescope() -> bool:
    """True when called from treescope's own rendering (it asks nested values for ``_repr_html_``)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("treescope"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def repr_html(value: Any) -> str | None:
    """Jupyter's rich display: the treescope rendering when treescope is installed, else None (plain repr).

    Inside a treescope rendering (``treescope.display``, or this very call on an outer value) this returns
    None, so treescope renders nested states structurally instead of embedding a second rendering.
    """
    if _inside_treescope():
        return None
    try:
        import treescope
    except ImportError:
        return None
    return treescope.render_to_html(value)
