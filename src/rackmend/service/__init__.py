"""The syncer as a network service: its sans-I/O core (``ServiceCore``: membership,
checkpoints, Curve key ids, outboxes) behind a ZeroMQ ROUTER (``SyncerService``),
and the commands around it: ``status`` (live view of a running syncer) and ``export``
(the global model of a checkpoint as a model file), and reading a syncer's log back as
typed records (``read_log``).

The round logic lives in ``rackmend.core``; the wire format in ``rackmend.transport.wire``.
"""

from rackmend.service.checkpoint import load_checkpoint, save_checkpoint
from rackmend.service.config import ServiceConfig
from rackmend.service.core import ServiceCore
from rackmend.service.events import read_event, read_log
from rackmend.service.syncer import SyncerService

__all__ = ["ServiceConfig", "ServiceCore", "SyncerService", "load_checkpoint", "save_checkpoint", "read_event", "read_log"]
