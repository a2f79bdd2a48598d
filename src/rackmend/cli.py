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
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
