"""`PytreeValue`: any registered pytree of arrays (an ``nnx.State``, an ``eqx.nn.State``, a dict) as a state object.

The tree's structure is static: it is kept as a plain description (nested tuples of type names, aux data
and children) that checkpoints can hold and jit compares cheaply, with each leaf's shape and dtype. The
leaves are the object's only storage, a tuple of arrays, so parking, forking, donation, accounting and
checkpoints treat them like any other object's buffers. ``view()`` rebuilds a new tree of the same type
each time, so no two readers (or forks) ever share one mutable container.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._repr import short
from ..errors import CheckpointError, InvalidArgumentError, InvalidTypeError, StateShapeError
from .codec import DecodeContext, ObjectCodec, field_error, refused_field, register_checkpoint_type
from .pytree import MISSING, pytree_dataclass
from .state_object import RESIDENT, UNALLOCATED, StateObject, Status

__all__ = ["PytreeValue"]

_LEAF = "*"
# Description -> PyTreeDef: filled whenever a tree is described, so views never resolve types by name; a
# loaded checkpoint's description is resolved once (types looked up among the imported modules, never
# imported or unpickled).
_TREEDEFS: dict[Any, Any] = {}


def _type_name(typ: type) -> str:
    return f"{typ.__module__}:{typ.__qualname__}"


def _describe(td: Any) -> Any:
    node = td.node_data()
    if node is None:
        return _LEAF
    typ, aux = node
    aux_desc = ("list", tuple(aux)) if isinstance(aux, list) else ("v", aux)
    return (_type_name(typ), aux_desc, tuple(_describe(c) for c in td.children()))


def _resolve_type(name: str) -> type:
    module, _, qualname = name.partition(":")
    if name == "builtins:NoneType":
        return type(None)
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise InvalidTypeError(
            f"`PytreeValue`: its tree holds a node of type {name!r}, which no imported module defines; import "
            f"the module that defines it (and registers it as a pytree) before reading the value."
        )
    return obj


def _example(desc: Any) -> Any:
    """A tree of the described structure with 0 leaves, each node built by its own type's unflatten."""
    if desc == _LEAF:
        return 0
    name, (kind, aux), children = desc
    typ = _resolve_type(name)
    kids = [_example(c) for c in children]
    if _type_name(typ) in _PLAIN:  # built here: jax's own nodes trust their node data (a crafted one crashed it)
        return _plain_example(typ, kind, aux, kids)
    if issubclass(typ, tuple) and hasattr(typ, "_fields"):  # NamedTuples have no registry entry of their own
        return typ(*kids)
    node = jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry,
        (typ, list(aux) if kind == "list" else aux),
        [jax.tree_util.tree_structure(0)] * len(kids),
    )
    return jax.tree_util.tree_unflatten(node, kids)


def _plain_example(typ: type, kind: str, aux: Any, kids: list[Any]) -> Any:
    """A dict, list, tuple or None of ``kids``, refusing node data that `_describe` never writes for one."""
    if typ is dict:
        if kind == "list" and isinstance(aux, tuple) and len(aux) == len(kids) == len(set(aux)):
            return dict(zip(aux, kids))
    elif (kind, aux) == ("v", None) and (typ is not type(None) or not kids):
        return typ(kids) if typ is not type(None) else None
    raise InvalidTypeError(
        f"`PytreeValue`: a {typ.__name__} node described with data {(kind, aux)!r} and {len(kids)} children, which "
        f"no {typ.__name__} has."
    )


def _build(desc: Any) -> Any:
    return jax.tree_util.tree_structure(_example(desc))


def _treedef(structure: Any) -> Any:
    td = _TREEDEFS.get(structure)
    if td is None:
        td = _TREEDEFS[structure] = _build(structure)
    return td


def _dtype_name(x: Any) -> str:
    dtype = x.dtype
    return str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else np.dtype(dtype).name


def _flatten(tree: Any, what: str) -> tuple[list[Any], Any, tuple[Any, ...]]:
    """``(leaves, structure, avals)`` of ``tree``, refusing leaves that are not arrays."""
    leaves, td = jax.tree_util.tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])
            raise InvalidTypeError(
                f"`{what}`: a PytreeValue's leaves are arrays (JAX, numpy, torch); the leaf at {path or 'the root'} "
                f"is a {type(leaf).__name__}. Carry other values as attrs, or as static fields of your pytree."
            )
    structure = _describe(td)
    _TREEDEFS.setdefault(structure, td)
    return leaves, structure, tuple((tuple(int(n) for n in x.shape), _dtype_name(x)) for x in leaves)


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


_PLAIN = frozenset({"builtins:dict", "builtins:list", "builtins:tuple", "builtins:NoneType"})


def _plain(desc: Any) -> bool:
    return desc == _LEAF or (desc[0] in _PLAIN and all(_plain(c) for c in desc[2]))


_NEEDS_TEMPLATE = "<template>"  # a saved structure whose aux data a manifest cannot hold (never a type name)

_PORTABLE = (str, int, float, bool, type(None), np.dtype)


def _portable(x: Any) -> bool:
    return isinstance(x, _PORTABLE) or (isinstance(x, tuple) and all(_portable(v) for v in x))


class _Codec(ObjectCodec):
    """A checkpoint holds the tree's description; a load rebuilds its treedef from the caller's template, or
    for plain containers (and pytree types of imported modules) from the description itself. A tree whose aux
    data is not plain (a pytree dataclass with a callable static field, say) is saved as its root type and key
    paths, and loads from a template only."""

    def encode(self, obj: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
        static, fields = self.encode_fields(obj, where)
        if not _portable(obj.structure):
            root = obj.structure[0]
            static["structure"] = (
                _NEEDS_TEMPLATE,
                root,
                tuple(_paths(_treedef(obj.structure).unflatten([0] * len(obj.avals)))),
            )
        return static, fields

    def decode(self, cls: type, static: dict[str, Any], fields: dict[str, Any], context: DecodeContext) -> Any:
        structure, avals = static["structure"], tuple(static["avals"])
        if structure != _LEAF and structure[0] == _NEEDS_TEMPLATE:
            if context.template is MISSING:
                raise CheckpointError(
                    f"{context.where}: a PytreeValue holding a {structure[1]!r} tree whose static data a checkpoint "
                    f"cannot describe; pass the load `templates={{{context.name!r}: abstract_tree}}` (a tree of "
                    f"that type and structure, its leaves arrays or `jax.ShapeDtypeStruct`s)."
                )
            static = {**static, "structure": _adopt_by_paths(context.template, structure, avals, context.where)}
        elif context.template is not MISSING:
            _adopt_template(context.template, structure, avals, context.where)
        elif not _plain(structure):
            try:
                _treedef(structure)
            except InvalidTypeError as e:
                raise CheckpointError(
                    f"{context.where}: a PytreeValue holding a {structure[0]!r} tree, which no imported module "
                    f"defines. Pass the load `templates={{{context.name!r}: abstract_tree}}` (a tree of that type "
                    f"and structure, its leaves arrays or `jax.ShapeDtypeStruct`s), or import the module that "
                    f"defines the type first."
                ) from e
        return super().decode(cls, static, fields, context)

    def check(self, obj: Any, where: str) -> None:
        """Also: no recompute source; ``avals`` a shape and dtype per leaf of ``structure``; the leaves (None
        unless resident) and a staged tree of exactly that layout."""
        super().check(obj, where)
        if obj.recompute_source is not None:
            raise field_error(where, "recompute_source", obj.recompute_source, "None (a PytreeValue has no source)")
        avals = obj.avals
        if not (isinstance(avals, tuple) and all(_is_aval(a) for a in avals)):
            raise field_error(where, "avals", avals, "a tuple of (shape: tuple of ints >= 0, dtype name) per leaf")
        try:
            td = obj.treedef
        except Exception as e:  # (a description that no type's unflatten accepts)
            raise field_error(where, "structure", obj.structure, f"a tree description ({type(e).__name__}: {e})") from e
        if _describe(td) != obj.structure:  # (commits compare descriptions: another spelling would refuse them all)
            raise field_error(
                where, "structure", obj.structure, f"the description its tree gives, {short(_describe(td))}"
            )
        leaf_count = td.num_leaves
        if leaf_count != len(avals):
            raise field_error(where, "avals", avals, f"{leaf_count} leaves, as its structure has")
        if obj.status != RESIDENT:
            if obj.leaves is not None:
                raise field_error(where, "leaves", obj.leaves, f"None (the value is {obj.status})")
        else:
            with refused_field(where, "leaves", obj.leaves):
                if not isinstance(obj.leaves, tuple) or _flatten(list(obj.leaves), "PytreeValue")[2] != avals:
                    raise StateShapeError(f"`PytreeValue`: expected a tuple of {len(avals)} leaves, as its avals")
        if obj.staged is not None:
            with refused_field(where, "staged", obj.staged):
                obj._checked_leaves(obj.staged, "PytreeValue")


def _is_aval(aval: Any) -> bool:
    """Whether ``aval`` is a ``(shape, dtype name)`` a leaf can have (allocating it makes no other shape)."""
    if not (isinstance(aval, tuple) and len(aval) == 2 and isinstance(aval[0], tuple) and isinstance(aval[1], str)):
        return False
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in aval[0]):
        return False
    try:
        dt = jnp.dtype(aval[1])
    except (TypeError, ValueError):
        return False
    return dt.name == aval[1] and (dt == np.bool_ or bool(jnp.issubdtype(dt, jnp.number)))


def _template_layout(template: Any, where: str) -> tuple[Any, Any, Any]:
    """``(structure, avals, treedef)`` of a template (a tree, or a PytreeValue)."""
    if isinstance(template, PytreeValue):
        return template.structure, template.avals, template.treedef
    try:
        _, got, got_avals = _flatten(template, "templates")
    except InvalidTypeError as e:
        raise CheckpointError(f"{where}: its template is not a tree of arrays ({e}).") from e
    return got, got_avals, jax.tree_util.tree_structure(template)


def _adopt_by_paths(template: Any, saved: Any, avals: Any, where: str) -> Any:
    """The template's structure, checked against a saved root type name and key paths (and each leaf's shape
    and dtype); its treedef is the one views use."""
    got, _, td = _template_layout(template, where)
    paths = tuple(_paths(td.unflatten([0] * td.num_leaves)))
    root = got[0] if got != _LEAF else _LEAF
    if (root, paths) != (saved[1], tuple(saved[2])):
        raise CheckpointError(
            f"{where}: the template given in `templates` differs from the saved tree (template: a {root!r} with "
            f"leaves {list(paths)[:6]}; saved: a {saved[1]!r} with leaves {list(saved[2])[:6]}); give a template of "
            f"the layout that was saved."
        )
    _adopt_template(template, got, avals, where)
    return got


def _adopt_template(template: Any, structure: Any, avals: Any, where: str) -> None:
    """Make ``template``'s treedef the one of ``structure``, refusing a template of another layout."""
    got, got_avals, td = _template_layout(template, where)
    if got != structure:
        kind = structure[0].rpartition(":")[2] if structure != _LEAF else "leaf"
        detail = f"the template is {td}; the checkpoint holds a {kind} tree of {len(avals)} leaves"
    elif tuple(got_avals) != avals:
        i = next(i for i, (a, b) in enumerate(zip(got_avals, avals)) if a != b)
        path = _paths(jax.tree_util.tree_unflatten(td, [0] * td.num_leaves))[i] or "the root"
        detail = f"the leaf at {path} is {_aval_str(got_avals[i])} in the template, {_aval_str(avals[i])} saved"
    else:
        _TREEDEFS[structure] = td
        return
    raise CheckpointError(
        f"{where}: the template given in `templates` differs from the saved tree ({detail}); give a template of "
        f"the layout that was saved."
    )


@register_checkpoint_type(codec=_Codec())
@pytree_dataclass(static=("structure", "avals", "status", "recompute_source", "recompute_cost"))
class PytreeValue(StateObject):
    """Any registered pytree of arrays, replaced whole on commit: a model's KV cache as an ``nnx.State``, an
    ``eqx.nn.State``, a dict of arrays, a NamedTuple.

    The structure (types, keys, each leaf's shape and dtype) is fixed when the value is created: ``commit``
    refuses another one, naming the first differing key path, so a step can never silently recompile.
    ``view()`` returns a tree of the same type and structure, built anew on each call (a fork's commit never
    shows in the other, whatever the container). A checkpoint of plain containers (dict, list, tuple, None)
    loads with no hooks; other node types load when their defining module is imported (never unpickled).

    Example:
      >>> import jax.numpy as jnp
      >>> import functional_state as fs
      >>> v = fs.PytreeValue.create({"k": jnp.zeros((2, 3)), "pos": [jnp.zeros((), jnp.int32)]})
      >>> v = v.commit({"k": jnp.ones((2, 3)), "pos": [jnp.array(1, jnp.int32)]})
      >>> v.view()["k"].shape, int(v.view()["pos"][0]), v.park().restore().view()["k"].sum().item()
      ((2, 3), 1, 6.0)
      >>> v.commit({"k": jnp.ones((2, 4)), "pos": [jnp.array(1, jnp.int32)]})
      Traceback (most recent call last):
      ...
      functional_state.errors.StateShapeError: `PytreeValue.commit`: the leaf at ['k'] is f32[2,4], expected f32[2,3] ...
    """

    extents_from_leaves = True  # (its storage is its leaves; a ClassVar of `StateObject`, not a field)

    leaves: Any  # a tuple of arrays, one per leaf of the tree in flatten order; None when not resident
    staged: Any  # a staged replacement tree, or None
    host_copy: Any  # ParkedStorage of `leaves` while parked, else None
    structure: Any  # the tree's static description (nested tuples: type name, aux data, children)
    avals: tuple[tuple[tuple[int, ...], str], ...]  # per leaf: (shape, dtype name)
    status: Status
    recompute_source: str | None  # always None: nothing can rebuild this value
    recompute_cost: float  # unused: never recomputable

    @classmethod
    def create(cls, tree: Any, *, allocate: bool = True) -> PytreeValue:
        """A value holding ``tree`` (with ``allocate=False``: its structure only, holding nothing yet).

        Raises:
          InvalidTypeError: a leaf of ``tree`` is not an array.
        """
        leaves, structure, avals = _flatten(tree, "PytreeValue.create")
        # A weakly typed leaf (`jnp.full(..., 0.0)`) comes back strongly typed from any jitted step: jit would
        # trace the first step twice. Made strong once, here.
        leaves = [jnp.asarray(x, x.dtype) if getattr(x, "weak_type", False) else x for x in leaves]
        return cls(
            leaves=tuple(leaves) if allocate else None,
            staged=None,
            host_copy=None,
            structure=structure,
            avals=avals,
            status=RESIDENT if allocate else UNALLOCATED,
            recompute_source=None,
            recompute_cost=float("inf"),
        )

    @property
    def treedef(self) -> Any:
        """The tree's ``PyTreeDef``."""
        return _treedef(self.structure)

    def _check_payload(self, payload: Any) -> None:
        self._checked_leaves(payload, "PytreeValue.commit")

    def _checked_leaves(self, payload: Any, what: str) -> list[Any]:
        leaves, structure, avals = _flatten(payload, what)
        if structure != self.structure:
            expected, got = _paths(jax.tree_util.tree_unflatten(self.treedef, [0] * len(self.avals))), _paths(payload)
            first = next((f"{e} vs {g}" for e, g in zip(expected, got) if e != g), None)
            where = f"first differing key path: {first}" if first else f"{len(got)} leaves vs {len(expected)}"
            raise StateShapeError(
                f"`{what}`: the tree's structure differs from the one this value was created with ({where}); "
                f"expected {self.treedef}, got {jax.tree_util.tree_structure(payload)}. Commit a tree of the same "
                f"structure, or create a new PytreeValue."
            )
        if avals != self.avals:
            i = next(i for i, (a, b) in enumerate(zip(avals, self.avals)) if a != b)
            raise StateShapeError(
                f"`{what}`: the leaf at {_paths(payload)[i] or 'the root'} is {_aval_str(avals[i])}, expected "
                f"{_aval_str(self.avals[i])} (a commit never changes a leaf's shape or dtype, so a step never "
                f"recompiles)."
            )
        return leaves

    def _commit_payload(self, payload: Any) -> PytreeValue:
        return self._replace(leaves=tuple(jax.tree_util.tree_leaves(payload)))

    def _committed_view(self) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def _view_with(self, payload: Any) -> Any:
        return payload

    def _allocated_storage(self) -> dict[str, Any]:
        return {"leaves": tuple(jnp.zeros(shape, dtype) for shape, dtype in self.avals)}

    def _released_storage(self) -> dict[str, Any]:
        return {"leaves": None}

    def _committed_roots(self) -> Any:
        return self.leaves

    def _parkable_fields(self) -> dict[str, Any]:
        return {"leaves": self.leaves}

    def __len__(self) -> int:
        """Leaves of the tree."""
        return len(self.avals)

    def __repr__(self) -> str:
        kind = self.structure[0].rpartition(":")[2] if self.structure != _LEAF else "array"
        parts = [f"{kind}", f"leaves={short(self.leaves)}" if self.leaves is not None else f"leaves={len(self.avals)}"]
        parts.append(f"status={self.status!r}")
        if self.staged is not None:
            parts.append("staged=...")
        return f"PytreeValue({', '.join(parts)})"


def _aval_str(aval: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = aval
    short_dtype = {"float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64", "bfloat16": "bf16"}
    return f"{short_dtype.get(dtype, dtype)}[{','.join(map(str, shape))}]"


def check_layout(value: Any, template: PytreeValue, what: str) -> None:
    """Raise unless ``value`` is a PytreeValue with ``template``'s structure and leaf shapes and dtypes."""
    if not isinstance(value, PytreeValue):
        raise InvalidTypeError(f"`{what}`: expected a PytreeValue, got {type(value).__name__}.")
    if value.structure != template.structure or value.avals != template.avals:
        raise InvalidArgumentError(
            f"`{what}`: the session's cache has another layout than the model's ({len(value.avals)} leaves vs "
            f"{len(template.avals)}); it was not made by this model. Drop it, or `begin` the session anew."
        )
