"""The build hook: the table's hot modules compiled with mypyc, or, without a compiler, pure Python.

`pip install .` (and `make`) compiles the modules in `COMPILED` from their own source with mypyc. A build
with ``FUNCTIONAL_STATE_PURE=1`` in its environment, or where mypyc or a C compiler is missing, installs the
same modules as plain Python; `functional_state.COMPILED` says which build is running. The C++ helpers of
`NATIVE_TORCH` are built only where torch is importable at build time. Everything else is declared in
pyproject.toml.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# The list of compiled modules and the variable that asks for a pure build, from the one place the package
# reads them too (run by path: importing the package would need jax, which a build environment lacks).
_COMPILED = runpy.run_path(str(HERE / "functional_state" / "_compiled.py"), run_name="_compiled")


def _extensions() -> list:
    pure_env = _COMPILED["PURE_ENV"]
    if os.environ.get(pure_env, "") not in ("", "0"):
        print(f"functional-state: {pure_env} is set: building pure Python", file=sys.stderr)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("functional-state: mypyc is not installed: building pure Python", file=sys.stderr)
        return []
    paths = [name.replace(".", "/") + ".py" for name in _COMPILED["MODULES"]]
    # mypy checks only the compiled modules (--follow-imports=skip): what they import from the rest of the
    # package, jax or torch reads as Any, so the build environment (which lacks jax and torch) compiles the
    # same code as a developer's venv, and a type error elsewhere cannot fail the build. The shared library
    # is named for the package (`functional_state__mypyc`), not for a hash of the module list.
    flags = ["--follow-imports=skip", "--ignore-missing-imports", "--no-warn-unused-ignores"]
    extensions = mypycify([*flags, *paths], opt_level="3", debug_level="0", group_name="functional_state")
    for ext in extensions:
        ext.optional = True  # no C compiler: setuptools warns and the .py files are installed instead
    return extensions


def _torch_extensions() -> list:
    """The optional C++ helpers that read torch tensors (`NATIVE_TORCH`), where torch is importable at build
    time (not in pip's isolated build environment: ``python setup.py build_ext --inplace`` in the venv builds
    them); each is optional, and the package reads the same facts in Python without it."""
    pure_env = _COMPILED["PURE_ENV"]
    if os.environ.get(pure_env, "") not in ("", "0"):
        return []
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        return []
    extensions = []
    for name in _COMPILED["NATIVE_TORCH"]:
        short = name.rsplit(".", 1)[1]
        flags = ["-O2", "-std=c++20", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={short}"]
        flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
        ext = CppExtension(name, [name.replace(".", "/") + ".cpp"], extra_compile_args=flags)
        ext.optional = True
        extensions.append(ext)
    return extensions


class _AllOrNone(build_ext):
    """``build_ext`` that installs the compiled modules together or not at all: each is a small extension
    importing one shared library, so if one failed (each is optional), those built would import a library
    that is missing. They are removed, and the ``.py`` files run."""

    def run(self) -> None:
        super().run()
        built = [self._paths(ext.name) for ext in self.extensions if ext.name not in _COMPILED["NATIVE_TORCH"]]
        if all(any(path.is_file() for path in paths) for paths in built):
            return
        print("functional-state: a compiled module failed to build: installing pure Python", file=sys.stderr)
        for paths in built:
            for path in paths:
                path.unlink(missing_ok=True)

    def _paths(self, name: str) -> list[Path]:
        filename = self.get_ext_filename(name)
        return [Path(self.build_lib) / filename, *([HERE / filename] if self.inplace else [])]


# ``make`` builds the torch helpers in place after the editable install compiled the modules above; this asks
# for them alone, so the modules are not compiled a second time.
_TORCH_ONLY = os.environ.get("FUNCTIONAL_STATE_TORCH_HELPERS_ONLY", "") not in ("", "0")
setup(
    ext_modules=_torch_extensions() if _TORCH_ONLY else _extensions() + _torch_extensions(),
    cmdclass={"build_ext": _AllOrNone},
)
