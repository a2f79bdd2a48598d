"""The sans-I/O core: fragments and schedule, merge math, the syncer state machine,
the learner state machine (``core.learner``: its events and actions are imported
from there), fail-slow detection.

Nothing in this package reads a clock, sleeps, starts a thread or touches a socket;
time comes in as ``now`` arguments. Transports and simulators drive it.
"""

from rackmend.core.failslow import (
    AdviseLearner,
    FailSlowAction,
    FailSlowBlip,
    FailSlowMonitor,
    FailSlowReport,
    MarkForEviction,
    RestoreLearner,
    StepTimeDetector,
    StopExpecting,
)
from rackmend.core.fragments import (
    FragmentSpec,
    TensorSpec,
    fingerprint,
    fragment_offsets,
    fragments_due,
    pack_fragments,
)
from rackmend.core.learner import FragmentState, LearnerCore
from rackmend.core.merge import contribution_weight, merge_deltas, normalized_weights
from rackmend.core.messages import Contribution, Update
from rackmend.core.syncer import (
    Action,
    ContributionArrived,
    Event,
    ExpectationChanged,
    FinalMerge,
    LearnerJoined,
    LearnerLeft,
    LogRecord,
    SendUpdate,
    SyncerCore,
    SyncTimed,
    Tick,
)

__all__ = [
    "AdviseLearner",
    "FailSlowAction",
    "FailSlowBlip",
    "FailSlowMonitor",
    "FailSlowReport",
    "MarkForEviction",
    "RestoreLearner",
    "StepTimeDetector",
    "StopExpecting",
    "FragmentSpec",
    "TensorSpec",
    "fingerprint",
    "fragment_offsets",
    "fragments_due",
    "pack_fragments",
    "FragmentState",
    "LearnerCore",
    "contribution_weight",
    "merge_deltas",
    "normalized_weights",
    "Contribution",
    "Update",
    "Action",
    "ContributionArrived",
    "Event",
    "ExpectationChanged",
    "FinalMerge",
    "LearnerJoined",
    "LearnerLeft",
    "LogRecord",
    "SendUpdate",
    "SyncerCore",
    "SyncTimed",
    "Tick",
]
