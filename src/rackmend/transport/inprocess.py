"""In-process transport: the syncer core on a thread, learners talk to it through queues.

For tests, notebooks and the single-process demo. The learner and syncer code is the
same that runs behind the network service; only the carrier differs. Tensors are
passed by reference (nobody mutates a sent tensor).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from rackmend.config import RackmendConfig
from rackmend.core.failslow import AdviseLearner, FailSlowAction, FailSlowReport
from rackmend.core.fragments import FragmentSpec, fragment_tensors, layout_difference, pack_fragments
from rackmend.core.messages import Contribution, MomentContribution, MomentUpdate, Update
from rackmend.core.pieces import RankPieces
from rackmend.core.settings import RunRules, SyncerSettings, syncer_mismatch
from rackmend.core.syncer import (
    ContributionArrived,
    Event,
    FinalMerge,
    LearnerJoined,
    LearnerLeft,
    MomentsArrived,
    SendMomentUpdate,
    SendUpdate,
    SyncerCore,
    Tick,
)
from rackmend.core.records import Merged, SyncerRecord
from rackmend.core.syncer_runner import SyncerRunner
from rackmend.transport.base import QueueLink, TransportError

__all__ = ["InProcessSyncer", "InProcessLink"]

log = logging.getLogger("rackmend.syncer")

_POLL = 0.05  # seconds; upper bound on how late a stop request or grace expiry is seen


class InProcessSyncer:
    """Runs a ``SyncerCore`` on a background thread. Use as a context manager."""

    def __init__(
        self,
        config: RackmendConfig,
        fragments: Sequence[FragmentSpec],
        initial: Sequence[Sequence[torch.Tensor]],
        *,
        log_path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = SyncerCore(config, fragments, initial)
        self._runner = SyncerRunner(self.core, clock, send_update=self._send_update, record=self._record,
                                    send_moments=self._send_moments, fail_slow=self._advise, merged=self._merged)
        self.clock = clock
        self.records: list[SyncerRecord] = []
        """Every record the core returned, in order (typed: ``rackmend.core.records``; also
        written to ``log_path`` as JSONL, and as dicts in ``events``)."""
        self._log_file = open(log_path, "a", encoding="utf-8") if log_path else None
        self._inbox: "queue.Queue[Event | None]" = queue.Queue()
        self._outboxes: dict[str, "queue.Queue[Update]"] = {}
        self._advice: dict[str, "queue.Queue[FailSlowReport]"] = {}
        self._moment_boxes: dict[str, "queue.Queue[MomentUpdate]"] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rackmend-syncer", daemon=True)
        self._error: BaseException | None = None
        self._thread.start()

    @classmethod
    def for_model(cls, config: RackmendConfig, model: torch.nn.Module, **kwargs: object) -> "InProcessSyncer":
        """A syncer whose global value starts as ``model``'s parameters, split per ``config``."""
        sch = config.schedule
        frags = pack_fragments(model, sch.num_fragments, sch.sync_every, sch.packing, buffers=sch.sync_buffers)
        return cls(config, frags, [[t.detach() for t in ts] for ts in fragment_tensors(model, frags)],
                   **kwargs)  # type: ignore[arg-type]

    def connect(self) -> "InProcessLink":
        """A new link for one learner."""
        return InProcessLink(self)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the syncer after a final merge of every fragment with pending
        contributions (a ``final_merge`` record, then ``merge`` records with
        ``cause="final"``); their updates reach learners still connected."""
        self._inbox.put(None)
        self._thread.join(timeout)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        if self._error is not None:
            raise RuntimeError("the in-process syncer thread failed") from self._error

    def __enter__(self) -> "InProcessSyncer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def merges(self) -> list[Merged]:
        """The ``merge`` records (``records`` has every record, typed)."""
        return [r for r in self.records if isinstance(r, Merged)]

    # ------------------------------------------------------------------ internals
    def _register(self, learner_id: str, box: "queue.Queue[Update]",
                  advice: "queue.Queue[FailSlowReport] | None" = None,
                  moments: "queue.Queue[MomentUpdate] | None" = None) -> None:
        with self._lock:
            self._outboxes[learner_id] = box
            if advice is not None:
                self._advice[learner_id] = advice
            if moments is not None:
                self._moment_boxes[learner_id] = moments

    def _post(self, event: Event) -> None:
        if not self._thread.is_alive():
            raise TransportError("the in-process syncer is not running")
        self._inbox.put(event)

    def _run(self) -> None:
        try:
            while True:
                deadline = self.core.next_deadline()
                wait = _POLL if deadline is None else min(_POLL, max(0.0, deadline - self.clock()))
                try:
                    event = self._inbox.get(timeout=wait)
                except queue.Empty:
                    event = Tick()
                if event is None:
                    # Contributions queued before close() were dispatched above: merge
                    # whatever still waits for a quorum or grace window, so work that
                    # was sent is in the final global value.
                    self._runner.run(FinalMerge())
                    return
                self._runner.run(event)
        except BaseException as exc:  # surfaced by close() and by learners' waits
            self._error = exc

    def _send_update(self, action: SendUpdate) -> None:
        upd = replace(action.update, reset=True) if action.reset else action.update
        with self._lock:
            for lid in action.to:
                box = self._outboxes.get(lid)
                if box is not None:
                    box.put(upd)

    def _send_moments(self, action: SendMomentUpdate) -> None:
        with self._lock:
            for lid in action.to:
                box = self._moment_boxes.get(lid)
                if box is not None:
                    box.put(action.update)

    def _record(self, record: SyncerRecord) -> None:
        self.records.append(record)
        if record.level >= logging.WARNING:
            log.warning("%s", getattr(record, "reason", record))
        if self._log_file:
            self._log_file.write(json.dumps(record.to_record()) + "\n")

    def _advise(self, action: FailSlowAction) -> None:
        if isinstance(action, AdviseLearner):
            with self._lock:
                advice = self._advice.get(action.report.learner)
            if advice is not None:
                advice.put(action.report)

    def _merged(self, fragments: list[int], seconds: float) -> None:
        if self._log_file:
            self._log_file.flush()


class InProcessLink(QueueLink):
    """One learner's end of an ``InProcessSyncer``: a single-process learner (rank 0 of
    1, all its fragments); it counts no bytes (nothing is encoded)."""

    carries_moments = True

    def __init__(self, hub: InProcessSyncer) -> None:
        super().__init__(lambda: hub._error)
        self._hub = hub
        self.learner_id: str | None = None
        self.syncer_settings: SyncerSettings = SyncerSettings.from_config(hub.core.config)
        """The syncer's round settings, as ``ZmqLink.syncer_settings``."""

    def join(self, learner_id: str, fragments: Sequence[FragmentSpec],
             initial: Sequence[Sequence[torch.Tensor]], timeout: float, *,
             settings: RunRules, pieces: RankPieces | None = None) -> list[Update]:
        if pieces is not None:
            raise TransportError(f"join of {learner_id}: a sharded rack (DTensor parameters) needs the network "
                                 "syncer (ZmqLink to `rackmend syncer`); the in-process carrier serves whole tensors")
        # The same rules as the network syncer, so a script moved to ZmqLink meets no new refusal.
        # H and P need no check here: the hub's layout comes from its own config's H and P.
        mismatch = syncer_mismatch(learner_id, settings, self._hub.core.config)
        if mismatch is not None:
            raise TransportError(f"join of {learner_id}: {mismatch.reason}")
        difference = layout_difference(self._hub.core.fragments, fragments)
        if difference:
            raise TransportError(f"join of {learner_id}: the learner's layout differs from the syncer's: {difference}")
        self.learner_id = learner_id
        self._hub._register(learner_id, self._box, self._advice, self._moment_box)
        self._hub._post(LearnerJoined(learner_id))
        n = len(self._hub.core.fragments)
        got: dict[int, Update] = {}
        end = time.monotonic() + timeout
        while len(got) < n:
            upd = self._get(end)
            if upd is None:
                raise TransportError(f"join of {learner_id}: no answer from the syncer within {timeout}s")
            got[upd.fragment] = upd
        return list(got.values())

    def send(self, contribution: Contribution) -> None:
        self._hub._post(ContributionArrived(contribution))

    def send_moments(self, contribution: MomentContribution) -> None:
        """DES-LOC: queue a moment contribution for the syncer; returns at once."""
        self._hub._post(MomentsArrived(contribution))

    def leave(self) -> None:
        if self.learner_id is not None and self._hub._thread.is_alive():
            self._hub._post(LearnerLeft(self.learner_id))
        self.learner_id = None
