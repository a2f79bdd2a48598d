"""rackmend: train one PyTorch model across racks joined by slow, unreliable links.

Learners train with plain PyTorch and every few steps trade parameter fragments
with a syncer that merges whatever arrived (Decoupled DiLoCo). Layout:

- ``rackmend.core``: sans-I/O algorithm (fragments, merge, syncer state machine)
- ``rackmend.learner``: the optimizer wrapper used in a training loop, ``enable_async_tp``
  (``rackmend.learner.hf``: the Hugging Face ``Trainer`` hook-up, imported on demand)
- ``rackmend.compat``: the earlier tsugi-mend SDK's API over rackmend (docs/migration.md)
- ``rackmend.transport``: carriers between learners and syncer
- ``rackmend.workloads``: a small byte-level GPT and a built-in corpus for demos/tests
- ``rackmend.service``: the syncer service, its checkpoints and ``export_model``
- ``rackmend.demo`` / ``rackmend.cli``: the ``rackmend`` command
"""

from rackmend.config import (
    ConfigError,
    CompressionConfig,
    LearnerConfig,
    RackmendConfig,
    RunConfig,
    ScheduleConfig,
    SyncerConfig,
)
from rackmend.core import FailSlowReport, FragmentSpec, SyncerCore, pack_fragments
from rackmend.learner import AsyncTPUnavailable, RackmendOptimizer, enable_async_tp
from rackmend.service.export import ExportError, ExportResult, export_model
from rackmend.transport import InProcessSyncer, ZmqLink

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CompressionConfig",
    "LearnerConfig",
    "RackmendConfig",
    "RunConfig",
    "ScheduleConfig",
    "SyncerConfig",
    "FailSlowReport",
    "FragmentSpec",
    "SyncerCore",
    "pack_fragments",
    "RackmendOptimizer",
    "enable_async_tp",
    "AsyncTPUnavailable",
    "export_model",
    "ExportError",
    "ExportResult",
    "InProcessSyncer",
    "ZmqLink",
    "__version__",
]
