"""``rackmend syncer`` and ``rackmend keygen``: flags, config file and environment.

Every syncer option can come from a flag, from the TOML file given by ``--config``
(same names with underscores) or from an environment variable ``RACKMEND_<NAME>``; a
flag wins over the environment, which wins over the file, which wins over the default.
An option that is on by default is also turned off by ``--no-NAME``
(``RACKMEND_NO_NAME=1``, ``no_name = true``). ``docs/multinode.md`` lists the options as
one table, printed by ``rackmend syncer --help-markdown``.

The options are not declared here: each is a field of ``ServiceConfig``, ``SyncerConfig``
or ``CompressionConfig``, or ``RunConfig.deterministic``, and its name, default, allowed
values (a ``Literal`` type) and help text (the field's docstring) come from that field.
``ScheduleConfig`` and ``LearnerConfig`` give no options: H, P, tau and how learners apply
merged values are theirs to set, and they report them at hello (``--overlap``,
``SyncerConfig.overlap``, may pin tau).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import faulthandler
import json
import logging
import os
import re
import signal
import sys
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rackmend.config import (
    OPTION,
    OPTION_SCALE,
    CompressionConfig,
    ConfigError,
    RunConfig,
    SyncerConfig,
    check_choice,
    field_docs,
    literal_choices,
)
from rackmend.service.config import ServiceConfig
from rackmend.transport.tokens import TOKEN_DIR_ENV

__all__ = ["OPTIONS", "Option", "add_syncer_arguments", "resolve", "build", "config_flags", "options_markdown",
           "syncer_main", "add_keygen_arguments", "keygen_main"]

ENV_PREFIX = "RACKMEND_"

LEARNER_ENV = ("RACKMEND_LEARNER_ID", "RACKMEND_CONNECT", TOKEN_DIR_ENV)
"""``RACKMEND_*`` names read on the learner side (``RackmendOptimizer``, ``ZmqLink``):
valid in a shared environment, so the syncer does not warn about them."""

SECTIONS: tuple[tuple[type, tuple[str, ...] | None], ...] = (
    (ServiceConfig, None),
    # The schedule is the learners' (the first learner's hello sets it for the run);
    # SyncerConfig.overlap may pin tau.
    (SyncerConfig, None),
    (CompressionConfig, None),
    (RunConfig, ("deterministic",)),
)
"""The dataclasses whose fields are ``rackmend syncer`` options (None: every field), in
the order ``--help`` and the docs list them."""

log = logging.getLogger("rackmend.syncer")


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false), got {v!r}")


def _int(v: Any) -> int:
    # A TOML float or bool must not pass as an int by truncation (2.5 -> 2, true -> 1).
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"expected a whole number, got {v!r}")
    return int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


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


_PARSERS = {"bool": _bool, "int": _int, "float": _float, "str": str, "ids": _ids, "json": _json_map}


def _kind(owner: type, name: str, hint: Any) -> str:
    """The parser an annotation calls for; a new field of another type fails here, at
    import, rather than being taken as a string."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            hint = args[0]
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "choice"
    if origin is tuple and typing.get_args(hint)[:1] == (str,):
        return "ids"
    if origin is dict:
        return "json"
    if hint in (bool, int, float, str):
        return hint.__name__
    raise TypeError(f"{owner.__name__}.{name}: no option parser for type {hint!r}")


@dataclass(frozen=True)
class Option:
    """One ``rackmend syncer`` option: a config dataclass field seen from the command line."""

    name: str
    """Option name: the TOML key; ``--name-with-dashes``; ``RACKMEND_NAME``."""
    owner: type
    """The dataclass that declares the field."""
    field: str
    """The field's name in ``owner`` (differs from ``name`` where the field says so)."""
    kind: str
    """``bool``, ``int``, ``float``, ``str``, ``ids`` (comma-separated), ``json`` or ``choice``."""
    default: Any
    """The field's default, in the option's unit."""
    help: str
    """The field's docstring."""
    choices: tuple[str, ...] | None = None
    """Allowed values of a ``Literal`` field."""
    scale: int | None = None
    """Field value = option value x scale (``OPTION_SCALE``)."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def negatable(self) -> bool:
        """On by default, so ``--no-NAME`` (and ``no_NAME``, ``RACKMEND_NO_NAME``) turn it off."""
        return self.kind == "bool" and self.default is True

    def parse(self, raw: Any) -> Any:
        if self.kind == "choice":
            assert self.choices is not None
            check_choice(self.name, str(raw), self.choices)
            return str(raw)
        return _PARSERS[self.kind](raw)

    def to_field(self, value: Any) -> Any:
        if self.scale is None or value is None:
            return value
        return int(value * self.scale)


def _options(owner: type, only: tuple[str, ...] | None) -> list[Option]:
    hints = typing.get_type_hints(owner)
    docs = field_docs(owner)
    missing = set(only or ()) - set(hints)
    if missing:
        raise TypeError(f"SECTIONS names {sorted(missing)}, which {owner.__name__} does not have")
    out = []
    for f in dataclasses.fields(owner):
        if only is not None and f.name not in only:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        scale = f.metadata.get(OPTION_SCALE)
        kind = "float" if scale is not None else _kind(owner, f.name, hints[f.name])
        choices = literal_choices(owner)[f.name] if kind == "choice" else None
        if f.name not in docs:
            raise TypeError(f"{owner.__name__}.{f.name} has no docstring: it is an option's help text")
        out.append(Option(name=f.metadata.get(OPTION, f.name), owner=owner, field=f.name, kind=kind,
                          default=default / scale if scale is not None and default is not None else default,
                          help=" ".join(docs[f.name].split()), choices=choices, scale=scale))
    return out


OPTIONS: tuple[Option, ...] = tuple(o for owner, only in SECTIONS for o in _options(owner, only))
"""Every ``rackmend syncer`` option (besides ``--config`` and ``--help-markdown``)."""


def _plain(text: str) -> str:
    """Docstring markup (``code``) as Markdown code spans."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _show(value: Any) -> str:
    """A default as it would be written in the TOML file."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return repr(value)


class _PrintMarkdown(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(options_markdown(), end="")
        parser.exit()


def add_syncer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="TOML file with any of the options below")
    p.add_argument("--help-markdown", action=_PrintMarkdown, nargs=0,
                   help="print the options as the Markdown table of docs/multinode.md and exit")
    for o in OPTIONS:
        text = _plain(o.help).replace("%", "%%")  # argparse %-formats help strings
        text += f" [default {_show(o.default)}; env {o.env}]"
        if o.kind == "bool":
            p.add_argument(o.flag, dest=o.name, nargs="?", const=True, default=None, metavar="BOOL", help=text)
            if o.negatable:
                p.add_argument("--no-" + o.flag[2:], dest=o.name, action="store_const", const=False,
                               help=f"the same as {o.flag} false")
        else:
            metavar = "{" + ",".join(o.choices) + "}" if o.choices else o.name.upper()
            p.add_argument(o.flag, dest=o.name, default=None, metavar=metavar, help=text,
                           type=_choice(o.flag, o.choices) if o.choices else None)


def _choice(flag: str, allowed: tuple[str, ...]) -> typing.Callable[[str], str]:
    """An argparse ``type`` for a choice option: its message lists the allowed values and
    names the closest to a typo, as for environment variables and TOML files."""
    def parse(value: str) -> str:
        try:
            check_choice(flag, value, allowed)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value
    return parse


def options_markdown() -> str:
    """The options table of ``docs/multinode.md``: one row per option, the first sentence
    of its help (``rackmend syncer --help`` prints the whole text)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| flag | environment | TOML key | default | meaning |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        flag = f"`{o.flag}`" + (f", `--no-{o.flag[2:]}`" if o.negatable else "")
        first = re.split(r"(?<=[.?!])\s+(?=[A-Z0-9])", _plain(o.help), maxsplit=1)[0]
        if o.choices:
            first += " One of " + ", ".join(f"`{c}`" for c in o.choices) + "."
        rows.append(f"| {flag} | `{o.env}` | `{o.name}` | `{cell(_show(o.default))}` | {cell(first)} |")
    return "\n".join(rows) + "\n"


def _lookup(o: Option, values: dict[str, Any], key: Any, where: str) -> tuple[Any, str] | None:
    """The raw value of ``o`` in one source (``values``, keyed by ``key(name)``) and its
    source's name, with ``no_NAME`` read as the negation."""
    found = [(values[key(o.name)], key(o.name), False)] if key(o.name) in values else []
    if o.negatable and key("no_" + o.name) in values:
        found.append((values[key("no_" + o.name)], key("no_" + o.name), True))
    if not found:
        return None
    if len(found) > 1:
        raise ConfigError(f"{where}: both {found[0][1]} and {found[1][1]} are set; keep one")
    raw, name, negated = found[0]
    if negated:
        try:
            raw = not _bool(raw)
        except ValueError as exc:
            raise ConfigError(f"{where}{name}: {exc}") from None
    return raw, f"{where}{name}"


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Option values by option name: flag, else environment, else config file, else
    default. Unknown ``RACKMEND_*`` environment names are warned about (a misspelt one
    would be ignored); unknown keys in the file are an error."""
    environ = dict(os.environ if environ is None else environ)
    for warning in unknown_environment(environ):
        log.warning("%s", warning)
    file_values: dict[str, Any] = {}
    if args.config is not None:
        try:
            file_values = tomllib.loads(args.config.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"--config {args.config}: {exc}") from None
        keys = [o.name for o in OPTIONS] + ["no_" + o.name for o in OPTIONS if o.negatable]
        unknown = sorted(set(file_values) - set(keys))
        if unknown:
            hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, keys, n=1))
                     else k for k in unknown]
            raise ConfigError(f"{args.config}: unknown options {', '.join(hints)}; `rackmend syncer --help` "
                              "lists them")
    out: dict[str, Any] = {}
    for o in OPTIONS:
        flag = getattr(args, o.name)
        found = ((flag, o.flag) if flag is not None else
                 _lookup(o, environ, lambda n: ENV_PREFIX + n.upper(), "")
                 or _lookup(o, file_values, lambda n: n, f"{args.config}:"))
        if found is None:
            out[o.name] = o.default
            continue
        raw, source = found
        try:
            out[o.name] = o.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return out


def unknown_environment(environ: dict[str, str]) -> list[str]:
    """A warning for each ``RACKMEND_*`` name that is neither an option nor a learner-side
    name, with the closest valid name when one is close."""
    valid = ([o.env for o in OPTIONS] + [ENV_PREFIX + "NO_" + o.name.upper() for o in OPTIONS if o.negatable]
             + list(LEARNER_ENV))
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in valid:
            continue
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]}?" if close else "`rackmend syncer --help` lists every option's name"
        out.append(f"ignoring environment variable {name}: not a rackmend syncer option; {hint}")
    return out


def _fields(owner: type, values: dict[str, Any]) -> dict[str, Any]:
    return {o.field: o.to_field(values[o.name]) for o in OPTIONS if o.owner is owner}


def build(values: dict[str, Any]) -> tuple[RunConfig, ServiceConfig]:
    """The syncer's run config and service config from ``resolve``'s values."""
    config = RunConfig(
        syncer=SyncerConfig(**_fields(SyncerConfig, values)),
        compression=CompressionConfig(**_fields(CompressionConfig, values)),
        **_fields(RunConfig, values),
    )
    return config, ServiceConfig(**_fields(ServiceConfig, values))


def _part(config: RunConfig, owner: type) -> Any:
    if isinstance(config, owner):
        return config
    return next(getattr(config, f.name) for f in dataclasses.fields(config)
                if isinstance(getattr(config, f.name), owner))


def config_flags(config: RunConfig) -> list[str]:
    """``rackmend syncer`` flags that rebuild ``config``'s syncer side (``build``), for
    values other than the defaults."""
    flags: list[str] = []
    for o in OPTIONS:
        if o.owner is ServiceConfig:
            continue
        value = getattr(_part(config, o.owner), o.field)
        if value == o.default:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, tuple):
            text = ",".join(value)
        elif isinstance(value, dict):
            text = json.dumps(value)
        else:
            text = str(value)
        flags += [o.flag, text]
    return flags


def syncer_main(args: argparse.Namespace) -> int:
    from rackmend.service.syncer import SyncerService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config, service = build(resolve(args))
        svc = SyncerService(config, service)
    except ConfigError as exc:
        print(f"rackmend syncer: {exc}", file=sys.stderr)
        return 2
    print(f"rackmend syncer listening on {svc.endpoint}", flush=True)
    if hasattr(signal, "SIGUSR1"):
        # `kill -USR1 PID`: every thread's stack on stderr, for a syncer that seems stuck.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if svc.metrics_url:
        print(f"rackmend syncer metrics on {svc.metrics_url}", flush=True)
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
