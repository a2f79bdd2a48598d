"""The settings a learner reports when it joins, and the rules for which must agree.

A learner and the syncer that disagree on tau, on deterministic mode or on the
downlink codec still exchange well-formed messages, so nothing would fail: rounds
would just be timed or applied wrongly. The same holds for DES-LOC (whether moments
are averaged, how often, and their codec). Learners therefore state these settings at
``hello`` and the syncer refuses a mismatch by name. H, P and tau decide when each
fragment is sent and merged; the syncer has no value of its own for them (it may pin
tau: ``SyncerConfig.overlap``), so every learner must use the one the first learner
used. The uplink codec may differ: each message names its codec.

The other way, the syncer states the settings that govern its rounds (``SyncerSettings``)
in its answer to a join. A learner's config carries a ``SyncerConfig`` too, but the
syncer's own rules; a learner whose values differ is told at join (``syncer_differences``)
instead of believing, say, that rounds wait for 4 learners when the syncer closes them
on 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rackmend.codecs.base import CodecError
from rackmend.codecs.registry import parse_codec_spec
from rackmend.config import (APPLY_RULES, ConfigError, LearnerConfig, RackmendConfig, RunConfig, ScheduleConfig,
                             SyncerConfig, schedule_problem)

__all__ = ["APPLIED_RULES", "RunRules", "SyncerSettings", "Mismatch", "syncer_mismatch", "peer_mismatch",
           "same_codec", "syncer_differences"]


@dataclass(frozen=True, kw_only=True)
class RunRules:
    """The rules of a run that learners and the syncer must agree on (``RackmendConfig``
    values): what a learner reports at hello, the first learner's H, P, tau, apply rule
    and DES-LOC periods then hold for the run. ``validate`` is the one check of their
    consistency, for a config (``from_config``) and for a hello from the wire alike."""

    sync_every: int
    """H of ``ScheduleConfig``."""
    num_fragments: int
    """P of ``ScheduleConfig``."""
    overlap: int
    """tau of ``ScheduleConfig``."""
    deterministic: bool
    """``RackmendConfig.deterministic``."""
    uplink: str
    """``CompressionConfig.uplink`` spec string."""
    downlink: str
    """``CompressionConfig.downlink`` spec string."""
    apply: str = "overwrite"
    """``RackmendConfig.apply_rule()``: the syncer's grace window depends on it. The
    default is what learners did before it was reported (checkpoints of that time)."""
    desloc: bool = False
    """``ScheduleConfig.desloc``: whether the run averages optimizer moments."""
    desloc_ku: int = 0
    """K_u (``ScheduleConfig.moment_periods``); 0 with DES-LOC off."""
    desloc_kv: int = 0
    """K_v; 0 with DES-LOC off."""
    moments: str = "none"
    """``CompressionConfig.moments`` spec string."""

    @classmethod
    def from_config(cls, config: RackmendConfig) -> "RunRules":
        sch, comp = config.schedule, config.compression
        ku, kv = sch.moment_periods() if sch.desloc else (0, 0)
        return cls(sync_every=sch.sync_every, num_fragments=sch.num_fragments, overlap=sch.overlap,
                   deterministic=config.deterministic, uplink=comp.uplink, downlink=comp.downlink,
                   apply=config.apply_rule(), desloc=sch.desloc, desloc_ku=ku, desloc_kv=kv,
                   moments=comp.moments)

    def config(self, run: RunConfig) -> RackmendConfig:
        """The run's whole config: these rules with the syncer's own settings ``run``."""
        return RackmendConfig(
            schedule=ScheduleConfig(sync_every=self.sync_every, num_fragments=self.num_fragments,
                                    overlap=self.overlap, desloc=self.desloc, desloc_ku=self.desloc_ku or None,
                                    desloc_kv=self.desloc_kv or None),
            learner=LearnerConfig(apply=self.apply), syncer=run.syncer, compression=run.compression,
            deterministic=run.deterministic)

    def validate(self) -> None:
        """ConfigError naming the first rule broken: H, P, tau and DES-LOC's periods
        (``config.schedule_problem``), the apply rule (resolved: not ``auto``) and the
        codec specs (parsed, not built)."""
        ku, kv = (self.desloc_ku, self.desloc_kv) if self.desloc else (None, None)
        problem = schedule_problem(sync_every=self.sync_every, num_fragments=self.num_fragments,
                                   overlap=self.overlap, desloc_ku=ku, desloc_kv=kv)
        if problem is not None:
            raise ConfigError(problem)
        if self.apply not in APPLIED_RULES:
            raise ConfigError(f"apply must be one of {', '.join(APPLIED_RULES)} (auto resolved), got {self.apply!r}")
        for name in ("uplink", "downlink", "moments"):
            try:
                parse_codec_spec(getattr(self, name))
            except CodecError as exc:
                raise ConfigError(f"{name}: {exc}") from None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sync_every": self.sync_every, "num_fragments": self.num_fragments, "overlap": self.overlap,
            "deterministic": self.deterministic, "uplink": self.uplink, "downlink": self.downlink,
            "apply": self.apply}
        if self.desloc:
            # Only with DES-LOC on: a learner without it then says hello exactly as before
            # it existed, and a syncer that predates DES-LOC refuses one that needs it.
            out.update(desloc=True, desloc_ku=self.desloc_ku, desloc_kv=self.desloc_kv, moments=self.moments)
        return out


@dataclass(frozen=True, kw_only=True)
class SyncerSettings:
    """The syncer's round settings a learner's ``SyncerConfig`` also names, as the syncer
    states them in its answer to a join (optional field ``syncer`` of a reset ``update``;
    docs/protocol.md)."""

    min_quorum: int
    """``SyncerConfig.min_quorum`` (K, ``rackmend syncer --min-quorum``)."""
    grace_max: float
    """``SyncerConfig.grace_max`` in seconds (``--grace-max``)."""
    weighting: str
    """``SyncerConfig.weighting`` (``--weighting``)."""
    failslow: bool
    """Whether fail-slow detection runs: ``SyncerConfig.failslow`` (``--failslow`` /
    ``--no-failslow``) and not deterministic mode, where it is always off."""

    @classmethod
    def from_config(cls, config: RunConfig) -> "SyncerSettings":
        sc = config.syncer
        return cls(min_quorum=sc.min_quorum, grace_max=float(sc.grace_max), weighting=sc.weighting,
                   failslow=sc.failslow and not config.deterministic)

    def to_wire(self) -> dict[str, Any]:
        return {"min_quorum": self.min_quorum, "grace_max": self.grace_max, "weighting": self.weighting,
                "failslow": self.failslow}


APPLIED_RULES: tuple[str, ...] = tuple(r for r in APPLY_RULES if r != "auto")
"""The apply rules a learner reports (``auto`` is resolved before it says hello)."""

_SYNCER_FLAGS = {"min_quorum": "--min-quorum", "grace_max": "--grace-max", "weighting": "--weighting"}


def syncer_differences(learner_id: str, mine: SyncerConfig, theirs: SyncerSettings) -> list[str]:
    """A sentence for each round setting in which the learner's ``mine`` differs from what
    the syncer runs with (``theirs``): the syncer's value rules, and the learner's is
    ignored. Fail-slow detection is left out (the syncer's default is on, and a learner's
    config rarely means otherwise); ``rackmend.compat.tsugi`` checks it where asked for."""
    out = []
    for name, flag in _SYNCER_FLAGS.items():
        want, have = getattr(mine, name), getattr(theirs, name)
        if want != have:
            out.append(f"learner {learner_id}'s config has SyncerConfig.{name}={want!r}, but the syncer runs with "
                       f"{name}={have!r}: the syncer's value rules (a learner's is never sent). Start the syncer "
                       f"with {flag} {want}, or set SyncerConfig({name}={have!r}) on the learner to match")
    return out


@dataclass(frozen=True)
class Mismatch:
    """A setting that differs: its name, both values and a message saying what to change."""

    setting: str
    learner_value: Any
    other_value: Any
    reason: str


def same_codec(a: str, b: str) -> bool:
    """Whether two codec specs build the same codec (``int8`` equals ``int8:block_size=64``)."""
    try:
        return parse_codec_spec(a) == parse_codec_spec(b)
    except CodecError:
        return a == b


def syncer_mismatch(learner_id: str, s: RunRules, config: RunConfig) -> Mismatch | None:
    """The first setting in which learner ``learner_id`` disagrees with the syncer's ``config``."""
    tau = config.syncer.overlap
    if tau is not None and s.overlap != tau:
        return Mismatch("overlap", s.overlap, tau, (
            f"overlap (tau) differs: learner {learner_id} has overlap={s.overlap}, the syncer pins {tau} "
            f"(its grace window waits for stragglers only inside tau steps of slack). Start the syncer with "
            f"--overlap {s.overlap} (or without --overlap), or set ScheduleConfig(overlap={tau}) on the learner"))
    det = config.deterministic
    if s.deterministic != det:
        fix = "with --deterministic" if s.deterministic else "without --deterministic"
        return Mismatch("deterministic", s.deterministic, det, (
            f"deterministic differs: learner {learner_id} has deterministic={s.deterministic}, the syncer "
            f"{det} (a deterministic learner blocks on every merge; a deterministic syncer waits for the "
            f"whole roster). Start the syncer {fix}, or set RackmendConfig(deterministic={det}) on the learner"))
    down = config.compression.downlink
    if not same_codec(s.downlink, down):
        return Mismatch("downlink", s.downlink, down, (
            f"downlink codec differs: learner {learner_id} has compression.downlink={s.downlink!r}, the syncer "
            f"sends {down!r}. Start the syncer with --downlink-codec {s.downlink}, or set "
            f"CompressionConfig(downlink={down!r}) on the learner"))
    if s.desloc and not same_codec(s.moments, config.compression.moments):
        return Mismatch("moments", s.moments, config.compression.moments, (
            f"moments codec differs: learner {learner_id} has compression.moments={s.moments!r}, the syncer "
            f"sends averaged moments with {config.compression.moments!r}. Start the syncer with --moments-codec "
            f"{s.moments}, or set CompressionConfig(moments={config.compression.moments!r}) on the learner"))
    return None


def peer_mismatch(learner_id: str, s: RunRules, first_id: str, first: RunRules) -> Mismatch | None:
    """H, P, tau, DES-LOC's periods or the apply rule of learner ``learner_id`` unlike those
    of ``first_id``, whose values the run uses."""
    if s.apply != first.apply:
        return Mismatch("apply", s.apply, first.apply, (
            f"apply differs: learner {learner_id} applies merged values by {s.apply!r}, but the run uses "
            f"{first.apply!r} (set by learner {first_id}, the first to join), and the syncer's grace window "
            f"depends on it. Set LearnerConfig(apply={first.apply!r}) on {learner_id} (or leave every learner "
            "at the default 'auto')"))
    if (s.desloc, s.desloc_ku, s.desloc_kv) != (first.desloc, first.desloc_ku, first.desloc_kv):
        mine = f"desloc={s.desloc}, K_u={s.desloc_ku}, K_v={s.desloc_kv}"
        theirs = f"desloc={first.desloc}, K_u={first.desloc_ku}, K_v={first.desloc_kv}"
        return Mismatch("desloc", mine, theirs, (
            f"DES-LOC settings differ: learner {learner_id} has {mine}, but the run uses {theirs} (set by learner "
            f"{first_id}, the first to join); moment rounds need every learner's moments on the same steps. Set "
            f"ScheduleConfig(desloc=..., desloc_ku=..., desloc_kv=...) on {learner_id} to the run's values"))
    for name, letter in (("sync_every", "H"), ("num_fragments", "P"), ("overlap", "tau")):
        mine, theirs = getattr(s, name), getattr(first, name)
        if mine != theirs:
            return Mismatch(name, mine, theirs, (
                f"{name} ({letter}) differs: learner {learner_id} has {name}={mine}, but the run uses {theirs} "
                f"(set by learner {first_id}, the first to join); every learner must use the same value. Set "
                f"ScheduleConfig({name}={theirs}) on {learner_id}, or restart the syncer without "
                f"--resume and every learner with {name}={mine}"))
    return None
