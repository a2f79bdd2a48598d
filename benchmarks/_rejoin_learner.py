"""One learner of ``benchmarks/rejoin.py``: the demo GPT trained with ``RackmendOptimizer``
over a ``ZmqLink`` (or, ``--plain``, with the inner optimizer alone), which notes when
each phase of its start ended, so the benchmark can tell a restart's time apart:
interpreter and imports, the model built, the optimizer built (the join: hello, the
global values), the first step. Not a test helper: the benchmark starts, kills and restarts it.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: they are part of what a restart costs

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from rackmend import RackmendConfig, RackmendOptimizer, ScheduleConfig, ZmqLink  # noqa: E402
from rackmend.workloads.corpus import ByteCorpus  # noqa: E402
from rackmend.workloads.gpt import GPT, GPTConfig  # noqa: E402

IMPORTED = time.time()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--endpoint", default=None, help="the syncer (not with --plain)")
    p.add_argument("--id", default="l0")
    p.add_argument("--plain", action="store_true", help="no rackmend: the inner optimizer alone")
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--P", type=int, default=4)
    p.add_argument("--tau", type=int, default=1)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--times", type=Path, required=True, help="JSON file: when each phase of the start ended")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(GPTConfig())
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    modelled = time.time()
    opt = None
    if not a.plain:
        config = RackmendConfig(schedule=ScheduleConfig(sync_every=a.H, num_fragments=a.P, overlap=a.tau))
        opt = RackmendOptimizer(model, inner, config, ZmqLink(a.endpoint), learner_id=a.id)
    built = time.time()
    corpus = ByteCorpus()
    g = torch.Generator().manual_seed(hash(a.id) % 2**31)
    times = {"started": STARTED, "imported": IMPORTED, "model": modelled, "built": built}
    for step in range(1, a.steps + 1):
        x, y = corpus.batch(g, 8, 64)
        loss = model(x, y)
        (opt or inner).zero_grad()
        loss.backward()
        if opt is None:
            inner.step()
        else:
            opt.step(tokens=x.numel())
        if step == 1:
            times["first_step"] = time.time()
            tmp = a.times.with_suffix(".tmp")
            tmp.write_text(json.dumps(times))
            tmp.replace(a.times)
    if opt is not None:
        opt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
