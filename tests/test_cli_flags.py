"""One meaning per flag name across ``rackmend``'s sub-commands: renamed flags fail with
the new name, ``--bandwidth`` reads the same text the same way everywhere, and
``rackmend simulate``'s defaults are ``SimConfig``'s (issue 35, item 3)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re

import pytest

from rackmend import demo
from rackmend.cli import main as cli_main
from rackmend.sim import cli as sim_cli
from rackmend.sim.config import RackSpec, SimConfig

RENAMED = [
    ("demo", "--jitter", "--latency-jitter"),
    ("demo", "--kill", "--kill-learner"),
    ("demo", "--slow", "--slow-learner"),
    ("simulate", "--jitter", "--step-jitter"),
    ("link", "--jitter", "--latency-jitter"),
    ("demo", "--learners", "--racks"),  # syncer --learners is the roster of ids, not a count
    ("simulate", "--learners", "--racks"),
]


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli_main([command, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("command,old,new", RENAMED)
def test_an_old_flag_name_fails_naming_the_new_one(command: str, old: str, new: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main([command, old, "1"])
    assert info.value.code == 2
    assert f"{old} was renamed {new}" in capsys.readouterr().err
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", _help(command)))
    assert new in flags and old not in flags  # the old name is hidden from --help


def test_no_command_has_a_plain_jitter_flag() -> None:
    for command in ("demo", "simulate", "link", "syncer"):
        assert not re.search(r"(?<![\w-])--jitter\b", _help(command)), command


@pytest.mark.parametrize("command", ["demo", "simulate", "link"])
def test_bandwidth_needs_a_unit_in_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main([command, "--bandwidth", "50"])
    assert info.value.code == 2
    assert "bandwidth '50' has no unit" in capsys.readouterr().err


def test_bandwidth_means_the_same_rate_in_demo_and_simulate() -> None:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert demo.settings_from_args(p.parse_args(["--bandwidth", "20Mbit"])).link.bandwidth_mbit == pytest.approx(20)
    assert demo.settings_from_args(p.parse_args(["--bandwidth", "1MB/s"])).link.bandwidth_mbit == pytest.approx(8)
    assert demo.settings_from_args(p.parse_args(["--bandwidth", "none"])).link.bandwidth_mbit is None
    assert demo.settings_from_args(p.parse_args([])).link.bandwidth_mbit == pytest.approx(50)
    s = argparse.ArgumentParser()
    sim_cli.add_arguments(s)
    racks = sim_cli.config_from_args(s.parse_args(["--bandwidth", "20Mbit", "--racks", "2"])).racks
    assert [r.uplink_bandwidth for r in racks] == [pytest.approx(2.5e6)] * 2  # bytes/s
    assert sim_cli.config_from_args(s.parse_args([])).racks[0].uplink_bandwidth is None


def test_simulate_defaults_are_simconfigs() -> None:
    s = argparse.ArgumentParser()
    sim_cli.add_arguments(s)
    cfg = sim_cli.config_from_args(s.parse_args([]))
    assert len(cfg.racks) == len(SimConfig().racks)
    assert cfg.racks[0].jitter == RackSpec().jitter
    cfg = sim_cli.config_from_args(s.parse_args(["--step-jitter", "0.25"]))
    assert {r.jitter for r in cfg.racks} == {0.25}
