"""The same dry runs and CPU benchmark on two installs of jaxtrain (e.g. Python 3.11 / jax 0.10.2
and Python 3.12 / jax 0.12), one after the other case by case so that machine noise hits both.

Each dry run is `python -m jaxtrain.main --config=CONFIG --dry_run [--dry_run_target=T]`: the
table gives its last line's `total_gib` and `fits`, the `compiler=` it names, and the seconds it
reported for itself ("dry run took X s": tracing, lowering and the target compiler's compile; no
weights are allocated). `--cpu_throughput` also runs `benchmarks/cpu_throughput.py` with each
interpreter and gives its last line's tokens/s and MFU.

  python benchmarks/jax_versions.py --pythons .venv/bin/python,.venv312/bin/python [--cpu_throughput]

Last line: `jax_versions: A=<jax> B=<jax> total_gib_ratio=X dry_run_s_ratio=Y` (B over A, the
geometric mean over the dry runs both completed).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys

CASES = (
    ("llama8b", "configs/llama8b.py", None),          # its own target: h100x8
    ("llama8b", "configs/llama8b.py", "v5p-8"),
    ("llama8b", "configs/llama8b.py", "tpu7x-8"),
    ("moe_tiny", "configs/moe_tiny.py", "h100x8"),
    ("deepseek_v3_671b", "configs/deepseek_v3_671b.py", None),
)
_LAST = re.compile(r"dry_run: target=(\S+) compiler=(\S+) .*total_gib=([\d.e+-]+) fits=(\w+)")
_TOOK = re.compile(r"dry run took ([\d.]+) s")


def _env() -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # each install runs with its own defaults
  return env


def versions(python: str) -> str:
  out = subprocess.run([python, "-c", "import sys, jax; print(f'py{sys.version.split()[0]}/"
                        "jax{jax.__version__}')"], capture_output=True, text=True, env=_env(),
                       check=True)
  return out.stdout.strip()


def dry_run(python: str, config: str, target: str | None) -> dict:
  cmd = [python, "-m", "jaxtrain.main", f"--config={config}", "--dry_run"]
  cmd += [f"--dry_run_target={target}"] if target else []
  proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
  last = _LAST.search(proc.stdout)
  took = _TOOK.search(proc.stdout)
  if proc.returncode not in (0, 1) or not last or not took:  # 1: ran, does not fit
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)[:200]}"}
  return {"target": last.group(1), "compiler": last.group(2), "total_gib": float(last.group(3)),
          "fits": last.group(4), "seconds": float(took.group(1))}


def cpu_throughput(python: str) -> str:
  proc = subprocess.run([python, "benchmarks/cpu_throughput.py"], capture_output=True, text=True,
                        env=_env())
  lines = proc.stdout.strip().splitlines()
  return lines[-1] if proc.returncode == 0 and lines else f"exit {proc.returncode}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pythons", required=True, help="two interpreters, comma-separated")
  parser.add_argument("--cpu_throughput", action="store_true")
  args = parser.parse_args()
  pythons = args.pythons.split(",")
  if len(pythons) != 2:
    sys.exit("--pythons takes exactly two interpreters, e.g. .venv/bin/python,.venv312/bin/python")
  names = [versions(p) for p in pythons]
  print(f"A = {names[0]} ({pythons[0]})\nB = {names[1]} ({pythons[1]})\n")
  print("| config | target | compiler A / B | total GiB A | total GiB B | fits A / B "
        "| dry run s A | dry run s B |\n|---|---|---|---|---|---|---|---|")
  gib_ratios, second_ratios = [], []
  for name, config, target in CASES:
    a, b = (dry_run(p, config, target) for p in pythons)
    if "error" in a or "error" in b:
      print(f"| {name} | {target or 'own'} | {a.get('error', 'ok')} / {b.get('error', 'ok')} |")
      continue
    gib_ratios.append(b["total_gib"] / a["total_gib"])
    second_ratios.append(b["seconds"] / a["seconds"])
    print(f"| {name} | {a['target']} | {a['compiler']} / {b['compiler']} | {a['total_gib']:.2f} "
          f"| {b['total_gib']:.2f} | {a['fits']} / {b['fits']} | {a['seconds']:.1f} "
          f"| {b['seconds']:.1f} |", flush=True)
  if args.cpu_throughput:
    print()
    for name, python in zip(names, pythons):
      print(f"{name}: {cpu_throughput(python)}", flush=True)
  mean = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
  print(f"\njax_versions: A={names[0]} B={names[1]} total_gib_ratio={mean(gib_ratios):.3f} "
        f"dry_run_s_ratio={mean(second_ratios):.3f}")


if __name__ == "__main__":
  main()
