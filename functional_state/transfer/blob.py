"""`SessionBlob`: one session in memory, in the checkpoint's own manifest form, its buffers as host bytes.

A blob is what moves a session between processes without a filesystem: a JSON-able manifest (the nodes a
checkpoint writes: objects with their status and ring positions, staged payloads, attrs, counters, torch
views and JAX aliases; each leaf with its XXH3-128 checksum; the whole sealed by its own checksum) plus one
contiguous uint8 buffer per leaf that has bytes, in the order ``manifest["transfer"]["buffers"]`` names.
Nothing in it is pickled: a receiver builds only what the manifest describes, after checking all of it
(`functional_state.transfer.import_session`). The buffers are plain numpy arrays, so Ray's object store
carries them without a copy of their own (``ray.put(blob.buffers)``; a ``ray.get`` on the same node reads
them in place, read-only, and an import builds its torch storages over them: copy-on-write).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ..errors import CheckpointError, TransferError
from ..persist.confined import check_depth, load_json

__all__ = ["TRANSFER", "SessionBlob"]

TRANSFER = "transfer"  # the manifest field a blob adds to a checkpoint manifest: session id, epoch, model, buffers


@dataclasses.dataclass(frozen=True)
class SessionBlob:
    """One exported session: ``manifest`` (JSON-able, sealed) and ``buffers`` (1-D uint8 arrays).

    Build one with `export_session`; send ``manifest`` and ``buffers`` any way that keeps bytes (Ray's object
    store, a socket) and rebuild it on the other side with ``SessionBlob(manifest, buffers)``.
    """

    manifest: dict[str, Any]
    buffers: tuple[np.ndarray, ...]

    def manifest_bytes(self) -> bytes:
        """The manifest as JSON text: what to send beside the buffers (a plain dict would be pickled by most
        transports, and a receiver unpickles nothing)."""
        return json.dumps(self.manifest, separators=(",", ":")).encode()

    @classmethod
    def from_parts(cls, manifest: bytes, buffers: Any) -> SessionBlob:
        """A blob from `manifest_bytes` and the buffers as received; parsed with the checkpoint's bounded JSON
        reader (a repeated key, a depth past the limit or text that is not JSON: `TransferError`). The rest is
        checked by `import_session`.

        Example:
          >>> b = SessionBlob({"format": "x"}, ())
          >>> SessionBlob.from_parts(b.manifest_bytes(), []).manifest
          {'format': 'x'}
        """
        try:
            parsed = load_json(manifest, "a transfer blob's manifest")
            check_depth(parsed, "a transfer blob's manifest")
        except CheckpointError as e:
            raise TransferError(str(e)) from e
        if not isinstance(parsed, dict):
            raise TransferError(f"a transfer blob's manifest is a JSON {type(parsed).__name__}, not an object.")
        return cls(parsed, tuple(buffers))

    @property
    def session_id(self) -> Any:
        """The id the session had where it was exported (as the manifest says: unchecked until imported)."""
        return self.manifest.get(TRANSFER, {}).get("session_id")

    @property
    def epoch(self) -> Any:
        """The ownership epoch it was exported at."""
        return self.manifest.get(TRANSFER, {}).get("epoch")

    @property
    def model(self) -> Any:
        """The model identity it carries (None when never named)."""
        return self.manifest.get(TRANSFER, {}).get("model")

    @property
    def nbytes(self) -> int:
        """Bytes in the buffers."""
        return sum(int(np.asarray(b).nbytes) for b in self.buffers)

    def __repr__(self) -> str:
        return (
            f"SessionBlob(session_id={self.session_id!r}, epoch={self.epoch!r}, model={self.model!r}, "
            f"buffers={len(self.buffers)}, nbytes={self.nbytes})"
        )
