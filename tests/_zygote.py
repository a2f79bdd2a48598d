"""The tests' process launcher: a Python that has imported torch, ZeroMQ and rackmend
once, and forks a child for each process a test starts (``procs.Procs.start``).

A test process started by ``python -m rackmend.cli syncer ...`` spends seconds of a
core importing torch before it does anything; a syncer and three learners do it four
times, and the serial tests start some two hundred. A child forked from here starts
with those imports done and then runs its command exactly as ``python`` would: the
module or script as ``__main__``, its own argv, environment, working directory, output
file and signal handlers, its exit status as ``python``'s. Nothing here has run any
torch operation, created a ZeroMQ context or started a thread of its own, so a fork
copies no thread pool or socket.

Requests come one JSON line at a time on stdin; each answer is one JSON line on stdout:
``{"op": "start", "argv": [...], "env": {...}, "cwd": ..., "out": path}`` -> ``{"pid": N}``;
``{"op": "poll", "pid": N}`` -> ``{"rc": code or null}`` (the child is reaped here, on
request only, so its pid is not reused while the test may still signal it). End of
stdin ends the launcher; children it started run on.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

import msgpack  # noqa: F401  - imported to be inherited, like the rest
import numpy  # noqa: F401
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import zmq  # noqa: F401

import rackmend.learner  # noqa: F401
import rackmend.service.syncer  # noqa: F401
import rackmend.transport.zmq_link  # noqa: F401


def serve() -> dict[str, Any] | None:
    """Answer requests until stdin ends (None), or, in a child just forked, its request."""
    reply = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "start":
            pid = os.fork()
            if pid == 0:
                return req
            answer: dict[str, Any] = {"pid": pid}
        else:
            try:
                done, status = os.waitpid(req["pid"], os.WNOHANG)
                answer = {"rc": os.waitstatus_to_exitcode(status) if done else None}
            except ChildProcessError:  # not a child, or reaped already: its status is not known here
                answer = {"error": f"pid {req['pid']} is not a child of the launcher waiting to be reaped"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return None


def become(req: dict[str, Any]) -> None:
    """In the child: run the request's command as ``python`` would run it."""
    out = os.open(req["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the launcher's request pipe is not the child's to read
    os.dup2(out, 1)  # nor is its answer pipe the child's to write
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    sys.stdin = open(os.devnull)  # the launcher's reader may hold buffered request bytes
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = req["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    request = serve()
    if request is not None:
        # Outside serve(): the command's SystemExit or exception ends this child the way
        # it ends `python`, with its exit status, atexit handlers and thread joins.
        become(request)
