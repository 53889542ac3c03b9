"""Does every shipped config fit its target? `python -m jaxtrain.dryrun.check_configs [NAME...]`.

Compiles the train step of each config in configs/ whose `target` is an accelerator (all of them
by default, or the NAMEs given: `llama8b` or `configs/llama8b.py`) for that target, with the
target's own compiler and no device (the dry run's measurement, jaxtrain/train/measure.py), and
prints one row per config: name, target, compiler, total GiB per device, headroom (the GiB left
below targets.USABLE_FRACTION of the device's memory; negative when it does not fit) and fits.
The last line is for scripts:

  check_configs: configs=N fit=N

Exit code 1 when any config does not fit, fails to compile, or would be compiled by XLA:CPU
because its target's compiler is not installed (an estimate is no proof); 2 for a name that is
not a shipped config. CI runs it after the test suite (.ci/run); the suite itself compiles one
config per architecture (tests/test_shipped_configs.py).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time

import jax  # starts no backend: main() below, or the caller, chooses the platforms first

from jaxtrain import hardware as targets
from jaxtrain import platforms
from jaxtrain.config import load_config_file
from jaxtrain.train import measure

REPO_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")


@dataclasses.dataclass
class Row:
  name: str
  target: str
  compiler: str
  total_gib: float | None
  headroom_gib: float | None
  fits: str  # "yes", "no", or why it could not be checked

  def line(self) -> str:
    total = "-" if self.total_gib is None else f"{self.total_gib:.2f}"
    headroom = "-" if self.headroom_gib is None else f"{self.headroom_gib:+.2f}"
    return (f"{self.name:24s} {self.target:12s} {self.compiler:8s} {total:>9s} "
            f"{headroom:>9s}  {self.fits}")


HEADER = (f"{'config':24s} {'target':12s} {'compiler':8s} {'total_gib':>9s} "
          f"{'headroom':>9s}  fits")


def shipped_configs(directory: str = REPO_CONFIGS) -> list[str]:
  """Names of the configs in `directory` whose target is an accelerator (not this host's CPU)."""
  names = []
  for file in sorted(os.listdir(directory)):
    if file.endswith(".py") and not file.startswith("_"):
      config = load_config_file(os.path.join(directory, file))
      if targets.parse(config.target).chip is not None:
        names.append(file[:-3])
  return names


def check(name: str, directory: str = REPO_CONFIGS):
  """(Row, the Measurement or None) of one shipped config, compiled for its target."""
  config = load_config_file(os.path.join(directory, f"{name}.py"))
  target = targets.parse(config.target)
  missing = targets.compiler_missing(target)
  if missing:
    return Row(name, target.name, "cpu", None, None, f"no: {missing}"), None
  try:
    m = measure.measure(config, targets.devices(target))
  except Exception as e:  # pylint: disable=broad-except  # one config's failure is its row
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return Row(name, target.name, target.compiler, None, None,
               f"no: {type(e).__name__}: {first}"), None
  if m.backend != target.compiler:
    return Row(name, target.name, m.backend, m.total / 2**30, None,
               f"no: compiled by {m.backend}, not the target's {target.compiler} compiler"), m
  verdict = targets.verdict(target.memory_bytes, m.total)
  return Row(name, target.name, m.backend, m.total / 2**30, verdict.headroom_bytes / 2**30,
             "yes" if verdict.fits else "no"), m


def _names(args: list[str], directory: str) -> list[str]:
  shipped = shipped_configs(directory)
  if not args:
    return shipped
  names = [os.path.basename(a)[:-3] if a.endswith(".py") else a for a in args]
  unknown = [n for n in names if n not in shipped]
  if unknown:
    print(f"check_configs: {', '.join(unknown)}: not a shipped config with an accelerator "
          f"target in {directory}; shipped: {', '.join(shipped)}", file=sys.stderr)
    sys.exit(2)
  return names


def main(argv: list[str]) -> int:
  names = _names(argv, REPO_CONFIGS)
  print(HEADER, flush=True)
  fit, start = 0, time.perf_counter()
  for name in names:
    row, _ = check(name)
    fit += row.fits == "yes"
    print(row.line(), flush=True)
    jax.clear_caches()  # each config's programs are compiled once: free them before the next
    gc.collect()
  print(f"checked {len(names)} configs in {time.perf_counter() - start:.0f}s", flush=True)
  print(f"check_configs: configs={len(names)} fit={fit}", flush=True)
  return 0 if fit == len(names) else 1


if __name__ == "__main__":
  # Before JAX starts a backend: only the CPU one where there is no accelerator (the deviceless
  # compilers need no device), as the CLI does.
  platforms.choose_jax_platforms()
  sys.exit(main(sys.argv[1:]))
