"""Syncer options: flag > environment > TOML file > default, and the safety checks."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rackmend.config import ConfigError
from rackmend.service import ServiceConfig
from rackmend.service.cli import OPTIONS, add_syncer_arguments, build, resolve


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_syncer_arguments(p)
    return p.parse_args(list(argv))


def test_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    f = tmp_path / "syncer.toml"
    f.write_text('min_quorum = 2\nlearners = ["a", "b", "c"]\nouter_lr = 0.5\ngrace_max = 3.0\n')
    env = {"RACKMEND_OUTER_LR": "0.25", "RACKMEND_GRACE_MAX": "1.5"}
    values = resolve(parse("--config", str(f), "--grace-max", "0.75"), env)
    assert values["grace_max"] == 0.75          # flag
    assert values["outer_lr"] == 0.25           # environment over file
    assert values["min_quorum"] == 2 and values["learners"] == ("a", "b", "c")  # file
    assert values["merge"] == "mean"            # default
    config, service = build(values)
    assert config.syncer.min_quorum == 2 and service.bind == "tcp://127.0.0.1:5555"


def test_bad_values_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="RACKMEND_MIN_QUORUM"):
        resolve(parse(), {"RACKMEND_MIN_QUORUM": "three"})
    f = tmp_path / "s.toml"
    f.write_text("min_qorum = 2\n")
    with pytest.raises(ConfigError, match="unknown options"):
        resolve(parse("--config", str(f)), {})
    with pytest.raises(ConfigError, match="min_quorum"):
        build(resolve(parse("--min-quorum", "3", "--learners", "a,b"), {}))


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555"])
def test_non_loopback_bind_needs_keys_or_insecure(bind: str) -> None:
    with pytest.raises(ConfigError, match="--insecure"):
        ServiceConfig(bind=bind)
    assert ServiceConfig(bind=bind, insecure=True).insecure
    ServiceConfig(bind="tcp://127.0.0.1:0")
    ServiceConfig(bind="tcp://[::1]:5555")


def test_help_documents_every_option() -> None:
    out = subprocess.run([sys.executable, "-m", "rackmend.cli", "syncer", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for o in OPTIONS:
        assert "--" + o.name.replace("_", "-") in out and "RACKMEND_" + o.name.upper() in out


def test_codec_options_reach_the_config(tmp_path: Path) -> None:
    f = tmp_path / "syncer.toml"
    f.write_text('uplink_codec = "powersgd:rank=4"\ndownlink_codec = "int8"\n')
    config, _ = build(resolve(parse("--config", str(f)), {"RACKMEND_DOWNLINK_CODEC": "int4:block_size=32"}))
    assert config.compression.uplink == "powersgd:rank=4"
    assert config.compression.build_downlink().block_size == 32  # environment over file
    assert build(resolve(parse(), {}))[0].compression.build_downlink().lossless  # default: none
    with pytest.raises(ConfigError, match="compression.downlink.*int9"):
        build(resolve(parse("--downlink-codec", "int9"), {}))


def test_unknown_environment_names_are_warned_with_the_closest(caplog: pytest.LogCaptureFixture) -> None:
    env = {"RACKMEND_MIN_QUORM": "2", "RACKMEND_LEARNER_ID": "l0", "RACKMEND_CONNECT": "tcp://x:1",
           "RACKMEND_OVERLAP": "1", "RACKMEND_ZZZZZZZZ": "1", "OTHER_MIN_QUORM": "2"}
    with caplog.at_level(logging.WARNING, logger="rackmend.syncer"):
        values = resolve(parse(), env)
    assert values["min_quorum"] == 1 and values["overlap"] == 1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "RACKMEND_MIN_QUORM" in text and "did you mean RACKMEND_MIN_QUORUM" in text, text
    assert "RACKMEND_ZZZZZZZZ" in text
    assert "RACKMEND_LEARNER_ID" not in text and "RACKMEND_CONNECT" not in text and "OTHER_" not in text
    assert "RACKMEND_OVERLAP" not in text


def test_syncer_start_warns_about_a_misspelt_environment_name(tmp_path: Path) -> None:
    ready = tmp_path / "endpoint"
    env = {**os.environ, "RACKMEND_OVERLAPP": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rackmend.cli", "syncer", "--bind", "tcp://127.0.0.1:0",
                             "--ready-file", str(ready)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert ready.exists(), "the syncer did not start"
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=10)
    assert "RACKMEND_OVERLAPP" in out and "RACKMEND_OVERLAP" in out.replace("RACKMEND_OVERLAPP", ""), out


def test_init_timeout_option_reaches_the_service() -> None:
    _, service = build(resolve(parse("--init-timeout", "7.5"), {}))
    assert service.init_timeout == 7.5
    with pytest.raises(ConfigError, match="init_timeout"):
        ServiceConfig(init_timeout=0)


def test_count_absent_is_on_by_default_and_can_be_turned_off() -> None:
    assert build(resolve(parse(), {}))[0].syncer.count_absent is True
    assert build(resolve(parse("--count-absent", "false"), {}))[0].syncer.count_absent is False
    assert build(resolve(parse(), {"RACKMEND_COUNT_ABSENT": "off"}))[0].syncer.count_absent is False
    with pytest.raises(ConfigError, match="--count-absent"):
        resolve(parse("--count-absent", "maybe"), {})
