"""WAN link emulation for tests, benchmarks and demos on one machine.

``LinkEmulator`` is a userspace TCP proxy: put it between a learner and the syncer
(point the learner at ``link.address``) and the bytes between them see a bandwidth
cap, one-way latency with jitter, and scheduled outages (connections reset, or the
link stalling), as on a slow, unreliable WAN path. It needs no root and no ``tc``.

Nothing in the training path imports this package; ``rackmend link`` (see
``rackmend.netem.cli``) runs one link from the command line.
"""

from rackmend.netem.link import (
    OUTAGE_MODES,
    LinkConfig,
    LinkEmulator,
    Outage,
    parse_duration,
    parse_rate,
    parse_size,
)

__all__ = [
    "OUTAGE_MODES",
    "LinkConfig",
    "LinkEmulator",
    "Outage",
    "parse_duration",
    "parse_rate",
    "parse_size",
]
