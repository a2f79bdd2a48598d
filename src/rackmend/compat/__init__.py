"""Migration layers: earlier APIs for the same job, run on rackmend's own engine.

``rackmend.compat.tsugi`` keeps code written for the tsugi-mend 0.1.x SDK running
(``MendConfig``, ``mend_init``, ``get_runtime``, ...). Nothing here re-implements the
algorithm: every call lands on ``RackmendOptimizer`` and a ``rackmend syncer``.
docs/migration.md says, setting by setting, what changes.
"""
