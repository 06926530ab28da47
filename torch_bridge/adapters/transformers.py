"""Per-session caches of a Hugging Face transformers causal LM, held in a `SessionStateManager`.

Needs the ``[transformers]`` extra. Each session's K/V is one `DenseValue` (``name``, default ``"kv"``) of the
very tensors the model's cache holds, stamped with the model's layout: begin, step (one token or many), fork
(beams, branches), park and restore, checkpoints, the move to another process (`SessionBlob`), and a batched step of several `StaticCache` sessions, with
no glue. A `DynamicCache` grows by ``torch.cat`` (new tensors each step, so forks share nothing written); a
`StaticCache` is written in place, through `SessionHandle.writable`, so a fork stays a snapshot.

Example:
  >>> import torch, transformers
  >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
  <...>
  >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
  ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
  >>> caches = SessionCaches(transformers.LlamaForCausalLM(config).eval())
  >>> logits = caches.begin("a", torch.tensor([[1, 2, 3]]))
  >>> caches.fork("a", "b")
  >>> logits = caches.step("b", logits[:, -1:].argmax(-1))
  >>> caches.length("a"), caches.length("b"), tuple(logits.shape)
  (3, 4, (1, 1, 32))
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from functional_state import DenseValue, InvalidArgumentError, SessionExistsError, SessionStateManager
from functional_state.transfer import SessionBlob, export_session, read_blob

from .transformers_layout import (
    BatchRows,
    CacheLayout,
    CacheLayoutError,
    CheckedTensors,
    ModelMismatchError,
    TokenShapeError,
)
from .transformers_layout import cache_kwarg as find_cache_kwarg

__all__ = ["CacheLayoutError", "ModelMismatchError", "SessionCaches", "TokenShapeError"]

STAMP = "transformers/cache"  # the session attr naming the layout its cache was made for
_TOKEN_DTYPES = frozenset({torch.int32, torch.int64})  # what an embedding takes as indices


class SessionCaches:
    """Each session's cache of one transformers causal LM, in ``manager`` (a new one if not given).

    Args:
      model: a transformers causal LM (``model(input_ids=..., past_key_values=cache)``), in eval mode.
      manager: the manager holding the sessions.
      cache: ``"dynamic"`` (a `DynamicCache`, growing) or ``"static"`` (a `StaticCache` of
        ``max_cache_len`` positions, written in place; several sessions step in one batched call).
      max_cache_len: the `StaticCache` length.
      name: the object name of the cache in each session.
      cache_kwarg: the forward argument taking the cache; found in ``model.forward``'s signature if not
        given (``past_key_values``, or a later spelling of it).

    Different sessions may be stepped from different threads; one session is stepped by one thread at a
    time (two concurrent steps of one session would both start from the same cache).

    Raises:
      CacheLayoutError: an unknown ``cache``, a static cache without ``max_cache_len``, a model whose layers
        are not all full attention, or a forward with no cache argument.
    """

    def __init__(
        self,
        model: Any,
        manager: SessionStateManager | None = None,
        *,
        cache: str = "dynamic",
        max_cache_len: int | None = None,
        name: str = "kv",
        cache_kwarg: str | None = None,
    ):
        self.model = model
        self.manager = manager if manager is not None else SessionStateManager()
        self.layout = CacheLayout.of(model, cache, max_cache_len)
        self._stamp = self.layout.stamp  # (formatted once: compared at every step)
        self.name = name
        self.cache_kwarg = cache_kwarg or find_cache_kwarg(model)
        self._batch: BatchRows | None = None
        self._checked = CheckedTensors()  # (dict writes are atomic: threads stepping other sessions share it)
        self._batch_lock = threading.Lock()

    def release_batch(self) -> int:
        """Free the batch buffer `step_many` keeps (outside the manager's accounting); returns its bytes."""
        with self._batch_lock:
            freed, self._batch = (self._batch.nbytes if self._batch else 0), None
        return freed

    # --- sessions ---------------------------------------------------------------------------------------
    def begin(self, session_id: str, input_ids: torch.Tensor | None = None, *, cache: Any = None) -> Any:
        """Start session ``session_id``: from ``cache`` (a transformers cache this model filled, of batch 1: a
        DynamicCache's tensors adopted without a copy, a StaticCache's stacked once) or empty, then run ``input_ids`` (the prompt, shape ``(1, n)``) if given.

        Returns:
          The logits of ``input_ids`` (shape ``(1, n, vocab)``), or None without them.

        Raises:
          SessionExistsError: the session already holds this cache (`end` it first).
          CacheLayoutError: ``cache`` is another model's (layer count, heads, kind, dtype, device).
          TokenShapeError: ``input_ids`` is not ``(1, n)`` integer tokens, or overflows a StaticCache.
          Nothing is created on any error.
        """
        what = f"`SessionCaches.begin({session_id!r})`"
        flat = self.layout.empty() if cache is None else self.layout.flat(cache, what)
        self.layout.check(flat, what)  # one row: a session is one sequence
        if input_ids is not None:
            self._check_tokens(input_ids, 1, [self.layout.length(flat)], what)
        existed = session_id in self.manager
        h = self.manager.get_or_create_session(session_id)
        if self.name in h.state:
            raise SessionExistsError(f"{what}: the session already holds {self.name!r}; `end` it first to start over.")
        try:
            h.transact(lambda s: s.put(self.name, DenseValue.create(flat)).set_attr(STAMP, self._stamp))
        except BaseException:
            if not existed:
                self.manager.drop_session(session_id)
            raise
        return None if input_ids is None else self.step(session_id, input_ids)

    def step(self, session_id: str, input_ids: torch.Tensor) -> Any:
        """Run the model on ``input_ids`` (shape ``(1, n)``: one token or several) with the session's cache,
        restored first if parked; the cache grows by ``n`` positions.

        Returns:
          The logits, shape ``(1, n, vocab)``.

        Raises:
          SessionStateLostError: no such session. ObjectNotFoundError: the session was never begun.
          ModelMismatchError: another model's session. TokenShapeError: tokens of the wrong shape or
          dtype, or more than a StaticCache has room for. Nothing is changed on any of these.
        """
        what = f"`SessionCaches.step({session_id!r})`"
        h, flat = self._resident(session_id, what, write_checked=True)
        self._check_tokens(input_ids, 1, [self.layout.length(flat)], what)
        if self.layout.kind == "static":
            flat = h.writable(self.name)  # a fork's shared storages copied first: it stays a snapshot
        cache = self.layout.cache_over(flat)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, use_cache=True, **{self.cache_kwarg: cache})
        after = self.layout.after(cache, flat)
        h.commit(self.name, after)
        self._checked.record(session_id, after)  # (the model's own tensors for this layout)
        return out.logits

    def step_many(self, session_ids: Sequence[str], input_ids: torch.Tensor) -> Any:
        """Step several StaticCache sessions of one length in one batched call; row ``i`` of ``input_ids``
        (shape ``(len(session_ids), n)``) is session ``session_ids[i]``'s.

        The sessions' caches are rows of one batch buffer the adapter keeps (`BatchRows`): a row is copied in
        only when its session changed since the last batched step, and only the ``n`` new positions are
        written back. Batched matmuls may round differently from single ones in the last bits.

        Returns:
          The logits, shape ``(len(session_ids), n, vocab)``.

        Raises:
          InvalidArgumentError: a DynamicCache, no ids or a repeated id.
          TokenShapeError: the sessions' lengths differ, or tokens of the wrong shape; and as `step`.
          Nothing is changed on any of these.
        """
        ids = list(session_ids)
        what = f"`SessionCaches.step_many({ids!r})`"
        if self.layout.kind != "static":
            raise InvalidArgumentError(
                f"{what}: batched steps need cache='static' (a DynamicCache's rows differ in length)."
            )
        if not ids or len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"{what}: session_ids must be distinct and non-empty.")
        resident = [self._resident(sid, what, write_checked=True) for sid in ids]
        lengths = [self.layout.length(flat) for _, flat in resident]
        self._check_tokens(input_ids, len(ids), lengths, what)
        flats = [h.writable(self.name) for h, _ in resident]
        n, start = input_ids.shape[1], lengths[0]
        with self._batch_lock:  # one batched call at a time runs on the kept buffer
            if self._batch is None or len(self._batch.marks) != len(ids):
                self._batch = BatchRows(self.layout, len(ids))
            cache = self._batch.gather(ids, flats, start)
            with torch.no_grad():
                out = self.model(input_ids=input_ids, use_cache=True, **{self.cache_kwarg: cache})
                self._batch.scatter(ids, flats, start, n)
        for sid, (h, _), flat in zip(ids, resident, flats):
            h.commit(self.name, flat)
            self._checked.record(sid, flat)  # (written by this layout's model, at its new versions)
        return out.logits

    def fork(self, source_id: str, new_id: str) -> None:
        """Fork session ``source_id`` as ``new_id`` (a beam, a branch), sharing its tensors until one writes."""
        self.manager.fork_session(source_id, new_id)

    def park(self, session_id: str, *, with_sharers: bool = False, copy: bool = False) -> dict[str, int]:
        """Move the session's cache to host memory (see `SessionStateManager.park`); `step` restores it. On the
        CPU the cache's own tensors are the host copy (no copy) unless ``copy``."""
        return self.manager.park(session_id, self.name, with_sharers=with_sharers, copy=copy)

    def restore(self, session_id: str) -> dict[str, int]:
        """Bring a parked cache back where it was, bit for bit."""
        return self.manager.restore(session_id, self.name)

    def save(self, session_id: str, path: Any) -> None:
        """Checkpoint the session (its cache and its layout stamp) at ``path``."""
        self.manager.save_session(session_id, path)

    def load(self, session_id: str, path: Any, *, as_id: str | None = None) -> None:
        """Load a session `save` wrote, checked to be this model's (it is dropped again if not).

        Raises:
          CheckpointError: no such checkpoint. ModelMismatchError, CacheLayoutError: another model's session.
        """
        h = self.manager.load_session(session_id, path, as_id=as_id)
        try:
            self._resident(h.session_id, f"`SessionCaches.load({session_id!r})`")
        except BaseException:
            self.manager.drop_session(h.session_id)
            raise

    def export_session(self, session_id: str) -> SessionBlob:
        """Session ``session_id`` (its cache, parked or not, and its layout stamp) as a `SessionBlob` to move to
        another process (`functional_state.transfer.export_session`); the session stays here, unchanged.

        A DynamicCache session's buffers are views of its tensors (a step makes new ones and never writes
        these again); a StaticCache session's are copied, since its next step writes its cache in place.

        Raises:
          SessionStateLostError: no such session. ModelMismatchError: another model's session.

        Example:
          >>> import torch, transformers
          >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
          ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
          >>> model = transformers.LlamaForCausalLM(config).eval()
          >>> here, there = SessionCaches(model), SessionCaches(model)
          >>> _ = here.begin("a", torch.tensor([[1, 2, 3]]))
          >>> blob = here.export_session("a")  # send blob.manifest_bytes() and blob.buffers
          >>> there.import_session(blob), there.length("a"), blob.nbytes
          ('a', 3, 768)
        """
        what = f"`SessionCaches.export_session({session_id!r})`"
        self._check_stamp(self.manager.get_session(session_id).get_attr(STAMP, None), what)
        blob = export_session(self.manager.state, session_id)
        if self.layout.kind == "static":
            return SessionBlob(blob.manifest, tuple(b.copy() for b in blob.buffers))
        return blob

    def import_session(self, blob: SessionBlob, *, as_id: str | None = None) -> str:
        """Install the session ``blob`` carries (`export_session`, maybe of another process) under its own id
        or ``as_id``, once the blob passed every check of `functional_state.transfer.import_session` and its
        cache is this model's; returns the session's id here. A parked session arrives parked.

        Raises:
          TransferError: a truncated, damaged or tampered-with blob. SessionExistsError: the id is taken.
          ModelMismatchError: another model's (or cache kind's) session. CacheLayoutError: its tensors are not
          this layout's. Nothing changes on any of these.
        """
        what = "`SessionCaches.import_session`"
        sid, session = read_blob(blob, free_in=self.manager.state if as_id is None else None)
        self._check_stamp(session.get_attr(STAMP, None), what)
        obj = session.get(self.name, None)
        if not isinstance(obj, DenseValue):
            raise CacheLayoutError(
                f"{what}: the session holds no cache named {self.name!r}; it is not a SessionCaches session."
            )
        if not obj.parked:  # (a parked cache's tensors are checked when a step restores them)
            self.layout.check(obj.view(), what)
        target = sid if as_id is None else as_id
        self.manager.install_session(target, session)
        return target

    def end(self, session_id: str) -> bool:
        """Drop the session; True if it was there."""
        self._checked.forget(session_id)
        return self.manager.drop_session(session_id)

    def length(self, session_id: str) -> int:
        """Tokens in the session's cache."""
        return self.layout.length(self._resident(session_id, f"`SessionCaches.length({session_id!r})`")[1])

    # --- checks -----------------------------------------------------------------------------------------
    def _resident(
        self, session_id: str, what: str, *, write_checked: bool = False
    ) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """The session's handle and tensors, checked to be this model's, restored if parked.

        ``write_checked``: the caller writes the object next (`commit`, `writable`), and that write checks the
        tensors for in-place writes to storages something else shares (`SharedStorageWrittenError`, before
        anything lands); the read takes them from the session's snapshot without checking them a first time.
        """
        h = self.manager.get_session(session_id)
        session = h.state  # (one snapshot: the stamp and the cache read from the same session)
        self._check_stamp(session.get_attr(STAMP, None), what)
        obj = session.get(self.name, None) if write_checked else None
        # A parked cache is restored (and an absent one refused) by the handle's read.
        flat = obj.view() if isinstance(obj, DenseValue) and obj.resident else h.view(self.name)
        if not self._checked.known(session_id, flat):  # (checked once, not at every step)
            self.layout.check(flat, what)
            self._checked.record(session_id, flat)
        return h, flat

    def _check_stamp(self, stamp: Any, what: str) -> None:
        if stamp != self._stamp:
            raise ModelMismatchError(
                f"{what}: the session's cache was made for {stamp or 'no model (it has no stamp)'}; this one is "
                f"{self.layout.stamp}. Use the SessionCaches of its own model."
            )

    def _check_tokens(self, input_ids: Any, rows: int, lengths: list[int], what: str) -> None:
        shape = input_ids.shape if isinstance(input_ids, torch.Tensor) else ()
        if len(shape) != 2 or shape[0] != rows or shape[1] < 1 or input_ids.dtype not in _TOKEN_DTYPES:
            got = (
                f"{input_ids.dtype} {list(input_ids.shape)}"
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
            raise TokenShapeError(
                f"{what}: input_ids must be int64 or int32 tokens of shape [{rows}, n >= 1], got {got}."
            )
        if len(set(lengths)) > 1:
            raise TokenShapeError(
                f"{what}: the sessions hold {lengths} tokens; a batched step needs one length (the cache has one "
                f"position counter). Group sessions by `length`."
            )
        room = self.layout.max_len
        if room is not None and lengths[0] + shape[1] > room:
            raise TokenShapeError(
                f"{what}: {shape[1]} token(s) after {lengths[0]} overflow the StaticCache of {room}; "
                f"make it longer (max_cache_len) or end the session."
            )
