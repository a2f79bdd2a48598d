"""What the syncer service saves in its checkpoints and reads back to resume.

``Checkpoints`` writes the core's state with the service's own part (the model's whole
layout, the shard, the merge and refusal counts, the learner whose settings the run
uses), and on resume reads it back as a ``Saved``, checking it is this shard's. When to
write (every ``checkpoint_every`` merges, at shutdown) is the service's
(``rackmend.service.core``); the file itself (atomic write, safe load) is
``rackmend.service.checkpoint``'s; the core's tensors and their keys are
``SyncerCore.state_dict``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rackmend.config import ConfigError
from rackmend.core.checkpoint_meta import CheckpointMeta
from rackmend.core.fragments import FragmentSpec, layout_from_wire, layout_to_wire
from rackmend.core.settings import RunRules
from rackmend.core.shards import Shard, parse_shard
from rackmend.core.syncer import SyncerCore
from rackmend.core.syncer_fragment import global_values
from rackmend.service.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from rackmend.service.events import CheckpointWritten
from rackmend.service.metrics import SyncerMetrics

__all__ = ["Checkpoints", "Saved"]


@dataclass(frozen=True, kw_only=True)
class Saved:
    """A checkpoint read back for ``resume``."""

    layout: list[FragmentSpec]
    """The model's whole layout (every fragment, in the model's numbering)."""
    values: list[list[torch.Tensor]]
    """Per fragment of this shard (from 0), its saved value: what the core starts from."""
    first: tuple[str, RunRules] | None
    """The learner whose H and P the run uses; None in checkpoints that predate it."""
    tensors: dict[str, torch.Tensor]
    meta: CheckpointMeta
    """Both for ``SyncerCore.load_state_dict``; ``meta`` also holds the service's counts."""


class Checkpoints:
    """The checkpoints of one syncer in ``directory`` (None: none are written)."""

    def __init__(self, directory: str | None, shard: Shard, clock: Callable[[], float], metrics: SyncerMetrics,
                 event: Callable[..., None]) -> None:
        self.directory = directory
        self.shard = shard
        self.clock = clock
        self.metrics = metrics
        self._event = event
        self.at: float | None = None
        """When the last checkpoint was written (None: none yet)."""

    def save(self, core: SyncerCore | None, *, layout: list[FragmentSpec] | None, merges: int,
             rejected_messages: int, first: tuple[str, RunRules] | None) -> Path | None:
        """Write ``core``'s state with the service's; None without a core or a directory."""
        if core is None or not self.directory:
            return None
        tensors, meta = core.state_dict()
        assert layout is not None
        # The model's whole layout and this shard's place in it: ``theta/{p}/...`` count the
        # shard's fragments from 0 (``Shard.fragments``); export and resume map them back.
        meta.layout, meta.shard = layout_to_wire(layout), str(self.shard)
        meta.merges, meta.rejected_messages = merges, rejected_messages
        if first is not None:
            meta.first_learner = {"learner": first[0], "settings": first[1].to_wire()}
        path = save_checkpoint(self.directory, tensors, meta)
        self.at = self.clock()
        self.metrics.checkpointed(self.at)
        self._event(CheckpointWritten, path=str(path), versions=tuple(core.versions),
                    shard=self.shard_name())
        return path

    def load(self) -> Saved:
        """The checkpoint in the directory (the previous one where the latest is bad); a
        ``ConfigError`` where there is none, neither is good, or it is another shard's."""
        try:
            loaded = load_checkpoint(self.directory or "")
        except CheckpointError as exc:
            raise ConfigError(f"resume: {exc}") from None
        if loaded is None:
            raise ConfigError(f"resume: no checkpoint in {self.directory}")
        meta, tensors = loaded.meta, loaded.tensors
        saved = parse_shard(meta.shard)
        if saved != self.shard:
            raise ConfigError(f"resume: the checkpoint in {self.directory} is syncer shard {saved}'s, "
                              f"this syncer is --shard {self.shard}; give each shard its own --checkpoint-dir and "
                              "resume it with the --shard it was started with")
        try:
            whole = layout_from_wire(meta.layout)
            values = global_values(tensors, self.shard.fragments(whole))
            first = meta.first_learner
            rules = None if first is None else (first["learner"], RunRules(**first["settings"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"resume: the checkpoint in {self.directory}: {type(exc).__name__}: {exc}") from None
        return Saved(layout=whole, values=values, first=rules, tensors=tensors, meta=meta)

    def shard_name(self) -> str | None:
        """For records that list every fragment's version, which fragments: ``s/S`` for a
        shard (its fragments, from 0), None for the whole model."""
        return None if self.shard.whole else str(self.shard)
