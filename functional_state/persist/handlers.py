"""The orbax type handler for a checkpoint's byte leaves (torch storages and numpy arrays as raw bytes): written
from the buffers the writer hands over, without a copy of its own, and read straight into the aligned buffers a
load asks for.

orbax's own `NumpyHandler` deep-copies every host array before it writes (a 607 MiB session: one more copy into
fresh memory, 170 ms of CPU), although the writer already owns what it passes (an asynchronous save copied every
buffer a model could change; a synchronous one returns after the write), and it reads each array into a buffer
of tensorstore's, which a load then had to copy into memory JAX can alias. Registered for ``np.ndarray`` in the
one registry the checkpoint's arrays use (`registry`); the format on disk is orbax's, unchanged. A save's byte
leaves are written in one tensorstore transaction (one OCDBT commit). A leaf stored as one raw chunk is read
from its data file by us, straight into the load's buffer (persist/direct.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Any

import numpy as np

from .direct import DirectReads, errors_deferred, plan_direct, read_direct


def import_orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - the checkpoint extra is missing
        raise ImportError(
            "functional_state checkpoints need orbax-checkpoint: pip install 'functional-state[checkpoint]'"
        ) from e
    return ocp


@functools.cache
def supported() -> bool:
    """Whether this orbax offers what `ByteLeaves` builds on: a `NumpyHandler` that saves without a copy
    (``deepcopy_host_arrays``) and the read-side `ParamInfo` of 0.12. With an older orbax (0.11) byte leaves
    go through orbax's own handler instead: one copy more each way, the same format on disk."""
    ocp = import_orbax()
    info = ocp.type_handlers.ParamInfo
    names = {*dir(info), *inspect.signature(info).parameters}  # (fields and methods, whatever defines them)
    return (
        "deepcopy_host_arrays" in inspect.signature(ocp.type_handlers.NumpyHandler.__init__).parameters
        and {
            "await_path_creation",
            "is_ocdbt_checkpoint",
            "raise_array_data_missing_error",
            "ts_context",
        }
        <= names
    )


@functools.cache
def _types() -> tuple[type, type]:
    """``(handler class, restore-args class)``, defined once orbax is imported (it is an optional extra)."""
    ocp = import_orbax()
    import tensorstore as ts

    @dataclasses.dataclass
    class ReadInto(ocp.RestoreArgs):  # type: ignore[name-defined]
        """Restore a byte leaf into ``out`` (a writable 1-D uint8 array of its size) instead of new memory; the
        direct reads of a load are counted in its ``reads`` (`DirectReads`)."""

        out: np.ndarray | None = None
        reads: Any = None

    class ByteLeaves(ocp.type_handlers.NumpyHandler):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__(deepcopy_host_arrays=False)

        async def _background_serialize(self, values: Any, infos: Any, args: Any = None) -> None:
            # Every byte leaf of the save in one tensorstore transaction, committed once (`_WRITE_TXN`).
            txn = ts.Transaction()
            token = _WRITE_TXN.set(txn)
            try:
                await super()._background_serialize(values, infos, args)
            finally:
                _WRITE_TXN.reset(token)
            await txn.commit_async()

        async def _open_and_write(self, value: np.ndarray, tspec: dict[str, Any], ts_context: Any) -> None:
            txn = _WRITE_TXN.get()
            if txn is None:
                return await super()._open_and_write(value, tspec, ts_context)
            store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context, transaction=txn)
            await store.write(value, can_reference_source_data_indefinitely=True)

        async def deserialize(self, infos: Any, args: Any = None) -> list[Any]:
            return await errors_deferred(self._deserialize, infos, args)

        async def _deserialize(self, infos: Any, args: Any = None) -> list[np.ndarray]:
            args = list(args or [ocp.RestoreArgs()] * len(infos))
            if not any(isinstance(a, ReadInto) and a.out is not None for a in args):
                return list(await super().deserialize(infos, args))
            specs = []
            for info in infos:
                await info.await_path_creation()
                specs.append(
                    ocp.type_handlers.get_json_tspec_read(
                        info,
                        use_ocdbt=info.is_ocdbt_checkpoint,
                        metadata_key=self._metadata_key,
                        raise_array_data_missing_error=info.raise_array_data_missing_error,
                    )
                )
            # A byte leaf stored as one raw chunk is read by us, straight from its data file into the load's
            # buffer (`plan_direct`); the others through tensorstore.
            # The threads are the load's own (`DirectReads`): a load that fails waits for its reads, not another's.
            reads = next((a.reads for a in args if isinstance(a, ReadInto) and a.reads is not None), None)
            group = reads if isinstance(reads, DirectReads) else DirectReads()
            direct = await group.run(plan_direct, specs, [getattr(a, "out", None) for a in args], group.databases)
            reading = group.run(read_direct, list(direct.values()))
            rest = [i for i in range(len(infos)) if i not in direct]

            async def read(store: Any, arg: Any) -> np.ndarray:
                out = arg.out if isinstance(arg, ReadInto) else None
                # A buffer of another size or type than the stored array (a damaged manifest): new memory, and
                # the checksum then refuses the leaf.
                if out is None or out.shape != tuple(store.shape) or out.dtype != store.dtype.numpy_dtype:
                    return np.asarray(await store.read())
                await ts.array(out, copy=False, write=True).write(store)
                return out

            results: list[Any] = [None] * len(infos)
            try:
                # Every read settles before this returns or raises (`_settled`): a damaged leaf fails its read
                # while the others still run, and a tensorstore future that completes after orbax has closed its
                # event loop calls back into the closed loop ("Event loop is closed", an unraisable exception).
                stores = await _settled(
                    [ts.open(ts.Spec(specs[i]), open=True, context=infos[i].ts_context) for i in rest]
                )
                for i, got in zip(rest, await _settled([read(s, args[i]) for s, i in zip(stores, rest)])):
                    results[i] = got
            except BaseException:
                # The same for our own reads: no thread writes into the load's buffers or calls back into
                # orbax's event loop after it is closed.
                with contextlib.suppress(Exception):
                    await reading
                raise
            await reading
            for i, entry in direct.items():
                results[i] = entry[0]
            return results

    return ByteLeaves, ReadInto


async def _settled(awaitables: list[Any]) -> list[Any]:
    """The results of ``awaitables``, run together; the first error is raised only once every one has settled
    (`asyncio.gather` raises the first at once and leaves the rest running)."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def read_into(out: np.ndarray, reads: DirectReads | None = None) -> Any:
    """The restore args that read a byte leaf into ``out`` (plain restore args where orbax is too old:
    the load then copies what orbax read into ``out``'s place); its direct reads are counted in ``reads``."""
    if not supported():
        return import_orbax().RestoreArgs(restore_type=np.ndarray)
    return _types()[1](restore_type=np.ndarray, out=out, reads=reads)


def registry() -> Any:
    """The type handlers of a checkpoint's arrays: byte leaves through `ByteLeaves`, JAX arrays through orbax's
    registered handler."""
    ocp = import_orbax()
    import jax

    leaves = _types()[0]() if supported() else ocp.type_handlers.NumpyHandler()
    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, leaves), (jax.Array, _deferring(ocp.type_handlers.get_type_handler(jax.Array)))
    )


# A save's byte leaves written in one transaction: orbax opens and writes each array on its own, and the OCDBT
# database commits what has arrived whenever its previous commit ends: a 607 MiB session was written as six
# commits one after another (each a data file, its fsync, a new manifest, its fsync, a rename and a directory
# fsync; strace of a save), the disk idle between them. One transaction is one commit: the same keys and
# values, the same format on disk, one version.
_WRITE_TXN: contextvars.ContextVar[Any] = contextvars.ContextVar("functional_state_write_txn", default=None)


def _deferring(handler: Any) -> Any:
    """``handler`` (orbax's JAX array handler) with its read errors deferred as `ByteLeaves`' are."""
    kind: Any = type(handler)
    deferring: Any = _deferring_type(kind)
    out: Any = object.__new__(deferring)
    out.__dict__.update(handler.__dict__)
    return out


@functools.cache
def _deferring_type(base: Any) -> type:
    class Deferring(base):
        async def deserialize(self, infos: Any, args: Any = None) -> list[Any]:
            return await errors_deferred(super().deserialize, infos, args)

    Deferring.__name__ = Deferring.__qualname__ = f"Deferring{base.__name__}"
    return Deferring
