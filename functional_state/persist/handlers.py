"""The orbax type handler for a checkpoint's byte leaves (torch storages and numpy arrays as raw bytes): written
from the buffers the writer hands over, without a copy of its own, and read straight into the aligned buffers a
load asks for.

orbax's own `NumpyHandler` deep-copies every host array before it writes (a 607 MiB session: one more copy into
fresh memory, 170 ms of CPU), although the writer already owns what it passes (an asynchronous save copied every
buffer a model could change; a synchronous one returns after the write), and it reads each array into a buffer
of tensorstore's, which a load then had to copy into memory JAX can alias. Registered for ``np.ndarray`` in the
one registry the checkpoint's arrays use (`registry`); the format on disk is orbax's, unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

import numpy as np

from .directory import import_orbax


@functools.cache
def _types() -> tuple[type, type]:
    """``(handler class, restore-args class)``, defined once orbax is imported (it is an optional extra)."""
    ocp = import_orbax()
    import tensorstore as ts

    @dataclasses.dataclass
    class ReadInto(ocp.RestoreArgs):  # type: ignore[name-defined]
        """Restore a byte leaf into ``out`` (a writable 1-D uint8 array of its size) instead of new memory."""

        out: np.ndarray | None = None

    class ByteLeaves(ocp.type_handlers.NumpyHandler):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__(deepcopy_host_arrays=False)

        async def deserialize(self, infos: Any, args: Any = None) -> list[np.ndarray]:
            args = list(args or [ocp.RestoreArgs()] * len(infos))
            if not any(isinstance(a, ReadInto) and a.out is not None for a in args):
                return list(await super().deserialize(infos, args))
            opened = []
            for info in infos:
                await info.await_path_creation()
                spec = ocp.type_handlers.get_json_tspec_read(
                    info,
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    metadata_key=self._metadata_key,
                    raise_array_data_missing_error=info.raise_array_data_missing_error,
                )
                opened.append(ts.open(ts.Spec(spec), open=True, context=info.ts_context))
            stores = await asyncio.gather(*opened)

            async def read(store: Any, arg: Any) -> np.ndarray:
                out = arg.out if isinstance(arg, ReadInto) else None
                # A buffer of another size or type than the stored array (a damaged manifest): new memory, and
                # the checksum then refuses the leaf.
                if out is None or out.shape != tuple(store.shape) or out.dtype != store.dtype.numpy_dtype:
                    return np.asarray(await store.read())
                await ts.array(out, copy=False, write=True).write(store)
                return out

            return list(await asyncio.gather(*[read(s, a) for s, a in zip(stores, args)]))

    return ByteLeaves, ReadInto


def read_into(out: np.ndarray) -> Any:
    """The restore args that read a byte leaf into ``out``."""
    return _types()[1](restore_type=np.ndarray, out=out)


def registry() -> Any:
    """The type handlers of a checkpoint's arrays: byte leaves through `ByteLeaves`, JAX arrays through orbax's
    registered handler."""
    ocp = import_orbax()
    import jax

    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, _types()[0]()), (jax.Array, ocp.type_handlers.get_type_handler(jax.Array))
    )
