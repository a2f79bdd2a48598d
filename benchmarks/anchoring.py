"""How stale contributions are anchored, on the demo workload: held-out loss per variant.

Runbook: ``python benchmarks/anchoring.py`` (about 3 minutes on 2 cores; ``--quick``
halves the steps). The rackmend arm of the demo (4 learner threads, H=16, P=4, tau=2,
K=1) run as: deterministic (no staleness), async with ``anchoring="syncer"``, async
with ``learner_base``, and ``learner_base`` with H=8. These are the numbers in
docs/algorithm.md. One run per variant: thread timing makes the async arms vary a
little from run to run.
"""

from __future__ import annotations

import dataclasses

from _common import finish, parser
from rackmend.demo.spec import arm_specs
from rackmend.demo.threads import thread_settings, train_arm
from rackmend.workloads import ByteCorpus


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    s = thread_settings(steps=120 if args.quick else 240, evals=4)
    base = arm_specs(s)["rackmend"].config
    sc = base.syncer
    variants = {
        "deterministic": dataclasses.replace(base, deterministic=True),
        "syncer": dataclasses.replace(base, syncer=dataclasses.replace(sc, anchoring="syncer")),
        "learner_base": dataclasses.replace(base, syncer=dataclasses.replace(sc, anchoring="learner_base")),
        "learner_base_H8": dataclasses.replace(
            base, syncer=dataclasses.replace(sc, anchoring="learner_base"),
            schedule=dataclasses.replace(base.schedule, sync_every=8)),
    }
    corpus = ByteCorpus()
    rows = {}
    print(f"{'variant':<16} {'final loss':>10} {'merges':>7}  loss at each evaluation")
    for name, config in variants.items():
        r = train_arm(name, config, s, corpus)
        rows[name] = {"points": r.points, "final": r.points[-1][2], "merges": r.merges}
        print(f"{name:<16} {r.points[-1][2]:>10.3f} {r.merges:>7}  " + " ".join(f"{p[2]:.2f}" for p in r.points))
    finish("anchoring", args.out, {"inputs": {"steps": s.max_steps, "learners": s.learners}, "rows": rows},
           {f"{k}_loss": v["final"] for k, v in rows.items()})


if __name__ == "__main__":
    main()
