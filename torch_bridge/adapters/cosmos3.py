"""`Cosmos3StateAdapter`: per-session encode-once UND K/V and GEN M-RoPE tables over the functional core.

Each (CFG branch, layer) pair is one `StateObject` holding that layer's fixed ``(K, V)``, written once and
reread at every denoising step; the branch's ``(cos, sin)`` tables are stored beside them. Ownership moves
by reference: nothing is cloned. Tensors go through `torch_bridge.wrap`: a JAX alias where DLPack allows,
and otherwise (K/V are usually trimmed slices of padded allocations, with strides JAX cannot describe) the
torch tensor itself. Either way the accounting counts the whole padded allocation, once.

Sessions isolate requests: two requests with distinct ids never see each other's K/V, from any thread.
`request_session` drops the session when the request ends, so completed requests never accumulate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from functional_state import LatentBuffer, SessionState, SessionStateError, SessionStateManager

from ..bridge import unwrap, wrap

__all__ = ["BranchStateError", "Cosmos3StateAdapter", "request_session"]


class BranchStateError(SessionStateError, RuntimeError):
    """A CFG branch is missing, half stored, or was given incomplete tensors."""


def _branch(is_negative: bool) -> str:
    return "uncond" if is_negative else "cond"


def _kv_name(branch: str, layer: int) -> str:
    return f"und_kv/{branch}/{layer:04d}"


def _freqs_name(branch: str) -> str:
    return f"freqs_gen/{branch}"


def _layers_attr(branch: str) -> str:
    return f"num_layers/{branch}"


def _slot(value: Any) -> LatentBuffer:
    """A one-item buffer holding ``value``: the fixed, written-once content of one state object."""
    return LatentBuffer.create(maxlen=1).commit(value)


def _describe(value: Any) -> str:
    """What a caller passed, for an error message: a tensor's shape and dtype, a sequence's length."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"{type(value).__name__} {value!r:.60}"


def _tensor_like(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, {t.dtype}, {t.device}"


def _check_pair(pair: Any, what: str, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair`` as two torch tensors of one dtype on one device, or `BranchStateError` naming what is wrong."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise BranchStateError(
            f"{what} must be a ({names[0]}, {names[1]}) pair of torch tensors, got {_describe(pair)}."
        )
    for name, t in zip(names, pair):
        if not isinstance(t, torch.Tensor):
            raise BranchStateError(f"{what}: {name} must be a torch tensor, got {_describe(t)}.")
    a, b = pair
    if a.dtype != b.dtype or a.device != b.device:
        raise BranchStateError(
            f"{what}: {names[0]} ({_tensor_like(a)}) and {names[1]} ({_tensor_like(b)}) must share a dtype and a "
            f"device."
        )
    return a, b


def _check_kv(cached_kv: Any, what: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``cached_kv`` as per-layer (K, V) pairs that agree across layers (every layer's K like layer 0's K in
    shape, dtype and device, and V like layer 0's V), or `BranchStateError` saying what was expected and got."""
    if isinstance(cached_kv, torch.Tensor):
        raise BranchStateError(
            f"{what}: cached_kv must be a non-empty list of per-layer (K, V) pairs of torch tensors, got one "
            f"stacked tensor ({_describe(cached_kv)}). Split it into one (K, V) pair per layer. Nothing was stored."
        )
    if not isinstance(cached_kv, (list, tuple)) or not cached_kv:
        raise BranchStateError(
            f"{what}: cached_kv must be a non-empty list of per-layer (K, V) pairs of torch tensors, got "
            f"{_describe(cached_kv)}. Nothing was stored."
        )
    pairs = [_check_pair(p, f"{what}: cached_kv[{i}]", ("K", "V")) for i, p in enumerate(cached_kv)]
    k0, v0 = pairs[0]
    for i, (k, v) in enumerate(pairs[1:], start=1):
        for name, t, t0 in (("K", k, k0), ("V", v, v0)):
            if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
                raise BranchStateError(
                    f"{what}: cached_kv[{i}] {name} has {_tensor_like(t)} but layer 0's {name} has "
                    f"{_tensor_like(t0)}; every layer's K/V must match layer 0 in shape, dtype and device. "
                    f"Nothing was stored."
                )
    return pairs


def _check_freqs(freqs_gen: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _check_pair(freqs_gen, f"{what}: freqs_gen", ("cos", "sin"))
    if cos.shape != sin.shape:
        raise BranchStateError(
            f"{what}: freqs_gen cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; the (cos, sin) "
            f"tables must have one shape."
        )
    return cos, sin


class Cosmos3StateAdapter:
    """Cosmos3's cond/uncond conditioning cache, one manager session per request.

    Example:
      >>> from torch_bridge.harness.cosmos3_bespoke import Cosmos3Shapes, encode_und_kv, build_freqs_gen
      >>> shapes = Cosmos3Shapes(num_layers=2)
      >>> state = Cosmos3StateAdapter("req-1", SessionStateManager())
      >>> kv, freqs = encode_und_kv(shapes, seed=0), build_freqs_gen(shapes)
      >>> state.set_branch(False, kv, freqs)
      >>> got_kv, (cos, sin) = state.get_branch(False)
      >>> got_kv[0][0] is kv[0][0], state.is_branch_initialized(True)
      (True, False)
    """

    def __init__(self, session_id: str | None, manager: SessionStateManager):
        self._session = manager.get_or_create_session(session_id)

    @property
    def session_id(self) -> str:
        return self._session.session_id

    def _stored_layers(self, s: SessionState, branch: str) -> tuple[int | None, list[bool], bool]:
        expected = s.get_attr(_layers_attr(branch), None)
        prefix = f"und_kv/{branch}/"
        slots = [s.get(n) for n in s.names if n.startswith(prefix)]
        layers = [slot.resident and len(slot) == 1 for slot in slots]
        freqs = s.get(_freqs_name(branch), None)
        has_freqs = freqs is not None and freqs.resident and len(freqs) == 1
        return expected, layers, has_freqs

    def _status(self, s: SessionState, is_negative: bool) -> bool:
        """True when the branch is complete, False when nothing of it is stored; raises when partial."""
        branch = _branch(is_negative)
        expected, layers, has_freqs = self._stored_layers(s, branch)
        if expected is None and not layers and not has_freqs:
            return False
        if expected is not None and len(layers) == expected and all(layers) and has_freqs:
            return True
        raise BranchStateError(
            f"session {self.session_id!r}: the {branch} branch is only partly stored ({sum(layers)} of "
            f"{expected} layers resident, freqs_gen {'present' if has_freqs else 'missing'}), e.g. after a "
            f"layer was evicted. Its K/V cannot be trusted: call `reset()` and capture it again."
        )

    def is_branch_initialized(self, is_negative: bool) -> bool:
        """Whether the branch's K/V and freqs are stored.

        Raises:
          BranchStateError: the branch is partly stored.
        """
        return self._status(self._session.state, is_negative)

    def set_branch(
        self,
        is_negative: bool,
        cached_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        freqs_gen: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Store a branch (replacing any stored one), by reference, in one atomic update.

        Raises:
          BranchStateError: ``cached_kv`` is not a non-empty list of per-layer (K, V) tensor pairs (one stacked
            tensor, a pair of another length, a non-tensor, K and V of different dtypes or devices, layers that
            differ in shape, dtype or device), or ``freqs_gen`` is not a (cos, sin) pair of one shape and dtype.
            Nothing is written then.
        """
        self._store_branch(is_negative, cached_kv, freqs_gen, "`set_branch`")

    def _store_branch(self, is_negative: bool, cached_kv: Any, freqs_gen: Any, what: str) -> None:
        pairs = _check_kv(cached_kv, what)
        cos, sin = _check_freqs(freqs_gen, what)
        branch = _branch(is_negative)
        objects = {_kv_name(branch, i): _slot((wrap(k), wrap(v))) for i, (k, v) in enumerate(pairs)}
        objects[_freqs_name(branch)] = _slot((wrap(cos), wrap(sin)))

        def write(s: SessionState) -> SessionState:
            for name in s.names:
                if name.startswith(f"und_kv/{branch}/") and name not in objects:
                    s = s.remove(name)  # a replaced branch may have had more layers
            for name, obj in objects.items():
                s = s.put(name, obj)
            return s.set_attr(_layers_attr(branch), len(pairs))

        self._session.transact(write)

    def get_branch(
        self, is_negative: bool
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]] | None:
        """``(cached_kv, (cos, sin))`` as torch tensors over the stored storage, or None when not stored.

        Raises:
          BranchStateError: the branch is partly stored.
        """
        s = self._session.state
        if not self._status(s, is_negative):
            return None
        branch = _branch(is_negative)
        n = s.get_attr(_layers_attr(branch))
        kv = [tuple(unwrap(t) for t in s.get(_kv_name(branch, i)).view()[0]) for i in range(n)]
        cos, sin = (unwrap(t) for t in s.get(_freqs_name(branch)).view()[0])
        return kv, (cos, sin)

    def load_into_transformer(self, transformer: Any, is_negative: bool) -> None:
        """Point ``transformer.cached_kv`` and ``transformer.freqs_gen`` at the stored branch.

        Raises:
          BranchStateError: the branch is not stored, or only partly.
        """
        got = self.get_branch(is_negative)
        if got is None:
            raise BranchStateError(
                f"`load_into_transformer`: session {self.session_id!r} has no {_branch(is_negative)} branch; "
                f"encode it and call `capture_from_transformer` first."
            )
        transformer.cached_kv, transformer.freqs_gen = got

    def capture_from_transformer(self, transformer: Any, is_negative: bool) -> bool:
        """Store the transformer's current K/V and freqs as this branch, once.

        Returns:
          True if stored now, False if the branch was already stored (a no-op: encode-once).

        Raises:
          BranchStateError: the transformer holds no K/V or no freqs, or holds them in another form than
            `set_branch` accepts (e.g. one stacked tensor instead of per-layer (K, V) pairs); nothing is written.
        """
        if self.is_branch_initialized(is_negative):
            return False
        kv = getattr(transformer, "cached_kv", None)
        freqs = getattr(transformer, "freqs_gen", None)
        # No truth test on the fields: a tensor there (one stacked K/V) has no truth value; `_check_kv` names it.
        kv_absent = kv is None or (isinstance(kv, (list, tuple)) and not kv)
        if kv_absent or freqs is None:
            missing = [name for name, absent in (("cached_kv", kv_absent), ("freqs_gen", freqs is None)) if absent]
            raise BranchStateError(
                f"`capture_from_transformer`: the transformer holds no {' and no '.join(missing)}; run the UND encode for the "
                f"{_branch(is_negative)} branch first. Nothing was stored."
            )
        self._store_branch(is_negative, kv, freqs, "`capture_from_transformer`")
        return True

    def reset(self) -> None:
        """Forget both branches."""

        def clear(s: SessionState) -> SessionState:
            for name in s.names:
                if name.startswith(("und_kv/", "freqs_gen/")):
                    s = s.remove(name)
            for branch in ("cond", "uncond"):
                s = s.del_attr(_layers_attr(branch))
            return s

        self._session.transact(clear)

    def __repr__(self) -> str:
        return f"Cosmos3StateAdapter({self.session_id!r})"


@contextlib.contextmanager
def request_session(manager: SessionStateManager, request_id: str) -> Iterator[Cosmos3StateAdapter]:
    """A `Cosmos3StateAdapter` for one request; its session is dropped when the block exits, also on error.

    Example:
      >>> manager = SessionStateManager()
      >>> with request_session(manager, "req-7") as state:
      ...     "req-7" in manager
      True
      >>> "req-7" in manager
      False
    """
    with manager.pin(request_id):  # a byte budget never releases a request in flight
        adapter = Cosmos3StateAdapter(request_id, manager)
        try:
            yield adapter
        finally:
            manager.drop_session(request_id)
