"""Newcomer mistakes on the command line (a mistyped --config key, a missing or broken config
file, an unknown flag) end in one line on stderr and exit code 2, never a traceback.

The command lines run in this process (run_cli: the same flag parsing and exit codes); one runs
`python -m jaxtrain.main` for real, so that the exit path of the process stays tested."""

import pytest

from tests.helpers import run_cli, run_main


def _cli(*args):
  return run_cli(*args)


def _one_line_error(proc) -> str:
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("error: "), lines[0]
  return lines[0]


@pytest.mark.parametrize("override,words", [
    ("--config.train.stepz=10", ["--config.train.stepz=10", "'stepz'", "config.train",
                                 "Did you mean", "steps"]),
    ("--config.trian.steps=10", ["--config.trian.steps=10", "'trian'", "Did you mean", "train"]),
    ("--config.model.num_layer=2", ["'num_layer'", "config.model", "Did you mean",
                                    "num_layers"]),
    # No close key: the group's keys are listed instead.
    ("--config.train.zzzzz=1", ["'zzzzz'", "config.train", "global_batch_size", "steps"]),
])
def test_mistyped_config_key_is_one_line_with_a_suggestion(override, words):
  line = _one_line_error(_cli("--config=configs/tiny.py", override))
  for word in words:
    assert word in line, f"{word!r} not in {line!r}"


def test_a_flag_error_in_a_real_process_is_one_line_exit_2():
  """The one command-line mistake run as `python -m jaxtrain.main` (app.run, exit code of the
  process); these errors arise while flags parse, before JAX is imported: seconds."""
  line = _one_line_error(run_main("--config=configs/tiny.py", "--config.train.stepz=10",
                                  timeout=60))
  for word in ["--config.train.stepz=10", "'stepz'", "config.train", "Did you mean", "steps"]:
    assert word in line, f"{word!r} not in {line!r}"


@pytest.mark.parametrize("extra", [[], ["--config.train.steps=10"]])
def test_missing_config_file_points_at_the_shipped_ones(extra):
  # With an override ml_collections fails while parsing; without one, on first use.
  line = _one_line_error(_cli("--config=configs/nope.py", *extra))
  assert "--config=configs/nope.py" in line and "no such config file" in line, line
  assert "configs/tiny.py" in line, line


def test_misspelled_config_file_name_gets_a_suggestion():
  line = _one_line_error(_cli("--config=configs/tinyy.py"))
  assert "no such config file" in line and "Did you mean configs/tiny.py" in line, line


@pytest.mark.parametrize("source,words", [
    ("def get_config(:\n  return None\n", ["line 1", "SyntaxError"]),
    ("x = 1\n", ["no get_config()"]),
    ("def get_config():\n  return undefined_name\n", ["line 2", "NameError", "undefined_name"]),
    ("def get_config():\n  raise ValueError('bad value')\n", ["line 2", "ValueError",
                                                               "bad value"]),
])
def test_broken_config_file_names_the_file_and_the_problem(tmp_path, source, words):
  path = tmp_path / "broken.py"
  path.write_text(source)
  for extra in ([], ["--config.train.steps=10"]):
    line = _one_line_error(_cli(f"--config={path}", *extra))
    for word in [f"--config={path}", *words]:
      assert word in line, f"{word!r} not in {line!r}"


@pytest.mark.parametrize("args,words", [
    (["--nope"], ["Unknown command line flag 'nope'", "--helpfull"]),
    (["--dry_runn"], ["'dry_runn'", "dry_run"]),
    (["--config.train.steps=abc"], ["--config.train.steps=abc", "'abc'"]),
    (["stray"], ["unexpected arguments: stray"]),
])
def test_other_flag_errors_stay_one_line(args, words):
  line = _one_line_error(_cli("--config=configs/tiny.py", *args))
  for word in words:
    assert word in line, f"{word!r} not in {line!r}"


def test_help_still_prints_the_usage():
  # A real process: --help is absl's app.run flag (defined once per process, before parsing).
  proc = run_main("--help", timeout=60)
  assert "--config" in proc.stdout and "--workdir" in proc.stdout, proc.stdout
  assert "error:" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
