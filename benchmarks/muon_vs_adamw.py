"""Muon against AdamW on the CPU demo: `configs/tiny.py`'s model, steps and data, each optimizer at
its own best learning rate from a small sweep.

Every run is `python -m jaxtrain.main --config=configs/tiny.py --config.optim.name=NAME
--config.optim.learning_rate=LR` in a fresh workdir (the same data stream and seed for all, eval
every 50 steps). Runs alternate between the optimizers, so machine noise hits both. A learning
rate's score is its last eval loss; each optimizer's best one is reported with its eval loss
every 50 steps, its median step time (train records after the first, from their tokens/s) and
its process's wall time.

  python benchmarks/muon_vs_adamw.py [--lrs 1e-3,3e-3,1e-2] [--steps 200]

Last line: `muon_vs_adamw: muon_eval=X adamw_eval=Y muon_step_ms=A adamw_step_ms=B` (the best
runs' final eval losses and median step times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMIZERS = ("muon", "adamw")


def run(name: str, lr: float, steps: int, workdir: str) -> dict:
  """{"eval": {step: eval loss}, "step_ms": median step time, "wall_s": the whole process's
  seconds} of one training run."""
  cmd = [sys.executable, "-m", "jaxtrain.main", "--config=configs/tiny.py",
         f"--workdir={workdir}", f"--config.optim.name={name}",
         f"--config.optim.learning_rate={lr}", f"--config.train.steps={steps}",
         "--config.train.eval_every=50", "--config.train.log_every=10",
         "--config.checkpoint.every_steps=0"]
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
  wall_s = time.perf_counter() - start
  if proc.returncode != 0:
    raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
  train = [r for r in records if "tokens_per_sec" in r][1:]  # the first holds the compile
  step_ms = statistics.median(1000 * r["tokens"] / r["tokens_per_sec"] for r in train)
  return {"eval": evals, "step_ms": step_ms, "wall_s": wall_s}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lrs", default="1e-3,3e-3,1e-2",
                      help="learning rates swept for both optimizers (comma-separated)")
  parser.add_argument("--steps", type=int, default=200, help="train steps per run")
  args = parser.parse_args()
  lrs = [float(x) for x in args.lrs.split(",")]
  results: dict[tuple[str, float], dict] = {}
  with tempfile.TemporaryDirectory(prefix="muon-vs-adamw-") as tmp:
    for lr in lrs:
      for name in OPTIMIZERS:
        results[name, lr] = run(name, lr, args.steps, os.path.join(tmp, f"{name}-{lr:g}"))
        last = results[name, lr]["eval"][max(results[name, lr]["eval"])]
        print(f"  {name:<6} lr={lr:<8g} final eval {last:.4f}  "
              f"{results[name, lr]['step_ms']:.1f} ms/step", flush=True)

  final = lambda r: r["eval"][max(r["eval"])]
  best = {name: min((lr for lr in lrs), key=lambda lr, n=name: final(results[n, lr]))
          for name in OPTIMIZERS}
  print(f"\nsweep (final eval loss after {args.steps} steps of configs/tiny.py):")
  print(f"  {'lr':<10}" + "".join(f"{n:>10}" for n in OPTIMIZERS))
  for lr in lrs:
    print(f"  {lr:<10g}" + "".join(f"{final(results[n, lr]):>10.4f}" for n in OPTIMIZERS))
  steps = sorted(results["muon", best["muon"]]["eval"])
  print(f"\neval loss, each at its best learning rate (muon {best['muon']:g}, adamw "
        f"{best['adamw']:g}):")
  print(f"  {'step':<6}" + "".join(f"{n:>10}" for n in OPTIMIZERS))
  for step in steps:
    print(f"  {step:<6}" + "".join(f"{results[n, best[n]]['eval'][step]:>10.4f}"
                                   for n in OPTIMIZERS))
  ms = {n: results[n, best[n]]["step_ms"] for n in OPTIMIZERS}
  print(f"  {'ms/step':<6}" + "".join(f"{ms[n]:>10.1f}" for n in OPTIMIZERS))
  print(f"  {'wall s':<6}" + "".join(f"{results[n, best[n]]['wall_s']:>10.1f}"
                                     for n in OPTIMIZERS))
  print(f"muon_vs_adamw: muon_eval={final(results['muon', best['muon']]):.4f} "
        f"adamw_eval={final(results['adamw', best['adamw']]):.4f} "
        f"muon_step_ms={ms['muon']:.1f} adamw_step_ms={ms['adamw']:.1f}")


if __name__ == "__main__":
  main()
