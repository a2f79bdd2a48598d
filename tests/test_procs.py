"""The tests' own process launcher (``procs.Procs.start``, ``_zygote.py``): a process it
forks must behave as the same command started as a fresh ``python``, or every test of
processes would be testing something else."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from procs import Forked, Procs, wait_for

SCRIPT = """
import json, os, sys, time
import rackmend
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
                  "main": __name__, "path0": sys.path[0], "stdin": sys.stdin.read()}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


def _report(procs: Procs, name: str) -> dict:
    return json.loads(procs.output(name).splitlines()[0])


def test_a_forked_process_runs_its_command_as_a_fresh_python_would(tmp_path: Path, procs: Procs) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    forked = procs.start([sys.executable, str(script), "exit", "3"], "forked", {"PROBE": "one"})
    fresh = procs.start([sys.executable, str(script), "exit", "3"], "fresh", {"PROBE": "one", "PYTHONHASHSEED": "7"})
    assert isinstance(forked, Forked), "a plain `python script` is forked from the launcher"
    assert isinstance(fresh, subprocess.Popen), "start-up environment (PYTHON*) needs a fresh interpreter"
    assert forked.wait(60) == 3 and fresh.wait(60) == 3
    a, b = _report(procs, "forked"), _report(procs, "fresh")
    assert a == b
    assert a["argv"] == [str(script), "exit", "3"] and a["env"] == "one" and a["main"] == "__main__"
    assert a["path0"] == str(tmp_path) and a["stdin"] == ""


def test_a_forked_module_gets_its_argv_and_dies_of_its_signal(tmp_path: Path, procs: Procs,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "probemod.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)  # `python -m` finds the module in the working directory
    proc = procs.start([sys.executable, "-m", "probemod", "sleep", "0"], "mod")
    assert isinstance(proc, Forked)
    wait_for(lambda: procs.output("mod").strip() != "", 60, "the module to start", alive=(proc,))
    report = _report(procs, "mod")
    assert report["argv"][1:] == ["sleep", "0"] and report["cwd"] == str(tmp_path) and report["main"] == "__main__"
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    proc.kill()  # reaped: a signal now reaches nobody
