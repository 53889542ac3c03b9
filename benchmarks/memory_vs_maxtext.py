"""Per-device temporaries of jaxtrain's train step against MaxText's, same model, same compiler.

`python benchmarks/memory_vs_maxtext.py [--policies=full,minimal] [--maxtext_venv=DIR]
[--python=python3.12]`

Llama 3 8B, sequence 8192, one sequence per chip, FSDP over a v5p-8 slice (4 chips), flash
attention, float32 weights and Adam moments, no gradient accumulation, compiled for TPU
without a TPU (deviceless, by libtpu), for each remat policy:

  MaxText 0.2.5   maxtext.trainers.pre_train.train_compile base.yml compile_topology=v5p-8
                  model_name=llama3-8b per_device_batch_size=1 max_target_length=8192
                  attention=flash remat_policy=POLICY; temporaries from its printed
                  memory_analysis()
  jaxtrain        python -m jaxtrain.main --config=configs/llama8b.py --dry_run
                  --dry_run_target=v5p-8 with global batch 4, grad accum 1, attention.impl=pallas,
                  model.remat_policy=POLICY; temporaries from its last line

MaxText 0.2.5 needs Python >= 3.12 and brings jax 0.12 with libtpu 0.0.52; jaxtrain's own
environment has libtpu 0.0.42. So that both are compiled by the same compiler, jaxtrain is also
compiled inside MaxText's environment (this checkout on PYTHONPATH); the ratio is from that pair.
jaxtrain in its own environment is shown beside it. On first use the script builds MaxText's
environment (`python3.12 -m venv` + `pip install "maxtext[tpu]==0.2.5"`, about 3 minutes and
2.9 GB) in --maxtext_venv, and says so. Not part of the test suite.

Why no GPU row: MaxText's train_compile compiles for a GPU target over `jax.devices()` (the GPUs
of the machine it runs on, multiplied by `mock_num_gpu_processes`), so it cannot compile for a
GPU on a machine without one; jaxtrain's GPU dry run needs no GPU (jaxtrain/hardware.py).

Last line: `memory_vs_maxtext: full_ratio=X minimal_ratio=Y` (ratio = jaxtrain temporaries /
MaxText temporaries, same compiler).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
MAXTEXT = "maxtext[tpu]==0.2.5"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "jaxtrain", "maxtext-0.2.5-venv")
_LAST_LINE = re.compile(r"^dry_run: .* temp_gib=([\d.]+) ")
_MAXTEXT_MEMORY = re.compile(r"Memory analysis: .*?temp_size_in_bytes=(\d+)")


def find_python312(explicit: str | None) -> str:
  """A Python >= 3.12 interpreter for MaxText's environment."""
  candidates = [explicit] if explicit else (
      [shutil.which("python3.12"), shutil.which("python3.13")]
      + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[23]*/bin/python3.1[23]"))))
  for candidate in candidates:
    # Runs, and is >= 3.12 (a pyenv shim on PATH exists but fails for an inactive version).
    if candidate and subprocess.run(
        [candidate, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"],
        capture_output=True).returncode == 0:
      return candidate
  sys.exit("memory_vs_maxtext: MaxText 0.2.5 needs Python >= 3.12; none found (python3.12 on "
           "PATH or under ~/.pyenv). Pass --python=/path/to/python3.12")


def ensure_maxtext(venv: str, python: str | None) -> str:
  """MaxText's interpreter, building its environment on first use."""
  interpreter = os.path.join(venv, "bin", "python")
  if os.path.exists(interpreter) and subprocess.run(
      [interpreter, "-c", "import maxtext, libtpu"], capture_output=True).returncode == 0:
    return interpreter
  base = find_python312(python)
  print(f"building MaxText's environment in {venv} (first use): {base} -m venv, then pip "
        f"install '{MAXTEXT}' (about 3 minutes, 2.9 GB)", flush=True)
  subprocess.run([base, "-m", "venv", venv], check=True)
  subprocess.run([interpreter, "-m", "pip", "install", "-q", MAXTEXT], check=True)
  return interpreter


def package_version(interpreter: str, package: str) -> str:
  code = f"import importlib.metadata as m; print(m.version({package!r}))"
  done = subprocess.run([interpreter, "-c", code], capture_output=True, text=True)
  return done.stdout.strip() or "?"


def maxtext_temp(interpreter: str, policy: str, workdir: str) -> int:
  base_yml = subprocess.run(
      [interpreter, "-c", "import maxtext, os; print(os.path.join(os.path.dirname("
       "maxtext.__file__), 'configs', 'base.yml'))"],
      capture_output=True, text=True, check=True).stdout.strip()
  done = subprocess.run(
      [interpreter, "-m", "maxtext.trainers.pre_train.train_compile", base_yml,
       "compile_topology=v5p-8", "compile_topology_num_slices=1", "model_name=llama3-8b",
       "per_device_batch_size=1", "max_target_length=8192", "attention=flash",
       f"remat_policy={policy}", f"base_output_directory={workdir}", f"run_name={policy}"],
      capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=workdir)
  found = _MAXTEXT_MEMORY.search(done.stdout)
  if done.returncode != 0 or not found:
    sys.exit(f"memory_vs_maxtext: MaxText's train_compile failed (remat {policy}):\n"
             f"{(done.stdout + done.stderr)[-3000:]}")
  return int(found.group(1))


def jaxtrain_temp(interpreter: str, policy: str) -> float:
  """GiB, from the dry run's last line, compiled by `interpreter`'s libtpu."""
  done = subprocess.run(
      [interpreter, "-m", "jaxtrain.main", "--config=configs/llama8b.py", "--dry_run",
       "--dry_run_target=v5p-8", "--config.train.global_batch_size=4",
       "--config.train.grad_accum_steps=1", "--config.attention.impl=pallas",
       f"--config.model.remat_policy={policy}"],
      capture_output=True, text=True, cwd=REPO,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
  last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
  found = _LAST_LINE.match(last)
  if done.returncode != 0 or not found:
    sys.exit(f"memory_vs_maxtext: jaxtrain's dry run failed (remat {policy}, {interpreter}):\n"
             f"{(done.stdout + done.stderr)[-3000:]}")
  return float(found.group(1))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policies", default="full,minimal")
  parser.add_argument("--maxtext_venv", default=DEFAULT_VENV)
  parser.add_argument("--python", default=None, help="Python >= 3.12 for MaxText's venv")
  args = parser.parse_args()
  maxtext_python = ensure_maxtext(args.maxtext_venv, args.python)
  shared = package_version(maxtext_python, "libtpu")
  own = package_version(sys.executable, "libtpu")
  print(f"Llama 3 8B, v5p-8 (4 chips, FSDP 4), 1 x 8192 tokens per chip, flash attention; "
        f"MaxText {package_version(maxtext_python, 'maxtext')} (jax "
        f"{package_version(maxtext_python, 'jax')}, libtpu {shared}); jaxtrain's environment: "
        f"jax {package_version(sys.executable, 'jax')}, libtpu {own}")
  print()
  print(f"| remat | MaxText temporaries GiB | jaxtrain temporaries GiB | ratio | jaxtrain, "
        f"libtpu {own} GiB |")
  print("|---|---|---|---|---|")
  ratios = {}
  with tempfile.TemporaryDirectory(prefix="maxtext-compile-") as workdir:
    for policy in args.policies.split(","):
      theirs = maxtext_temp(maxtext_python, policy, workdir) / GIB
      ours = jaxtrain_temp(maxtext_python, policy)
      ours_own = jaxtrain_temp(sys.executable, policy)
      ratios[policy] = ours / theirs
      print(f"| {policy} | {theirs:.2f} | {ours:.2f} | {ours / theirs:.3f} | {ours_own:.2f} |",
            flush=True)
  print()
  print(f"(ratio: jaxtrain / MaxText, both compiled by libtpu {shared})")
  print("memory_vs_maxtext: " + " ".join(f"{p}_ratio={r:.3f}" for p, r in ratios.items()))


if __name__ == "__main__":
  main()
