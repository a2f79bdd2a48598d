"""Configuration: kw-only dataclasses shared by the learner, the syncer and the CLI.

Every field carries a docstring; ``validate()`` (run from ``__post_init__``) rejects a
bad value with a message naming the field and saying what to change. A field with a
fixed set of values is typed ``Literal[...]``, and that annotation is the one list of
allowed values: ``validate()``, the ``rackmend syncer`` options and their help read it
(``literal_choices``), as they read help text from the field docstrings
(``field_docs``). Nothing here touches tensors, sockets or clocks.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Self, TypeVar

import torch

from rackmend.codecs.base import Codec, CodecError
from rackmend.codecs.registry import CODECS, parse_codec_spec

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "ConfigError",
    "FrozenMapping",
    "frozen_config",
    "CompressionConfig",
    "ScheduleConfig",
    "SyncerConfig",
    "LearnerConfig",
    "RunConfig",
    "RackmendConfig",
    "Weighting",
    "Merge",
    "ApplyRule",
    "Packing",
    "Anchoring",
    "WEIGHTINGS",
    "MERGES",
    "APPLY_RULES",
    "PACKINGS",
    "ANCHORINGS",
    "MOMENT_CODECS",
    "OPTION",
    "OPTION_SCALE",
    "check_choice",
    "field_docs",
    "literal_choices",
    "schedule_problem",
]

Weighting = Literal["tokens_sq_per_step", "tokens", "uniform"]
Merge = Literal["mean", "rda"]
ApplyRule = Literal["auto", "overwrite", "mix", "keep_local"]
Packing = Literal["balanced", "strided"]
Anchoring = Literal["learner_base", "syncer"]
HEARTBEAT_TIMEOUT_S = 10.0
"""The syncer's default bound on a learner's silence (``ServiceConfig.heartbeat_timeout``),
declared once: the simulator (``SimConfig.silence_timeout``) and the demo
(``RunSettings.heartbeat_timeout_s``) default to it as well."""

WEIGHTINGS: tuple[str, ...] = typing.get_args(Weighting)
MERGES: tuple[str, ...] = typing.get_args(Merge)
APPLY_RULES: tuple[str, ...] = typing.get_args(ApplyRule)
PACKINGS: tuple[str, ...] = typing.get_args(Packing)
ANCHORINGS: tuple[str, ...] = typing.get_args(Anchoring)

MOMENT_CODECS: tuple[str, ...] = ("none", "bf16")
"""Codecs DES-LOC's moments may travel with (``CompressionConfig.moments``)."""

OPTION = "rackmend.option"
"""``dataclasses.field`` metadata key: the field's name as a ``rackmend syncer`` option
(flag, TOML key, ``RACKMEND_*`` variable) where it differs from the field's own name,
e.g. ``uplink_codec`` for ``CompressionConfig.uplink``."""
OPTION_SCALE = "rackmend.option_scale"
"""``dataclasses.field`` metadata key: the option's value times this is the field's
value (``max_message_mb`` in MiB for ``ServiceConfig.max_message_bytes``)."""


_C = TypeVar("_C", bound=type)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class FrozenMapping(dict):  # type: ignore[type-arg]
    """A dict that refuses changes: a frozen config's mapping-valued field (``SyncerConfig.
    outer_kwargs``). Freezing the dataclass alone would still let
    ``config.syncer.outer_kwargs["momentum"] = 0.9`` reach a syncer that builds its outer
    optimizers later, one fragment at a time. Still a ``dict`` for JSON, TOML and
    ``dataclasses.asdict``; copies (``copy``, ``pickle``) rebuild it from its items."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("this mapping belongs to a frozen config and cannot change; build a new config with "
                        "dataclasses.replace(config, field={...})")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


def frozen_config(cls: _C) -> _C:
    """Give a frozen config dataclass an error that says what to do instead. Once built, a
    config is read by what was built from it (``RackmendOptimizer``, its core, the syncer)
    at whatever time each needs a value, so a change would reach some of them, later, or
    never: ``config.schedule.overlap = 99`` after building the optimizer left the learner
    applying no merge at all, without an error. Apply on top of
    ``@dataclass(frozen=True, ...)`` (its ``__init__`` and ``dataclasses.replace`` bypass
    ``__setattr__``)."""

    def refuse(self: Any, name: str, *rest: Any) -> None:
        kind = type(self).__name__
        part = next((f.name for f in dataclasses.fields(RackmendConfig)
                     if f.default_factory is type(self)), None)  # type: ignore[comparison-overlap]
        how = (f"config.replace({part}=dataclasses.replace(config.{part}, {name}=...))" if part is not None
               else f"dataclasses.replace(config, {name}=...)")
        raise dataclasses.FrozenInstanceError(
            f"{kind}.{name} cannot change after the {kind} is built: the optimizer, the syncer and whatever else "
            f"was given it go on reading it, so a change would reach some of them, late or never. Build a changed "
            f"copy instead, {how}, and build the optimizer (or syncer) again with it")

    cls.__setattr__ = refuse  # type: ignore[assignment,method-assign]
    cls.__delattr__ = refuse  # type: ignore[assignment,method-assign]
    return cls


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """ConfigError unless ``value`` is one of ``allowed``; the message lists them and, for
    a near miss, names the closest."""
    if value in allowed:
        return
    lowered = {a.lower(): a for a in allowed}
    close = difflib.get_close_matches(str(value).lower(), list(lowered), n=1, cutoff=0.6)
    hint = f"; did you mean {lowered[close[0]]!r}?" if close else ""
    raise ConfigError(f"{name}={value!r} is not known; set {name} to one of {', '.join(allowed)}{hint}")


@functools.cache
def literal_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """Field name -> allowed values, for each field of dataclass ``cls`` typed
    ``Literal[...]`` (alone or with ``| None``)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is Literal:
            out[f.name] = typing.get_args(hint)
        elif len(args) == 1 and typing.get_origin(args[0]) is Literal:
            out[f.name] = typing.get_args(args[0])
    return out


def _check_choices(config: Any) -> None:
    for name, allowed in literal_choices(type(config)).items():
        value = getattr(config, name)
        if value is not None:
            check_choice(name, value, allowed)


@functools.cache
def _top_level_classes(filename: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse(Path(filename).read_text(encoding="utf-8"), filename)
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal under the field in the class body,
    dedented), for dataclass ``cls`` and the dataclasses it inherits from. Read from the
    source (each module parsed once), so the text stays where a reader of the class sees
    it; ``cls`` must be defined at the top level of its module."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        filename = inspect.getsourcefile(klass)
        node = _top_level_classes(filename).get(klass.__name__) if filename else None
        if node is None:  # no source shipped (a frozen or .pyc-only install), or a nested class
            raise RuntimeError(f"cannot read the field docstrings of {klass.__qualname__}: no source for it")
        for stmt, nxt in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                out[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def schedule_problem(*, sync_every: int, num_fragments: int, overlap: int, desloc_ku: int | None = None,
                     desloc_kv: int | None = None) -> str | None:
    """The first rule that H, P, tau and DES-LOC's periods break, as a sentence saying what
    to change; None when they hold. The one statement of these rules: ``ScheduleConfig``
    asks it of a config, ``core.settings.RunRules.validate`` of what a learner reports
    at hello (the wire refuses a hello that breaks one)."""
    if sync_every < 1:
        return f"sync_every (H) must be >= 1, got {sync_every}"
    for name, k in (("desloc_ku", desloc_ku), ("desloc_kv", desloc_kv)):
        if k is not None and (k < 1 or k % sync_every):
            return (f"{name}={k} is not a positive multiple of sync_every (H)={sync_every}: moments leave with "
                    f"a parameter send of their fragment; set {name} to a multiple of {sync_every} (or None for "
                    "the default)")
    if num_fragments < 1:
        return f"num_fragments (P) must be >= 1, got {num_fragments}"
    if overlap < 0:
        return f"overlap (tau) must be >= 0, got {overlap}"
    if overlap >= sync_every:
        return (f"overlap (tau)={overlap} must be smaller than sync_every (H)={sync_every}: a fragment's merged "
                "value must land before the fragment is due again; lower overlap or raise sync_every")
    return None


@frozen_config
@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """When fragments leave a learner: the sync period, the fragment count, the overlap."""

    sync_every: int = 24
    """H: inner steps between two syncs of the same fragment. H=1 syncs every step."""

    num_fragments: int = 24
    """P: how many fragments the parameters are split into. P=1 is classic DiLoCo.
    Fragment offsets are spread over [0, H) so at most ceil(P/H) leave per step."""

    overlap: int = 2
    """tau: inner steps a learner keeps computing between sending a fragment and
    applying the merged value. 0 applies at once (blocking in deterministic mode).
    Must be < sync_every. The syncer's grace window depends on it: it is started with
    the same value (``rackmend syncer --overlap``) and refuses a learner with another."""

    packing: Packing = "balanced"
    """How tensors go into fragments: ``balanced`` (greedy bin-packing of whole
    tensors by bytes) or ``strided`` (block i of the model's repeated block list
    goes to fragment i mod P; other tensors fill the lightest fragment)."""

    sync_buffers: bool = True
    """Persistent floating-point buffers (BatchNorm running statistics) travel with their
    fragment and merge by the weighted mean of the learners' values, without an outer
    step, so the global model carries statistics that match its weights (a
    ``running_var`` with its ``running_mean``: the pooled variance, which counts the
    spread between racks' means; docs/algorithm.md). Integer buffers
    (``num_batches_tracked``) always stay local. False: every buffer stays local (each
    rack keeps its own statistics; the syncer's global model then has none). Must be
    the same on every learner (it changes the layout)."""

    desloc: bool = False
    """DES-LOC: also average the inner optimizer's moments across learners, Adam's
    ``exp_avg`` every ``desloc_ku`` and ``exp_avg_sq`` every ``desloc_kv`` steps per
    fragment (weighted mean with the weights of parameter merges, no outer step); each
    learner overwrites its moments with the mean tau steps after sending them. Needs
    ``torch.optim.Adam`` or ``AdamW`` (without ``amsgrad``) as the inner optimizer and a
    single-process learner. Off by default: on the demo GPT (M=4, H=16) it made held-out
    loss worse on all 3 seeds (median 2.343 against 2.303, one seed blew up to 3.42;
    docs/benchmarks.md, "DES-LOC"). Every learner must use the same value. Wrong shows
    as ``moments`` records missing from the syncer's log (off when meant on), or as a
    loss that jumps after ``moments`` rounds and ``guard`` clips: with K_u < K_v a
    learner divides the fleet's first moment by its own second moment, which is near
    zero where its data are sparse (docs/tuning.md); set ``desloc_kv = desloc_ku``."""

    desloc_ku: int | None = None
    """K_u: inner steps between two averagings of a fragment's ``exp_avg`` (first
    moment); None: 3 x sync_every. A multiple of ``sync_every``, so the moments leave
    with a parameter send of the fragment and merge with the same weights. Too small
    costs uplink (each send is as large as the fragment) for little gain; too large
    lets the learners' momenta drift apart between averagings."""

    desloc_kv: int | None = None
    """K_v: inner steps between two averagings of a fragment's ``exp_avg_sq`` (second
    moment); None: 6 x sync_every. A multiple of ``sync_every``. The second moment
    changes slowly, so it can be averaged less often than the first."""

    def moment_periods(self) -> tuple[int, int]:
        """(K_u, K_v) with the defaults of ``desloc_ku`` and ``desloc_kv`` filled in."""
        H = self.sync_every
        return (self.desloc_ku if self.desloc_ku is not None else 3 * H,
                self.desloc_kv if self.desloc_kv is not None else 6 * H)

    def validate(self) -> None:
        for name in ("desloc_ku", "desloc_kv"):
            k = getattr(self, name)
            _check(k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 1),
                   f"{name} must be a whole number of inner steps >= 1, or None for the default, got {k!r}")
        problem = schedule_problem(sync_every=self.sync_every, num_fragments=self.num_fragments,
                                   overlap=self.overlap, desloc_ku=self.desloc_ku, desloc_kv=self.desloc_kv)
        _check(problem is None, problem or "")
        _check_choices(self)

    def __post_init__(self) -> None:
        self.validate()


@frozen_config
@dataclass(frozen=True, kw_only=True)
class SyncerConfig:
    """How the syncer decides when a round ends, how it merges and how it steps."""

    min_quorum: int = 1
    """K: contributions (from distinct learners) a round needs before it can end."""

    learners: tuple[str, ...] = ()
    """Ids of the learners allowed to join, if known in advance (the syncer service
    refuses any other id at join; comma-separated in a flag or an environment variable,
    a list in TOML). Rounds end early once every one of them that is healthy is in.
    Empty: any id may join, and every learner that joins is expected."""

    overlap: int | None = None
    """tau, pinned on the syncer: a learner whose ``ScheduleConfig.overlap`` differs is
    refused at join. None (the default): the run takes tau, like H, P and the apply rule,
    from the first learner to join, and refuses a later one that differs. The syncer's
    grace window depends on it."""

    grace_max: float = 2.0
    """Upper bound in seconds on the grace window after quorum, and the window used
    before any step-time estimate exists. Too large: rounds wait for dead learners
    that long before their first estimate. Too small: stragglers always miss."""

    grace_gamma: float = 0.8
    """gamma in (0, 1]: the share of the slack (slack steps x step time - quorum time -
    sync time) spent waiting for stragglers. The slack steps are tau when learners drop
    the steps made since a send on applying (``apply="overwrite"`` or ``"mix"``), and
    H - tau with ``keep_local`` (the asynchronous default), where a later value costs
    no work as long as it is back before the fragment's next send
    (``RackmendConfig.grace_slack_steps``). Below 1 so noise in the estimates does not
    make learners stall or send stale work."""

    ema_decay: float = 0.8
    """Weight of the old value in the moving averages of step, quorum and sync times
    (0 = only the newest sample counts)."""

    weighting: Weighting = "tokens_sq_per_step"
    """Contribution weight: ``tokens_sq_per_step`` (c_tokens**2 / c_steps: more work and
    faster work weigh more), ``tokens`` (c_tokens) or ``uniform``."""

    merge: Merge = "mean"
    """``mean`` (weighted average of outer gradients) or ``rda`` (radial-directional:
    weighted mean norm times the direction of the weighted mean of unit vectors,
    per tensor; embedding tensors always use mean)."""

    outer_optimizer: str = "SGD"
    """Name of a ``torch.optim`` optimizer class run on the syncer's copy of each
    fragment, with the merged outer gradient as ``.grad``."""

    outer_lr: float = 1.0
    """Learning rate of the outer optimizer. With SGD and no momentum (the default), 1.0
    sets each fragment to the weighted mean of the learners' values. Chosen by
    ``benchmarks/quality.py`` (docs/benchmarks.md, "Training quality"): on the demo GPT
    (M=4, H=16, P=4, tau=2) lr 1.0 without momentum reached held-out loss 2.32 where
    DiLoCo's lr 0.7 with Nesterov momentum 0.9 reached 2.75, worse than one learner
    alone; it stayed the best or tied at H=8 and 32 and M=2 and 8. Too high shows as
    negative merge gains (``merge_harmful`` in the log), too low as slow progress."""

    outer_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for the outer optimizer's constructor (a JSON object on the
    command line, e.g. ``{"momentum": 0.9}``). None: no momentum
    for SGD (see ``outer_lr``), torch's defaults for any other optimizer. DiLoCo's large-
    model setting is ``{"momentum": 0.9, "nesterov": True}`` with ``outer_lr=0.7``; it
    suits long periods (H in the hundreds), not short ones."""

    anchoring: Anchoring = "syncer"
    """How a stale contribution (based on an older version than the current one) is
    applied: ``syncer`` re-anchors it on the current value (delta + theta_now -
    theta_base, the Decoupled DiLoCo reading; the syncer keeps the last
    ``max_staleness`` versions of each fragment in memory), ``learner_base`` applies
    it as is. ``learner_base`` counts a lagging learner's progress twice under
    Nesterov momentum and diverged in the in-process demo (held-out loss 3.48 -> 3.81
    while ``syncer`` went on to 2.76; see docs/algorithm.md)."""

    max_staleness: int = 4
    """Contributions more than this many versions behind are dropped (logged)."""

    staleness_decay: float = 0.0
    """CGAD's alpha (Cosine-Gated Adam-Decay, arXiv 2605.09126): the outer gradient of a
    contribution ``tau`` versions behind its fragment's current version (counted per
    fragment, the paper's PA-CGAD) is multiplied by ``exp(-staleness_decay * tau)``, times
    the gate of ``staleness_cutoff``, before it is merged. The merge weights are not
    renormalised, so a stale contribution moves the value less and the fresh ones do not
    move it more. Fresh contributions (``tau`` = 0) and buffers (BatchNorm statistics,
    set to the weighted mean) are never scaled. 0 with ``staleness_cutoff`` unset (the
    default) is off: every contribution counts in full, as before. It matters only in
    asynchronous runs; deterministic mode has no stale contributions. The paper pairs it
    with ``outer_optimizer="Adam"`` (and reduces to plain Adam at ``tau`` = 0). With
    ``anchoring="syncer"`` a stale contribution is already rebased onto the current
    value; CGAD then trusts that rebased work less. Each merge logs the scales it
    applied (``stale_scales``); docs/algorithm.md describes it."""

    staleness_cutoff: int | None = None
    """CGAD's cosine gate ``tau_c`` in versions: the outer gradient of a contribution
    ``tau`` versions behind is also multiplied by ``0.5 * (1 + cos(pi * tau /
    staleness_cutoff))`` below the cutoff and by 0 at or beyond it (a zero at its usual
    weight, like an absent learner's). None (the default): no gate. Contributions more
    than ``max_staleness`` behind are refused before the merge, so a cutoff above
    ``max_staleness`` + 1 never zeroes one and only softens the scale of those accepted;
    a cutoff at or below ``max_staleness`` zeroes accepted work, which still takes its
    share of the weight and so damps the round (lower ``max_staleness`` to refuse such
    work instead). Asynchronous runs only, like ``staleness_decay``."""

    count_absent: bool = True
    """In a round that closes without every connected learner, count each missing one
    whose work went into one of this fragment's last ``max_staleness`` versions (a
    joined peer that never contributes, or stopped, is not counted) as contributing a
    zero outer gradient at its usual weight (its latest counters),
    so the round moves the global value by the present learners' share of the work
    only. Off, a round that closes on one learner of four sets the value to that
    learner's model (with ``outer_lr`` 1): the fragments jump between learners'
    models instead of averaging them, and asynchronous training ended worse than
    plain averaging on the demo GPT (``benchmarks/quality.py``, docs/benchmarks.md).
    A round with every connected learner in (always, in deterministic mode) is not
    changed by it. The share given to absent learners is logged per merge
    (``absent_share``); a share near 1 in most merges means rounds close too early
    (raise ``min_quorum`` or ``grace_max``)."""

    norm_guard: float = 30.0
    """Poisoning guard: per fragment, a contribution whose outer-gradient norm exceeds
    ``norm_guard`` x the lower median norm of the other learners' contributions among the
    last ``GUARD_WINDOW`` (32) merged, unclipped ones (its own when it is alone), times how
    much more work than usual it holds (its steps over the usual, credited only while its
    step counter advances at a believable rate, plus one per version its base is behind;
    1 to ``GUARD_STEPS_CAP`` = 64), is clipped to that bound (logged as ``guard`` with both
    norms and both step counts). A learner adds at most one norm per merge, never to its
    own bound, and the scale grows by at most ``GUARD_GROWTH`` (2x) per merge and
    ``GUARD_LONG_GROWTH`` (2x) over its history's median, so no learner can ratchet its
    bound up by sending ever larger gradients just under it. No guard
    until ``GUARD_MIN_NORMS`` (5) nonzero norms are known. Clipped rather than rejected:
    an honest learner back from a long outage legitimately sends a larger gradient, and
    clipping keeps its direction and work while capping what any one send can move.
    Honest outliers exist: in ``make demo`` (2026-12-04) a learner restarted after a
    SIGKILL, with a fresh AdamW state, sent 10.7-12.6x the median for its first sends,
    so the default leaves a margin of about 2.5 over that. If ``guard`` events name
    honest learners, their work is being clipped: raise it (0 disables the guard).
    DES-LOC moments are clipped to it (squared for ``exp_avg_sq``) x the lower median of
    their round's norms."""

    failslow: bool = True
    """Fail-slow detection (``rackmend.core.failslow``): from the step times learners
    report, flag a learner whose steps got slower and climb the mitigation ladder
    (events ``failslow_*`` in the log). Off in deterministic mode, whose rounds wait
    for the whole roster by definition."""

    failslow_min_slowdown: float = 0.10
    """Smallest slowdown confirmed, as a fraction of the learner's own baseline step time
    (and of the fleet's change over the same time). Too low shows as learners flagged
    for slowdowns nobody cares about; too high lets a sick rack hide below it."""

    failslow_min_steps: int = 10
    """Inner steps a slowdown must last before it is confirmed; shorter ones are blips
    (``failslow_blip``, ignored). Raise it if brief stalls (checkpoint writes, data
    loader hiccups) get learners flagged."""

    failslow_false_alarm_steps: float = 1e7
    """Designed mean number of inner steps of one healthy learner between false alarms;
    the change-point thresholds follow from it. Healthy learners flagged and restored
    again and again (``failslow_slow`` then ``failslow_restore`` on a rack nobody
    touched): raise it. Real slowdowns found too late: lower it; each factor of 10
    costs about ln(10) / (delta**2 / 2) steps of delay (docs/benchmarks.md)."""

    failslow_baseline_steps: int = 256
    """Inner steps of a learner's own history its baseline is taken over (median and
    spread of log step time), admitted with a lag of half of it so a slow ramp cannot
    drag the baseline along; detection starts once half of it is known. Shorter reacts
    to legitimate changes (sequence length) sooner but makes the baseline noisier (more
    false alarms)."""

    failslow_advise_after: int = 30
    """Inner steps a confirmed slowdown must have lasted before the learner is told
    (``on_fail_slow``); rounds stop waiting for it as soon as it is confirmed. 0 tells
    it at once."""

    failslow_evict_cost: float = 3600.0
    """Fleet-seconds after which a slow learner is marked for eviction
    (``failslow_evict``; the syncer does not disconnect it). The cost counts, from the
    slowdown's onset, its extra seconds per step over the fleet's median times the
    steps times the other learners, i.e. the fleet time lost if rounds waited for it.
    Marks on racks that recover by themselves: raise it; racks left slow for hours
    before anyone hears: lower it."""

    def validate(self) -> None:
        _check(self.min_quorum >= 1, f"min_quorum (K) must be >= 1, got {self.min_quorum}")
        _check(self.failslow_min_slowdown > 0,
               f"failslow_min_slowdown must be > 0 (a fraction, 0.1 = 10 %), got {self.failslow_min_slowdown}")
        _check(self.failslow_min_steps >= 1, f"failslow_min_steps must be >= 1, got {self.failslow_min_steps}")
        _check(self.failslow_false_alarm_steps > 1,
               f"failslow_false_alarm_steps must be > 1 steps, got {self.failslow_false_alarm_steps}; 1e7 is the "
               "default")
        _check(self.failslow_baseline_steps >= 8,
               f"failslow_baseline_steps must be >= 8 steps, got {self.failslow_baseline_steps}; 256 is the default")
        _check(self.failslow_advise_after >= 0,
               f"failslow_advise_after must be >= 0 steps, got {self.failslow_advise_after}")
        _check(self.failslow_evict_cost > 0,
               f"failslow_evict_cost must be > 0 fleet-seconds, got {self.failslow_evict_cost}")
        _check(
            len(set(self.learners)) == len(self.learners),
            f"learners lists a learner id twice: {list(self.learners)}",
        )
        if self.learners:
            _check(
                self.min_quorum <= len(self.learners),
                f"min_quorum (K)={self.min_quorum} is larger than the {len(self.learners)} expected "
                "learners: no round could ever end; lower min_quorum or list more learners",
            )
        _check(self.overlap is None or self.overlap >= 0,
               f"overlap (tau) must be None (the learners') or >= 0, got {self.overlap}")
        _check(self.grace_max >= 0, f"grace_max must be >= 0 seconds, got {self.grace_max}")
        _check(
            0 < self.grace_gamma <= 1,
            f"grace_gamma must lie in (0, 1], got {self.grace_gamma}; 0.8 is a safe choice",
        )
        _check(0 <= self.ema_decay < 1, f"ema_decay must lie in [0, 1), got {self.ema_decay}")
        _check_choices(self)
        _check(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        _check(
            math.isfinite(self.staleness_decay) and self.staleness_decay >= 0,
            f"staleness_decay must be a finite number >= 0 (CGAD's alpha per version; 0 is off), "
            f"got {self.staleness_decay}",
        )
        _check(
            self.staleness_cutoff is None or self.staleness_cutoff >= 1,
            f"staleness_cutoff must be None (no gate) or >= 1 versions, got {self.staleness_cutoff}: below 1 even "
            "fresh contributions would count as zero",
        )
        _check(
            self.norm_guard == 0 or self.norm_guard >= 1,
            f"norm_guard must be 0 (off) or >= 1 (a multiple of the median norm), got {self.norm_guard}; "
            "below 1 it would clip about half of all honest contributions; 30 is the default",
        )
        cls = getattr(torch.optim, self.outer_optimizer, None)
        _check(
            isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer),
            f"outer_optimizer={self.outer_optimizer!r} is not a torch.optim optimizer class; "
            "use e.g. 'SGD', 'Adam' or 'AdamW'",
        )
        _check(self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}")
        self.build_outer_optimizer([torch.zeros(1)])  # surfaces bad outer_kwargs now, not at the first merge

    def __post_init__(self) -> None:
        # Copies, so the caller's list or dict changed later cannot reach this config.
        object.__setattr__(self, "learners", tuple(self.learners))
        if self.outer_kwargs is not None:
            object.__setattr__(self, "outer_kwargs", FrozenMapping(self.outer_kwargs))
        self.validate()

    def resolved_outer_kwargs(self) -> dict[str, Any]:
        """``outer_kwargs`` with the documented default filled in."""
        if self.outer_kwargs is not None:
            return dict(self.outer_kwargs)
        return {}

    def build_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The outer optimizer for one fragment's tensors."""
        cls = getattr(torch.optim, self.outer_optimizer)
        kwargs = self.resolved_outer_kwargs()
        try:
            return cls(params, lr=self.outer_lr, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"outer_kwargs={kwargs!r} do not fit torch.optim.{self.outer_optimizer}: {exc}"
            ) from exc


@frozen_config
@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """How a learner applies merged values it receives."""

    apply: ApplyRule = "auto"
    """``overwrite`` (theta <- merged), ``mix`` (theta <- alpha*theta + (1-alpha)*merged),
    ``keep_local`` (theta <- merged + progress made since the send) or ``auto``:
    ``overwrite`` in deterministic mode (the value always arrives at t_send + tau, as in
    the papers and the reference), ``keep_local`` otherwise. Asynchronously a value can
    arrive later than t_send + tau; ``overwrite`` then drops every step made since the
    send, work that is counted nowhere. ``keep_local`` keeps it, which also lets the
    syncer's grace window wait for stragglers up to the learners' next send instead of
    only tau steps (see ``SyncerConfig.grace_gamma``): on the demo GPT that took
    asynchronous training from worse than plain averaging to level with it
    (docs/benchmarks.md, "Training quality")."""

    mix_alpha: float = 0.5
    """alpha of the ``mix`` rule: the share of the local value kept."""

    tokens_per_step: float | None = None
    """What one inner step of this rank is worth when ``step()`` is called without
    ``tokens`` (the Hugging Face ``Trainer`` does that): e.g. batch size x sequence
    length. Merge weights grow with token counts, so a rack that counts 1 per step
    beside racks that count thousands weighs almost nothing (the syncer logs a
    ``token_units`` warning when it sees that). None: 1 per step, with a warning."""

    wait_timeout: float = 600.0
    """Seconds a blocking wait for a merged value (deterministic mode) may take before it
    fails with an error instead of hanging. Raise it when one merge legitimately takes
    longer."""

    join_timeout: float = 120.0
    """Seconds joining the syncer may take before it fails with an error naming the
    endpoint and what to check; meanwhile the link logs what it waits for every few
    seconds. Short enough for a person watching a terminal. Raise it when learners are
    started well before the syncer, or when the first learner's initial upload over a
    slow link takes longer (every learner waits for it)."""

    tensorboard_dir: str | None = None
    """Write TensorBoard scalars of this learner here (merges applied, staleness, time
    blocked, bytes sent and received; docs/operations.md, "Metrics"), one event file per
    process (ranks of a multi-rank learner in ``rank<N>`` subdirectories). Needs the
    optional ``tensorboard`` package (``pip install tensorboard``); None: nothing written."""

    def validate(self) -> None:
        _check_choices(self)
        _check(self.tensorboard_dir is None or bool(str(self.tensorboard_dir).strip()),
               "tensorboard_dir is empty; give a directory, or None for no TensorBoard scalars")
        _check(0 <= self.mix_alpha <= 1, f"mix_alpha must lie in [0, 1], got {self.mix_alpha}")
        _check(self.wait_timeout > 0, f"wait_timeout must be > 0 seconds, got {self.wait_timeout}")
        _check(self.tokens_per_step is None or self.tokens_per_step > 0,
               f"tokens_per_step must be > 0 (tokens one step trains on) or None, got {self.tokens_per_step}")
        _check(self.join_timeout > 0,
               f"join_timeout must be > 0 seconds, got {self.join_timeout}; the default is 120")

    def __post_init__(self) -> None:
        self.validate()


@frozen_config
@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Codecs of the two directions. Each is a spec string ``name[:key=value,...]``
    naming a codec of ``rackmend.codecs.CODECS`` (``none``, ``bf16``, ``int8``, ``int4``,
    ``powersgd``), e.g. ``"int4"``, ``"int4:block_size=32"``, ``"powersgd:rank=4"``.
    Lossy codecs need float32 parameters and carry an error-feedback residual."""

    uplink: str = field(default="none", metadata={OPTION: "uplink_codec"})
    """Codec of the learners' outer gradients (learner -> syncer). Each learner keeps
    a residual per fragment tensor and adds it to the next send, so what is dropped
    now is sent later. The syncer accepts whatever registered codec a learner uses
    (messages name their codec); this field is what learners encode with."""

    downlink: str = field(default="none", metadata={OPTION: "downlink_codec"})
    """Codec of the syncer's updates (syncer -> learners): each merge sends the
    encoded change since the previous version, and the syncer sets its own value to
    exactly what learners reconstruct, so every copy stays bit-identical. The syncer
    keeps the residual. Joins and resynchronisations always travel uncompressed."""

    moments: str = field(default="none", metadata={OPTION: "moments_codec"})
    """Codec of DES-LOC's moments (``ScheduleConfig.desloc``), both ways: ``none`` or
    ``bf16``. Learners send their moments with it and the syncer sends the mean with it,
    setting its own copy to exactly what learners decode. Values rather than changes
    travel, so there is no error feedback. ``bf16`` halves the bytes at a relative error
    of at most 0.4 % per value. The block-wise integer codecs are refused: they round
    the small second moments of a block to zero, and Adam divides by their square root
    (on the test model, one int8 round blew a learner's step up a thousandfold);
    ``powersgd`` would turn second moments negative. Learners and the syncer must agree."""

    def validate(self) -> None:
        for name in ("uplink", "downlink", "moments"):
            self._build(name)
        _check(self._build("moments").name in MOMENT_CODECS,
               f"compression.moments={self.moments!r} is not allowed for moments; use one of "
               f"{', '.join(MOMENT_CODECS)}: integer codecs round small second moments to zero (Adam divides by "
               "their square root) and powersgd turns them negative")

    def __post_init__(self) -> None:
        self.validate()

    def _build(self, name: str) -> Codec:
        text = getattr(self, name)
        try:
            return parse_codec_spec(text)
        except CodecError as exc:
            raise ConfigError(
                f"compression.{name}={text!r}: {exc}. Codecs: {', '.join(CODECS)}; "
                "spec form name[:key=value,...], e.g. 'int4:block_size=32' or 'powersgd:rank=4'"
            ) from None

    def require_float32(self, name: str, tensors: Iterable[tuple[str, torch.dtype]]) -> None:
        """ConfigError naming the first non-float32 tensor when codec ``name`` (``uplink``,
        ``downlink`` or ``moments``) is lossy: codecs encode float32 only, and silently sending such
        tensors uncompressed would hide that the setting has no effect."""
        if self._build(name).lossless:
            return
        for tensor, dtype in tensors:
            _check(dtype == torch.float32,
                   f"compression.{name}={getattr(self, name)!r} is lossy and needs float32 parameters, but "
                   f"{tensor} is {dtype}; keep float32 master weights (autocast for the compute) or use "
                   f"{name}='none'")

    def build_uplink(self) -> Codec:
        """The codec learners encode outer gradients with."""
        return self._build("uplink")

    def build_downlink(self) -> Codec:
        """The codec the syncer encodes update deltas with."""
        return self._build("downlink")

    def build_moments(self) -> Codec:
        """The codec DES-LOC's moments travel with, both ways."""
        return self._build("moments")


@frozen_config
@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The settings of a run the syncer has of its own: all of ``RackmendConfig`` but the
    schedule and how a learner applies merged values. ``rackmend syncer`` builds one of
    these. H, P, tau, DES-LOC's periods and the apply rule are the learners' (their
    ``RunRules``, reported at hello): the first learner's values hold for the run, and the
    syncer never makes any up (``SyncerConfig.overlap`` may pin tau)."""

    syncer: SyncerConfig = field(default_factory=SyncerConfig)
    """Quorum, grace, weighting, merge and outer optimizer."""

    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Codecs of outer gradients (uplink) and updates (downlink); lossless by default."""

    deterministic: bool = False
    """Bit-for-bit reproducible runs: every learner blocks at t_send + tau until the
    merged value is there, and every round waits for the whole roster (no grace timing).
    Slower by design; for tests and debugging. The syncer (``rackmend syncer
    --deterministic``) and every learner must agree; a learner that does not is refused."""

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value.validate()

    def __post_init__(self) -> None:
        self.validate()

    def replace(self, **changes: Any) -> Self:
        """A copy with top-level fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@frozen_config
@dataclass(frozen=True, kw_only=True)
class RackmendConfig(RunConfig):
    """Everything a rackmend run needs; learner and syncer must use equal values."""

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Sync period, fragments and overlap."""

    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """How merged values are applied on the learner."""

    def validate(self) -> None:
        super().validate()
        pinned = self.syncer.overlap
        _check(pinned is None or pinned == self.schedule.overlap,
               f"SyncerConfig.overlap={pinned} pins tau on the syncer, but ScheduleConfig.overlap is "
               f"{self.schedule.overlap}: the syncer would refuse this learner; set both to one value (or leave "
               "SyncerConfig.overlap at None)")

    def apply_rule(self) -> str:
        """``learner.apply`` with ``auto`` resolved (see ``LearnerConfig.apply``)."""
        if self.learner.apply != "auto":
            return self.learner.apply
        return "overwrite" if self.deterministic else "keep_local"

    def grace_slack_steps(self) -> int:
        """Inner steps a merged value may take past a send before learners lose by its
        lateness: tau when the apply rule drops the steps made since the send, else
        H - tau, at least tau (it should be back before the fragment's next send, with
        tau steps to spare for the transfers)."""
        sch = self.schedule
        if self.apply_rule() == "keep_local":
            return max(sch.overlap, sch.sync_every - sch.overlap)
        return sch.overlap
