"""Transports: how contributions and updates travel between learners and the syncer.

``base`` defines the learner-side contract; ``inprocess`` carries messages through
queues inside one Python process.
"""

from rackmend.transport.base import LearnerLink, TransportError
from rackmend.transport.inprocess import InProcessLink, InProcessSyncer

__all__ = ["LearnerLink", "TransportError", "InProcessLink", "InProcessSyncer"]
