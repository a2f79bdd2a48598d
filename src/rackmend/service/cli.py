"""``rackmend syncer`` and ``rackmend keygen``: flags, config file and environment.

Every option can come from a flag, from the TOML file given by ``--config`` (same
names with underscores) or from an environment variable ``RACKMEND_<NAME>``; a flag
wins over the environment, which wins over the file, which wins over the default.
``docs/multinode.md`` lists the options as one table (``rackmend syncer --help``
prints the same).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rackmend.config import (
    CompressionConfig,
    ConfigError,
    LearnerConfig,
    RackmendConfig,
    ScheduleConfig,
    SyncerConfig,
)

__all__ = ["OPTIONS", "add_syncer_arguments", "syncer_main", "add_keygen_arguments", "keygen_main"]

ENV_PREFIX = "RACKMEND_"

LEARNER_ENV = ("RACKMEND_LEARNER_ID", "RACKMEND_CONNECT")
"""``RACKMEND_*`` names read on the learner side (``RackmendOptimizer``, ``ZmqLink.from_env``):
valid in a shared environment, so the syncer does not warn about them."""

log = logging.getLogger("rackmend.syncer")


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false), got {v!r}")


def _ids(v: Any) -> tuple[str, ...]:
    if isinstance(v, (list, tuple)):
        return tuple(str(x) for x in v)
    return tuple(x.strip() for x in str(v).split(",") if x.strip())


def _json_map(v: Any) -> dict[str, Any] | None:
    if v is None or isinstance(v, dict):
        return v
    out = json.loads(v)
    if not isinstance(out, dict):
        raise ValueError("expected a JSON object like {\"momentum\": 0.9}")
    return out


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    section: str  # service | schedule | syncer | compression | run


OPTIONS: tuple[Option, ...] = (
    Option("bind", str, "tcp://127.0.0.1:5555", "ZeroMQ endpoint to listen on (port 0: any free port)", "service"),
    Option("insecure", _bool, False, "allow a non-loopback bind without Curve keys", "service"),
    Option("secret_key", str, None, "the syncer's .key_secret file (turns CurveZMQ on)", "service"),
    Option("allowed_keys", str, None, "directory of learner public .key files allowed to connect", "service"),
    Option("checkpoint_dir", str, None, "directory for checkpoints (none: no checkpoints)", "service"),
    Option("checkpoint_every", int, 50, "checkpoint every N merges (and on SIGTERM/SIGINT)", "service"),
    Option("resume", _bool, False, "continue from the checkpoint in --checkpoint-dir", "service"),
    Option("heartbeat_timeout", float, 10.0, "seconds of silence before a learner rank counts as gone", "service"),
    Option("max_message_mb", float, None, "largest message accepted, in MiB (default: the model's largest "
           "fragment plus the header bound, once known; a fresh start keeps ZeroMQ's pre-read cap at 2 GiB, so pass "
           "it for a tight bound)", "service"),
    Option("takeover_after", float, 5.0, "seconds a learner rank must be silent before a hello for it from another "
           "connection takes its place (sooner: refused and logged as identity_refused)", "service"),
    Option("log", str, None, "JSONL event log (merges, joins, rejections)", "service"),
    Option("log_burst", int, 5, "per connection and kind of bad input, the most log records per 10 s; the rest are "
           "counted in one 'suppressed' record", "service"),
    Option("init_timeout", float, 60.0, "seconds the first learner may take per initial fragment before "
           "another waiting learner is asked to seed the model", "service"),
    Option("metrics_port", int, 0, "serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: off; "
           "docs/operations.md lists them)", "service"),
    Option("metrics_host", str, "127.0.0.1", "address of the metrics endpoint (unauthenticated: another than "
           "loopback is warned about)", "service"),
    Option("ready_file", str, None, "write the bound endpoint here once listening (for scripts)", "run"),
    Option("overlap", int, 2, "tau of the learners (used by the grace window); a learner with another "
           "tau is refused", "schedule"),
    Option("min_quorum", int, 1, "K: fresh contributions a round needs", "syncer"),
    Option("learners", _ids, (), "expected learner ids, comma-separated; only these may join (empty: whoever "
           "joins)", "syncer"),
    Option("grace_max", float, 2.0, "upper bound of the grace window, seconds", "syncer"),
    Option("grace_gamma", float, 0.8, "share of the overlap slack spent waiting for stragglers", "syncer"),
    Option("weighting", str, "tokens_sq_per_step", "tokens_sq_per_step | tokens | uniform", "syncer"),
    Option("merge", str, "mean", "mean | rda", "syncer"),
    Option("outer_optimizer", str, "SGD", "a torch.optim class name", "syncer"),
    Option("outer_lr", float, 1.0, "outer learning rate", "syncer"),
    Option("outer_kwargs", _json_map, None, "JSON object of extra outer optimizer arguments", "syncer"),
    Option("anchoring", str, "syncer", "syncer | learner_base (stale contributions)", "syncer"),
    Option("max_staleness", int, 4, "drop contributions this many versions behind", "syncer"),
    Option("count_absent", _bool, True, "true | false: count a connected learner missing from a round as "
           "sending zero at its usual weight, so a round closing on few learners moves the global value by "
           "their share only", "syncer"),
    Option("norm_guard", float, 30.0, "clip a contribution whose norm exceeds this multiple of the fragment's "
           "recent median norm (0: off)", "syncer"),
    Option("no_failslow", _bool, False, "turn fail-slow detection off (no failslow_* events; rounds keep "
           "waiting for slow learners)", "run"),
    Option("failslow_min_slowdown", float, 0.10, "smallest slowdown flagged, as a fraction of the learner's "
           "own step time (0.1: 10 %%)", "syncer"),
    Option("failslow_min_steps", int, 10, "steps a slowdown must last to be flagged (shorter: a blip)", "syncer"),
    Option("failslow_false_alarm_steps", float, 1e7, "designed steps between false alarms of one healthy "
           "learner (higher: fewer false alarms, later detection)", "syncer"),
    Option("failslow_baseline_steps", int, 256, "steps of a learner's own history its baseline step time is "
           "taken over (detection starts after half of it)", "syncer"),
    Option("failslow_advise_after", int, 30, "steps a slowdown lasts before the learner is told "
           "(on_fail_slow)", "syncer"),
    Option("failslow_evict_cost", float, 3600.0, "fleet-seconds a slow learner may cost before it is marked "
           "for eviction", "syncer"),
    Option("uplink_codec", str, "none", "codec learners use for outer gradients (name[:key=value,...], e.g. "
           "int4 or powersgd:rank=4); the syncer accepts any registered codec and logs it per merge",
           "compression"),
    Option("downlink_codec", str, "none", "codec of the syncer's updates (e.g. int8); joins and fetches stay "
           "full precision; learners must be configured with the same", "compression"),
    Option("deterministic", _bool, False, "bit-reproducible mode: rounds wait for the whole roster; learners "
           "must match", "run"),
)


def add_syncer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="TOML file with any of the options below")
    for o in OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        env = ENV_PREFIX + o.name.upper()
        if o.parse is _bool and o.default is False:  # a switch; true-by-default ones take a value
            p.add_argument(flag, action="store_const", const=True, default=None,
                           help=f"{o.help} (env {env})")
        else:
            p.add_argument(flag, default=None, metavar=o.name.upper(),
                           help=f"{o.help} (default {o.default!r}; env {env})")


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Option values: flag, else environment, else config file, else default. Unknown
    ``RACKMEND_*`` environment names are warned about (a misspelt one would be ignored)."""
    environ = dict(os.environ if environ is None else environ)
    for warning in unknown_environment(environ):
        log.warning("%s", warning)
    file_values: dict[str, Any] = {}
    if args.config is not None:
        file_values = tomllib.loads(args.config.read_text())
        unknown = set(file_values) - {o.name for o in OPTIONS}
        if unknown:
            raise ConfigError(f"{args.config}: unknown options {sorted(unknown)}")
    out: dict[str, Any] = {}
    for o in OPTIONS:
        raw, source = getattr(args, o.name), "--" + o.name.replace("_", "-")
        if raw is None and ENV_PREFIX + o.name.upper() in environ:
            raw, source = environ[ENV_PREFIX + o.name.upper()], ENV_PREFIX + o.name.upper()
        if raw is None and o.name in file_values:
            raw, source = file_values[o.name], f"{args.config}:{o.name}"
        if raw is None:
            out[o.name] = o.default
            continue
        try:
            out[o.name] = o.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return out


def unknown_environment(environ: dict[str, str]) -> list[str]:
    """A warning for each ``RACKMEND_*`` name that is neither an option nor a learner-side
    name, with the closest valid name when one is close."""
    valid = [ENV_PREFIX + o.name.upper() for o in OPTIONS] + list(LEARNER_ENV)
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in valid:
            continue
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]}?" if close else "`rackmend syncer --help` lists every option's name"
        out.append(f"ignoring environment variable {name}: not a rackmend syncer option; {hint}")
    return out


def build(values: dict[str, Any]) -> tuple[RackmendConfig, Any]:
    from rackmend.service.syncer import ServiceConfig

    syncer = SyncerConfig(**{o.name: values[o.name] for o in OPTIONS if o.section == "syncer"},
                          failslow=not values["no_failslow"])
    overlap = values["overlap"]
    config = RackmendConfig(
        # The syncer learns H and P from the learners' layout; only tau enters its grace window.
        schedule=ScheduleConfig(sync_every=overlap + 1, num_fragments=1, overlap=overlap),
        syncer=syncer,
        learner=LearnerConfig(),
        compression=CompressionConfig(uplink=values["uplink_codec"], downlink=values["downlink_codec"]),
        deterministic=values["deterministic"],
    )
    service = ServiceConfig(
        bind=values["bind"], insecure=values["insecure"], secret_key_file=values["secret_key"],
        allowed_keys_dir=values["allowed_keys"], checkpoint_dir=values["checkpoint_dir"],
        checkpoint_every=values["checkpoint_every"], resume=values["resume"],
        heartbeat_timeout=values["heartbeat_timeout"], takeover_after=values["takeover_after"],
        max_message_bytes=None if values["max_message_mb"] is None else int(values["max_message_mb"] * 2**20),
        log_path=values["log"], init_timeout=values["init_timeout"], log_burst=values["log_burst"],
        metrics_port=values["metrics_port"], metrics_host=values["metrics_host"],
    )
    return config, service


def syncer_main(args: argparse.Namespace) -> int:
    from rackmend.service.syncer import SyncerService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        values = resolve(args)
        config, service = build(values)
        svc = SyncerService(config, service)
    except ConfigError as exc:
        print(f"rackmend syncer: {exc}", file=sys.stderr)
        return 2
    print(f"rackmend syncer listening on {svc.endpoint}", flush=True)
    if svc.metrics_url:
        print(f"rackmend syncer metrics on {svc.metrics_url}", flush=True)
    if values["ready_file"]:
        tmp = Path(values["ready_file"] + ".tmp")
        tmp.write_text(svc.endpoint)
        tmp.replace(values["ready_file"])
    svc.serve()
    return 0


def add_keygen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, help="where to write NAME.key (public) and NAME.key_secret")
    p.add_argument("name", help="key name, e.g. syncer or the learner id")
    p.add_argument("--learners", default=None, metavar="IDS",
                   help="learner ids this key may use, comma-separated ('*': any), written into the public key "
                        "file; default: the key name is the one id it may use")


def keygen_main(args: argparse.Namespace) -> int:
    import zmq.auth

    args.directory.mkdir(parents=True, exist_ok=True)
    if args.learners is not None:
        from rackmend.transport.wire import valid_learner_id

        bad = [x for x in args.learners.split(",") if x.strip(" ") != "*" and not valid_learner_id(x.strip(" "))]
        if bad or not args.learners.strip():
            print(f"rackmend keygen: --learners {args.learners!r}: give learner ids (1-128 characters of A-Z a-z "
                  "0-9 . _ : @ -) separated by commas, or '*' for any", file=sys.stderr)
            return 2
    public, secret = zmq.auth.create_certificates(str(args.directory), args.name)
    if args.learners is not None:
        # pyzmq writes metadata into the secret file only; the syncer reads the public one.
        text = Path(public).read_text(encoding="utf-8")
        Path(public).write_text(text.replace("metadata\n", f'metadata\n    learners = "{args.learners}"\n', 1),
                                encoding="utf-8")
    os.chmod(secret, 0o600)
    print(f"public key: {public}\nsecret key: {secret} (keep it private; mode 600)")
    return 0
