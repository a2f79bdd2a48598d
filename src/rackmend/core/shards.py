"""Syncer shards: which shard owns which fragment, and the renumbering inside a shard.

Fragments are independent (DESIGN.md §2, "Scale-out"), so the syncer splits by
fragment with no coordination between shards: shard ``s`` of ``S`` owns the fragments
``p`` with ``p mod S == s``. A learner routes each fragment to its owner (``owner``);
a shard's core sees only its own fragments, renumbered ``0, 1, ...`` in order
(``Shard.local``), so the core needs to know nothing about shards. The service
translates at its edge: fragment numbers in messages, log records and status are
always the model's (global) ones.

Nothing here does I/O; ``service.syncer`` and ``transport.zmq_link`` use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence, TypeVar

from rackmend.config import ConfigError
from rackmend.core.fragments import FragmentSpec
from rackmend.core.records import SyncerRecord

__all__ = ["Shard", "owner", "parse_shard"]

_T = TypeVar("_T")
_R = TypeVar("_R", bound=SyncerRecord)


def owner(fragment: int, shards: int) -> int:
    """The shard that owns ``fragment`` when the syncer runs as ``shards`` shards."""
    return fragment % shards


def parse_shard(text: str) -> "Shard":
    """``"s/S"`` (as ``rackmend syncer --shard`` takes it) as a ``Shard``; ConfigError naming the fix."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"shard must be 's/S' (this is shard s of S, counted from 0), e.g. 0/2; got {text!r} "
                          "(--shard)") from None
    return Shard(index, count)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: owns fragments ``p`` with ``p mod count == index``."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise ConfigError(f"shard {self.index}/{self.count} does not exist: need 0 <= s < S in 's/S' "
                              "(--shard 0/2 and --shard 1/2 for two shards)")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def whole(self) -> bool:
        """One syncer for the whole model (no renumbering)."""
        return self.count == 1

    def owns(self, fragment: int) -> bool:
        return owner(fragment, self.count) == self.index

    def local(self, fragment: int) -> int:
        """This shard's number for the model's ``fragment`` (which it must own)."""
        return (fragment - self.index) // self.count

    def to_global(self, local: int) -> int:
        """The model's number of this shard's fragment ``local``."""
        return self.index + local * self.count

    def fragments(self, layout: Sequence[FragmentSpec]) -> list[FragmentSpec]:
        """The shard's part of the model's layout, renumbered from 0 (offsets kept: a
        fragment is due at the same step whoever merges it)."""
        return [dataclasses.replace(f, index=self.local(f.index)) for f in layout if self.owns(f.index)]

    def select(self, per_fragment: Sequence[_T]) -> tuple[_T, ...]:
        """Of a per-fragment sequence in the model's numbering, this shard's entries."""
        return tuple(x for p, x in enumerate(per_fragment) if self.owns(p))

    def record(self, record: _R) -> _R:
        """A record of the shard's core (``rackmend.core.records``) with its ``fragment``
        in the model's numbering (records without one are returned as they are)."""
        fragment = getattr(record, "fragment", None)
        if self.whole or not isinstance(fragment, int):
            return record
        return dataclasses.replace(record, fragment=self.to_global(fragment))
