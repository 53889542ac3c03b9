"""Command-line flag parsing for the CLIs, with every mistake reported as one line and exit 2.

absl prints a banner for a bad flag and ml_collections a traceback for a mistyped `--config.KEY`
or a config file that is missing or fails; `parse_flags` (the `flags_parser` of `app.run`) turns
each into one line naming the flag, the file or the key, with ml_collections' "Did you mean".
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback

import ml_collections
from absl import flags
from ml_collections import config_flags


def _exit_usage(message: str):
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for `app.run`, with every command-line mistake (a mistyped
  --config.KEY, a config file that is missing or fails, an unknown flag) reported as one line
  and exit code 2, where absl prints a banner and ml_collections a traceback."""
  try:
    args = flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except  # --help's SystemExit passes through
    _exit_usage(_describe_flags_error(e, argv))
  flag = flags.FLAGS["config"]
  if flag.present:
    try:
      # ml_collections keeps a file it could not open (missing, a directory) as a config that
      # raises OSError on first use; overrides would have raised already, so touch it here.
      getattr(flag.value, "lock", None)
      failed = flag.value is None  # get_config() returned None
    except OSError:
      failed = True
    if failed:
      value = config_flags.get_config_filename(flag)
      problem = ("get_config() returned None" if flag.value is None
                 else _config_file_problem(value) or "failed to load")
      _exit_usage(f"--config={value}: {problem}")
  if len(args) > 1:
    _exit_usage(f"unexpected arguments: {' '.join(args[1:])} (flags take the form --name=value)")
  return args


def _describe_flags_error(e: Exception, argv: list[str]) -> str:
  """One line for an error from parsing the flags: absl's own message when it is one line;
  otherwise the config file or --config override at fault, found by loading the file again."""
  if isinstance(e, flags.Error) and "\n" not in str(e).strip():
    return f"{str(e).strip()} (--helpfull lists the flags)"
  try:
    argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)  # as ml_collections does
  except flags.Error:
    pass
  value = _config_arg(argv)
  if value is not None:
    problem = _config_file_problem(value)
    if problem:
      return f"--config={value}: {problem}"
    problem = _override_problem(flags.FLAGS["config"].parser.parse(value), argv)
    if problem:
      return problem
  return f"{type(e).__name__}: {first_line(e)}"


def _config_arg(argv: list[str]) -> str | None:
  """The value of the first --config in argv (the one ml_collections loads), or None."""
  for i, arg in enumerate(argv[1:], 1):
    match = re.match(r"^--?config(=|$)", arg)
    if match:
      if match.group(1):
        return arg.split("=", 1)[1]
      return argv[i + 1] if i + 1 < len(argv) else None
  return None


def _config_file_problem(value: str) -> str | None:
  """What is wrong with config file `value` (PATH or PATH:ARGS), or None if it loads."""
  path = value.split(":", 1)[0]
  if not os.path.exists(path):
    return _no_such_config_file(path)
  try:
    config = flags.FLAGS["config"].parser.parse(value)
    getattr(config, "lock", None)  # raises an open failure ml_collections deferred
  except OSError as e:
    cause = e.__cause__ or e
    return cause.strerror if isinstance(cause, OSError) and cause.strerror else first_line(cause)
  except Exception as e:  # pylint: disable=broad-except  # the file's own code failed
    if isinstance(e, (TypeError, ValueError)) and e.__context__ is not None:
      e = e.__context__  # ml_collections re-raises these with its traceback as the message
    if isinstance(e, AttributeError) and e.name == "get_config":
      return "defines no get_config()"
    if isinstance(e, SyntaxError):
      return f"line {e.lineno}: {type(e).__name__}: {e.msg}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if os.path.exists(f.filename) and os.path.samefile(f.filename, path)]
    where = f"line {lines[-1]}: " if lines else ""
    while e.args and isinstance(e.args[0], KeyError):
      e = e.args[0]  # ConfigDict's attribute access raises AttributeError(KeyError(...))
    if isinstance(e, KeyError) and e.args:
      return f"{where}KeyError: " + ". ".join(str(e.args[0]).splitlines())
    return f"{where}{type(e).__name__}: {first_line(e)}"
  if config is None:
    return "get_config() returned None"
  return None


def _no_such_config_file(path: str) -> str:
  shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
  if not os.path.isdir(shipped):  # an installed package ships no configs/
    return "no such config file"
  where = os.path.relpath(shipped)
  if where.startswith(os.pardir):
    where = shipped
  names = sorted(n[:-3] for n in os.listdir(shipped) if n.endswith(".py"))
  close = difflib.get_close_matches(os.path.splitext(os.path.basename(path))[0], names, n=1)
  if close:
    return f"no such config file. Did you mean {os.path.join(where, close[0])}.py?"
  return (f"no such config file; the shipped ones are in {where}/ "
          f"(e.g. {os.path.join(where, 'tiny.py')})")


def _override_problem(config, argv: list[str]) -> str | None:
  """The first --config.KEY=VALUE in argv whose KEY is not in `config`, described with
  ml_collections' "Did you mean" suggestion; None if every key exists."""
  for arg in argv[1:]:
    if not re.match(r"^--?(no)?config\.", arg):
      continue
    node, where = config, "config"
    for key in arg.split("=", 1)[0].split(".")[1:]:
      if not isinstance(node, ml_collections.ConfigDict):
        return f"{arg}: {where} is {node!r:.60}, not a group of keys"
      try:
        child = node[key]
      except KeyError as e:
        # ConfigDict's KeyError reads "'KEY'\nDid you mean ...?" when a key is close.
        hints = [l for l in str(e.args[0]).splitlines() if l.startswith("Did you mean")]
        if hints:
          return f"{arg}: no key {key!r} in {where}. {hints[0]}"
        return f"{arg}: no key {key!r} in {where}; it has {', '.join(sorted(node.keys()))}"
      node = child
      where += f".{key}"
  return None


def first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:500] if text else ""


