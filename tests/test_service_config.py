"""Syncer options: flag > environment > TOML file > default, the safety checks, and that
every option is a config dataclass field (name, default, docstring, allowed values)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rackmend.cli import main as cli_main
from rackmend.config import (
    CompressionConfig,
    ConfigError,
    LearnerConfig,
    RunConfig,
    SyncerConfig,
    field_docs,
    literal_choices,
)
from rackmend.service import ServiceConfig
from rackmend.service.cli import OPTIONS, add_syncer_arguments, build, config_flags, options_markdown, resolve


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


def _printed(*argv: str) -> str:
    """What ``rackmend ARGV`` prints, run in this process (a Python start-up per call
    cost seconds); it must succeed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = cli_main(list(argv))
        except SystemExit as exc:  # --help ends with exit 0
            rc = exc.code
    assert rc in (0, None), (argv, rc)
    return out.getvalue()


def test_help_documents_every_option() -> None:
    out = _printed("syncer", "--help")
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


def test_cgad_options_reach_the_config(tmp_path: Path) -> None:
    default = build(resolve(parse(), {}))[0].syncer
    assert (default.staleness_decay, default.staleness_cutoff) == (0.0, None)
    config, _ = build(resolve(parse("--staleness-decay", "0.25", "--staleness-cutoff", "3"), {}))
    assert (config.syncer.staleness_decay, config.syncer.staleness_cutoff) == (0.25, 3)
    assert build(resolve(parse(*config_flags(config)), {}))[0] == config  # and back to flags
    f = tmp_path / "syncer.toml"
    f.write_text("staleness_decay = 0.5\nstaleness_cutoff = 2\n")
    syncer = build(resolve(parse("--config", str(f)), {"RACKMEND_STALENESS_CUTOFF": "4"}))[0].syncer
    assert (syncer.staleness_decay, syncer.staleness_cutoff) == (0.5, 4)  # environment over file
    with pytest.raises(ConfigError, match="staleness_cutoff"):
        build(resolve(parse("--staleness-cutoff", "0"), {}))
    with pytest.raises(ConfigError, match="staleness_decay"):
        build(resolve(parse("--staleness-decay", "-1"), {}))
    with pytest.raises(ConfigError, match="--staleness-cutoff"):  # a whole number of versions
        resolve(parse("--staleness-cutoff", "2.5"), {})


def test_count_absent_is_on_by_default_and_can_be_turned_off() -> None:
    assert build(resolve(parse(), {}))[0].syncer.count_absent is True
    assert build(resolve(parse("--count-absent", "false"), {}))[0].syncer.count_absent is False
    assert build(resolve(parse(), {"RACKMEND_COUNT_ABSENT": "off"}))[0].syncer.count_absent is False
    with pytest.raises(ConfigError, match="--count-absent"):
        resolve(parse("--count-absent", "maybe"), {})


# ---------------------------------------------------------------- one source: the dataclasses

SYNCER_PARTS = {ServiceConfig: None, SyncerConfig: None, CompressionConfig: None, RunConfig: ("deterministic",)}
"""Which fields of which dataclass the syncer takes (None: all): the learners set H, P,
tau, packing, sync_buffers and the apply rule and report them at hello (``--overlap``,
``SyncerConfig.overlap``, may pin tau)."""


def test_every_config_field_is_an_option_with_its_docstring_as_help() -> None:
    by_field = {(o.owner, o.field): o for o in OPTIONS}
    expected = [(owner, f.name) for owner, only in SYNCER_PARTS.items() for f in dataclasses.fields(owner)
                if only is None or f.name in only]
    assert sorted(by_field, key=str) == sorted(expected, key=str)
    out = _printed("syncer", "--help")
    squashed = "".join(out.split()).replace("``", "`")  # argparse re-wraps the text
    for (owner, name), o in by_field.items():
        doc = field_docs(owner)[name]
        assert doc and o.help == " ".join(doc.split()), (owner, name)
        assert "".join(doc.split()).replace("``", "`") in squashed, f"{o.flag}: help is not the docstring"
        default = next(f for f in dataclasses.fields(owner) if f.name == name)
        value = default.default_factory() if default.default is dataclasses.MISSING else default.default
        assert o.to_field(o.default) == value, o.name


def test_learner_only_settings_are_not_syncer_options(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    learner_fields = [f.name for f in dataclasses.fields(LearnerConfig)]
    assert {"apply", "mix_alpha", "tokens_per_step", "wait_timeout", "join_timeout"} <= set(learner_fields)
    names = {o.name for o in OPTIONS}
    for name in learner_fields + ["sync_every", "num_fragments", "packing", "sync_buffers"]:
        assert name not in names
        with pytest.raises(SystemExit):
            parse("--" + name.replace("_", "-"), "1")
    f = tmp_path / "syncer.toml"
    f.write_text('apply = "mix"\n')
    with pytest.raises(ConfigError, match="unknown options apply"):
        resolve(parse("--config", str(f)), {})
    with caplog.at_level(logging.WARNING, logger="rackmend.syncer"):
        resolve(parse(), {"RACKMEND_WAIT_TIMEOUT": "5"})
    assert "ignoring environment variable RACKMEND_WAIT_TIMEOUT" in caplog.text
    config, _ = build(resolve(parse(), {}))
    assert type(config) is RunConfig and not hasattr(config, "learner")


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.choices], ids=lambda o: o.name)
def test_a_choice_option_refuses_other_values_naming_them(option, tmp_path: Path) -> None:
    allowed = literal_choices(option.owner)[option.field]
    assert option.choices == allowed
    typo = allowed[-1][:-1]  # one letter short: close enough for a suggestion
    with pytest.raises(ConfigError) as err:
        resolve(parse(), {option.env: typo})
    text = str(err.value)
    assert text.startswith(option.env) and all(a in text for a in allowed), text
    assert f"did you mean {allowed[-1]!r}" in text, text
    f = tmp_path / "syncer.toml"
    f.write_text(f'{option.name} = "zzz"\n')
    with pytest.raises(ConfigError, match=f"{f}:{option.name}: .*{'.*'.join(allowed)}"):
        resolve(parse("--config", str(f)), {})
    for value in allowed:  # and every allowed value goes through to the config
        config, _ = build(resolve(parse(option.flag, value), {}))
        assert getattr(config.syncer if option.owner is SyncerConfig else config, option.field) == value


def test_a_bad_choice_fails_at_start_with_the_allowed_values() -> None:
    cmd = [sys.executable, "-m", "rackmend.cli", "syncer", "--bind", "tcp://127.0.0.1:0"]
    flag = subprocess.run([*cmd, "--merge", "median"], capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and "--merge" in flag.stderr and "mean" in flag.stderr and "rda" in flag.stderr
    typo = subprocess.run([*cmd, "--weighting", "token"], capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "did you mean 'tokens'" in typo.stderr, typo.stderr
    env = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RACKMEND_WEIGHTING": "token"})
    assert env.returncode == 2, env.stdout
    assert "RACKMEND_WEIGHTING" in env.stderr and "tokens_sq_per_step, tokens, uniform" in env.stderr
    assert "did you mean 'tokens'" in env.stderr and "listening" not in env.stdout


def test_switches_on_by_default_turn_off_at_every_level(tmp_path: Path) -> None:
    f = tmp_path / "syncer.toml"
    f.write_text("no_failslow = true\ncount_absent = false\n")
    failslow = lambda *argv, env={}: build(resolve(parse("--config", str(f), *argv), env))[0].syncer.failslow
    assert failslow() is False                                          # file (old key)
    assert failslow(env={"RACKMEND_FAILSLOW": "yes"}) is True           # environment over file
    assert failslow("--no-failslow", env={"RACKMEND_FAILSLOW": "yes"}) is False  # flag over environment
    assert failslow("--failslow", env={"RACKMEND_NO_FAILSLOW": "1"}) is True
    assert failslow("--failslow", "false") is False
    assert build(resolve(parse("--config", str(f)), {}))[0].syncer.count_absent is False
    assert build(resolve(parse("--config", str(f), "--count-absent"), {}))[0].syncer.count_absent is True
    with pytest.raises(ConfigError, match="RACKMEND_FAILSLOW and RACKMEND_NO_FAILSLOW"):
        resolve(parse(), {"RACKMEND_FAILSLOW": "1", "RACKMEND_NO_FAILSLOW": "1"})
    assert build(resolve(parse(), {}))[0].syncer.failslow is True
    _, service = build(resolve(parse("--resume", "--checkpoint-dir", str(tmp_path)), {}))
    assert service.resume is True


def test_numbers_are_not_truncated_and_units_convert(tmp_path: Path) -> None:
    f = tmp_path / "syncer.toml"
    f.write_text("min_quorum = 2.5\n")
    with pytest.raises(ConfigError, match="min_quorum.*whole number"):
        resolve(parse("--config", str(f)), {})
    f.write_text("min_quorum = 2.0\nmax_message_mb = 1.5\n")
    config, service = build(resolve(parse("--config", str(f)), {}))
    assert config.syncer.min_quorum == 2 and service.max_message_bytes == 3 * 2**19
    assert build(resolve(parse(), {}))[1].max_message_bytes is None


def test_every_earlier_flag_still_parses(tmp_path: Path) -> None:
    """The names docs, scripts and tests have used since the first release."""
    key = tmp_path / "syncer.key_secret"
    argv = ["--bind", "tcp://127.0.0.1:0", "--insecure", "--secret-key", str(key), "--allowed-keys", str(tmp_path),
            "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "3", "--resume", "--heartbeat-timeout", "4",
            "--max-message-mb", "2", "--takeover-after", "6", "--log", str(tmp_path / "e.jsonl"), "--log-burst", "7",
            "--init-timeout", "8", "--ready-file", str(tmp_path / "r"), "--overlap", "1", "--min-quorum", "2",
            "--learners", "a,b", "--grace-max", "1.5", "--grace-gamma", "0.5", "--weighting", "uniform",
            "--merge", "rda", "--outer-optimizer", "Adam", "--outer-lr", "0.5", "--outer-kwargs", '{"eps": 1e-6}',
            "--anchoring", "learner_base", "--max-staleness", "9", "--count-absent", "false", "--norm-guard", "0",
            "--no-failslow", "--failslow-min-slowdown", "0.2", "--failslow-min-steps", "11",
            "--failslow-false-alarm-steps", "1e6", "--failslow-baseline-steps", "64", "--failslow-advise-after", "5",
            "--failslow-evict-cost", "60", "--uplink-codec", "int8", "--downlink-codec", "int4", "--deterministic"]
    values = resolve(parse(*argv), {})
    assert values["failslow"] is False and values["deterministic"] is True
    run = RunConfig(
        syncer=SyncerConfig(overlap=1, min_quorum=2, learners=("a", "b"), grace_max=1.5, grace_gamma=0.5,
                            weighting="uniform",
                            merge="rda", outer_optimizer="Adam", outer_lr=0.5, outer_kwargs={"eps": 1e-6},
                            anchoring="learner_base", max_staleness=9, count_absent=False, norm_guard=0,
                            failslow=False, failslow_min_slowdown=0.2, failslow_min_steps=11,
                            failslow_false_alarm_steps=1e6, failslow_baseline_steps=64, failslow_advise_after=5,
                            failslow_evict_cost=60),
        compression=CompressionConfig(uplink="int8", downlink="int4"), deterministic=True)
    config, service = build(values)
    assert config == run
    assert (service.bind, service.insecure, service.secret_key_file, service.allowed_keys_dir, service.checkpoint_dir,
            service.log_path) == ("tcp://127.0.0.1:0", True, str(key), str(tmp_path), str(tmp_path),
                                  str(tmp_path / "e.jsonl"))
    assert (service.checkpoint_every, service.resume, service.heartbeat_timeout, service.max_message_bytes,
            service.takeover_after, service.log_burst, service.init_timeout, service.ready_file) == (
        3, True, 4.0, 2 * 2**20, 6.0, 7, 8.0, str(tmp_path / "r"))
    assert build(resolve(parse(*config_flags(run)), {}))[0] == run  # and back to flags


def test_the_docs_table_is_the_generated_one() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "multinode.md").read_text(encoding="utf-8")
    marker = "<!-- generated by `rackmend syncer --help-markdown`"
    assert marker in text
    after = text.split(marker, 1)[1].split("\n", 1)[1].lstrip("\n")
    table = after[:after.index("\n\n") + 1] if "\n\n" in after else after
    printed = _printed("syncer", "--help-markdown")
    assert printed == options_markdown()
    assert table == printed, "docs/multinode.md: paste the output of `rackmend syncer --help-markdown`"
    rows = table.splitlines()[2:]
    assert len(rows) == len(OPTIONS) and all(line.count(" | ") == 4 for line in rows)  # no cell split by a '|'
