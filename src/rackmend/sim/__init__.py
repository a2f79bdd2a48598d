"""A discrete-event simulator of a rackmend run: one syncer core and M learner cores in
virtual time, over a toy model (one quadratic per learner), with latency, bandwidth,
step-time jitter, slow and dead racks.

It answers what-if questions in seconds (what does a 4x slower rack, a dead rack, a
longer link cost; which grace window or quorum suits them) with the real rules: the
cores of ``rackmend.core`` run unchanged, only time, links and training are simulated.
What does not live here: any rule of the algorithm, real training, real transports
(``rackmend.transport``), the service (``rackmend.service``). ``rackmend simulate`` is
its command line (``rackmend.sim.cli``).
"""

from rackmend.sim.config import Failures, Kill, RackSpec, SimConfig, Slowdown
from rackmend.sim.engine import Goodput, LearnerReport, Simulation, SimulationError, SimReport, simulate

__all__ = ["Failures", "Kill", "RackSpec", "SimConfig", "Slowdown", "Goodput", "LearnerReport", "Simulation", "SimulationError",
           "SimReport", "simulate"]
