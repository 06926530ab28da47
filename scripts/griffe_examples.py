"""A griffe extension for the docs build (mkdocs.yml): our docstrings' ``Example:`` sections are doctests.

Google style names the section ``Examples:``; griffe reads the singular ``Example:`` as a plain admonition
and renders its ``>>>`` lines as Markdown, where ``x[0][1]`` becomes a broken reference link. This extension
renames the section so the doctests render as code, without touching the sources (doctest runs them as is).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.M)


class DoctestExamples(griffe.Extension):
    """Rename each docstring's ``Example:`` section to ``Examples:`` when the docs are built."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
