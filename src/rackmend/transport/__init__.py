"""Transports: how contributions and updates travel between learners and the syncer.

``base`` defines the learner-side contract; ``inprocess`` carries messages through
queues inside one Python process; ``zmq_link`` reaches a ``rackmend syncer`` service;
``sharded`` reaches a syncer split into shards (``connect`` takes one endpoint or
several); ``status`` asks a running syncer for its read-only status (``rackmend status``).
"""

from rackmend.transport.base import LearnerLink, TransportError
from rackmend.transport.inprocess import InProcessLink, InProcessSyncer
from rackmend.transport.sharded import ShardedLink, connect
from rackmend.transport.zmq_link import CurveClientKeys, ZmqLink

__all__ = ["LearnerLink", "TransportError", "InProcessLink", "InProcessSyncer", "ZmqLink", "ShardedLink", "connect",
           "CurveClientKeys"]
