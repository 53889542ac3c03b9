"""Dry runs (`python -m jaxtrain.main --dry_run`) in the test process, keeping what they
measured and compiled; the last line's contract."""

import dataclasses
import re
from unittest import mock

from tests.helpers import CliResult, run_cli

# The last line of a dry run, which scripts read (jaxtrain/dryrun/command.py: the contract),
# matched whole.
DRY_RUN_LAST_LINE = re.compile(
    r"^dry_run: target=(?P<target>\S+) compiler=(?P<compiler>gpu|tpu|cpu) "
    r"devices=(?P<devices>\d+) params_gib=(?P<params>\S+) opt_gib=(?P<opt>\S+) "
    r"temp_gib=(?P<temp>\S+) total_gib=(?P<total>\S+) fits=(?P<fits>yes|no)$")


@dataclasses.dataclass
class DryRun:
  """What one `--dry_run` left: the CLI's exit code and report (`cli`), and the figures behind
  them: every Measurement `measure.measure` returned, and every call of `measure.compile_step`
  as ((config, devices, platform), its result: compiled step, setup, abstract state, abstract
  batch, attention note, mesh shape)."""
  cli: CliResult
  measurements: list
  compiles: list


def run_dry_run(*args, devices: int | None = None) -> DryRun:
  """Runs `python -m jaxtrain.main --dry_run ARGS` in this process (run_cli) and keeps what the
  command measured and compiled, so that one compile gives a test both the report and the
  compiled program (a deviceless GPU or TPU compile is not served by the persistent compilation
  cache: a second test of the same program compiles it again)."""
  from jaxtrain.train import measure  # pylint: disable=import-outside-toplevel
  measurements, compiles = [], []
  real_measure, real_compile_step = measure.measure, measure.compile_step

  def measure_spy(*a, **k):
    measurements.append(real_measure(*a, **k))
    return measurements[-1]

  def compile_step_spy(*a, **k):
    compiles.append((a, real_compile_step(*a, **k)))
    return compiles[-1][1]

  with mock.patch.object(measure, "measure", measure_spy), \
       mock.patch.object(measure, "compile_step", compile_step_spy):
    cli = run_cli("--dry_run", *args, devices=devices)
  return DryRun(cli, measurements, compiles)
