"""The ``rackmend`` command line: one sub-command per job.

Each sub-command's module owns its flags (``add_arguments``) and its work
(``main``); this file only dispatches.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from rackmend import demo

    parser = argparse.ArgumentParser(prog="rackmend", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("demo", help="train a small GPT with M learners, rackmend vs data-parallel",
                       description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p.set_defaults(run=demo.main)

    from rackmend.service import cli as service_cli

    p = sub.add_parser("syncer", help="run the syncer service (ZeroMQ) that learners connect to",
                       description=service_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    service_cli.add_syncer_arguments(p)
    p.set_defaults(run=service_cli.syncer_main)
    p = sub.add_parser("keygen", help="write a CurveZMQ key pair for the syncer or a learner")
    service_cli.add_keygen_arguments(p)
    p.set_defaults(run=service_cli.keygen_main)
    from rackmend.service import status

    p = sub.add_parser("status", help="live view of a running syncer: learners and rounds (--once --json: scripts)",
                       description=status.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    status.add_arguments(p)
    p.set_defaults(run=status.main)
    from rackmend.service import export

    p = sub.add_parser("export", help="write the global model of a syncer checkpoint as model.safetensors",
                       description=export.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_arguments(p)
    p.set_defaults(run=export.main)
    from rackmend.netem import cli as link_cli

    p = sub.add_parser("link", help="emulate a WAN link: a TCP proxy with bandwidth, latency, jitter, outages",
                       description=link_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    link_cli.add_arguments(p)
    p.set_defaults(run=link_cli.run)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
