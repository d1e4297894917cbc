"""The package's log lines: bare for a one-process command, time, role and process id for a program of a run across
processes, `--log-level` honoured."""

from __future__ import annotations

import logging
import os
import re

import pytest

from streamrl_jax import cli, logs

LOG = logging.getLogger("streamrl_jax.pipeline.example")


def test_a_one_process_command_prints_bare_lines_and_warnings_on_stderr(capsys):
  logs.configure()
  LOG.info("held-out accuracy before RL: 0.406")
  LOG.warning("the sampler's precision is int8")
  LOG.debug("not shown at INFO")
  out = capsys.readouterr()
  assert out.out == "held-out accuracy before RL: 0.406\n"
  assert out.err == "warning: the sampler's precision is int8\n"


def test_a_role_program_starts_every_line_with_time_role_and_process(capsys):
  logs.configure("info", role="s1")
  LOG.info("registered with the trainer")
  LOG.error("the generation loop stopped")
  lines = capsys.readouterr().err.splitlines()
  stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
  assert re.fullmatch(rf"{stamp} s1\[{os.getpid()}\] INFO registered with the trainer", lines[0])
  assert re.fullmatch(rf"{stamp} s1\[{os.getpid()}\] ERROR the generation loop stopped", lines[1])


def test_the_level_hides_what_is_less_severe_and_an_unknown_level_is_refused(capsys):
  logs.configure("WARNING")
  LOG.info("hidden")
  LOG.warning("shown")
  assert capsys.readouterr() == ("", "warning: shown\n")
  logs.configure()  # configuring again replaces the last handler: one line per record
  LOG.info("once")
  assert capsys.readouterr().out == "once\n"
  with pytest.raises(ValueError, match="log level 'LOUD'"):
    logs.configure("LOUD")


@pytest.mark.parametrize("argv, role", [
    (["trainer", "--workdir", "w"], "trainer"),
    (["trainer", "--workdir", "w", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"], "trainer/1"),
    (["sampler", "--connect", "h:1", "--name", "s3"], "s3"),
    (["follower", "--connect", "h:1", "--arm", "configs/arms/rloo.gin", "--workdir", "w"], "follower rloo"),
    (["train", "--workdir", "w"], None),
])
def test_each_program_names_its_role_and_the_level_is_read_in_any_case(argv, role):
  args = cli.build_parser().parse_args(["--log-level", "debug", *argv])
  assert cli._role(args) == role and args.log_level == "DEBUG"
