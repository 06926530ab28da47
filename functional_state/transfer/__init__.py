"""Sessions across processes: transfer blobs, ownership epochs and the figures a router places sessions by.

The pure values a distributed deployment moves (Ray actors, Serve replicas): `export_session` /
`import_session` turn one session into a checksummed, pickle-free `SessionBlob` and back; `claim` and the
epoch checks fence a superseded owner; `checkpoint_info` reads a checkpoint's figures without loading it;
`placement` reports what a replica holds. `functional_state.serving` builds the Ray side on these.
"""

from ..persist.info import CheckpointInfo, SessionInfo, checkpoint_info
from ..table.ownership import EPOCH_ATTR, MODEL_ATTR, claim, claimed, epoch_of, model_of
from .blob import SessionBlob
from .exporting import export_session
from .importing import import_session, read_blob
from .placement import Placement, SessionFigures, placement

__all__ = [
    "EPOCH_ATTR",
    "MODEL_ATTR",
    "CheckpointInfo",
    "Placement",
    "SessionBlob",
    "SessionFigures",
    "SessionInfo",
    "checkpoint_info",
    "claim",
    "claimed",
    "epoch_of",
    "export_session",
    "import_session",
    "model_of",
    "placement",
    "read_blob",
]
