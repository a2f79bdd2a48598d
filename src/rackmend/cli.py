"""The ``rackmend`` command line: one sub-command per job.

Each sub-command's module owns its flags (``add_arguments``) and its work
(``main``); this file only dispatches.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["bandwidth_flag", "main", "refuse_renamed"]

_NO_CAP = ("none", "off")


def bandwidth_flag(text: str) -> float | None:
    """A ``--bandwidth`` value, in bits/s, as ``demo``, ``simulate`` and ``link`` all
    read it: a rate with its unit (``50Mbit``, ``800kbit``, ``10MB/s``; see
    ``netem.link.parse_rate``), or ``none``/``off`` for no cap. A bare number is
    refused: it once meant Mbit/s in ``demo``, bytes/s in ``simulate`` and bits/s in
    ``link``."""
    from rackmend.config import ConfigError
    from rackmend.netem.link import parse_rate

    t = text.strip()
    if t.lower() in _NO_CAP:
        return None
    try:
        float(t)
    except ValueError:
        pass
    else:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r} has no unit; write e.g. '{t}Mbit' (bits/s) or "
                                         f"'{t}MB/s' (bytes/s), or 'none' for no cap")
    try:
        return parse_rate(t)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Renamed(argparse.Action):
    """An old flag name that now fails with the name to use instead: a silent alias would
    keep one name meaning two things across sub-commands (``--jitter`` was a latency
    spread in ``demo`` and ``link``, a step-time spread in ``simulate``)."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: object) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} was renamed {self.new}")


def refuse_renamed(parser: argparse.ArgumentParser, renames: dict[str, str]) -> None:
    """Make each old flag of ``renames`` (old -> "--new (what it means)") an error that
    names the new one, hidden from ``--help``."""
    for old, new in renames.items():
        parser.add_argument(old, action=_Renamed, new=new)


def main(argv: list[str] | None = None) -> int:
    from rackmend import demo
    from rackmend.netem import cli as link_cli
    from rackmend.service import cli as service_cli
    from rackmend.service import export, status
    from rackmend.sim import cli as sim_cli

    parser = argparse.ArgumentParser(prog="rackmend", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # (name, help, description, add_arguments, run)
    commands = [
        ("demo", "train a small GPT with M learners, rackmend vs data-parallel", demo.__doc__,
         demo.add_arguments, demo.main),
        ("syncer", "run the syncer service (ZeroMQ) that learners connect to", service_cli.__doc__,
         service_cli.add_syncer_arguments, service_cli.syncer_main),
        ("keygen", "write a CurveZMQ key pair for the syncer or a learner", None,
         service_cli.add_keygen_arguments, service_cli.keygen_main),
        ("status", "live view of a running syncer: learners and rounds (--once --json: scripts)", status.__doc__,
         status.add_arguments, status.main),
        ("export", "write the global model of a syncer checkpoint as model.safetensors", export.__doc__,
         export.add_arguments, export.main),
        ("link", "emulate a WAN link: a TCP proxy with bandwidth, latency, jitter, outages", link_cli.__doc__,
         link_cli.add_arguments, link_cli.run),
        ("simulate", "simulate a run in virtual time (real cores, toy model): slow or dead racks, links",
         sim_cli.__doc__, sim_cli.add_arguments, sim_cli.main),
    ]
    for name, help_, description, add_arguments, run in commands:
        p = sub.add_parser(name, help=help_, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
