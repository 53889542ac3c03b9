"""Every shipped config names its target and fits it as shipped, by that target's own compiler;
and a run that cannot fit this machine stops before allocating anything."""

import os
import re

import pytest

from jaxtrain.config import load_config_file
from jaxtrain.dryrun import measure, targets
from jaxtrain.grouped_matmul import resolve_impl
from tests.helpers import REPO, run_main

SIZED_FOR_ACCELERATORS = ("llama3_1b", "llama3_3b", "llama8b", "llama70b", "llama405b",
                          "sft_lora_llama8b", "dpo_llama8b", "reward_llama8b", "qlora_llama8b",
                          "llama8b_128k",
                          "grpo_llama8b", "qwen3_8b", "qwen3_32b", "mistral_7b", "gemma3_27b",
                          "sft_lora_qwen3_8b", "qlora_gemma3_27b", "mixtral_8x7b",
                          "qwen3_30b_a3b", "qwen3_235b_a22b", "qlora_qwen3_30b_a3b",
                          "deepseek_v3_671b", "kimi_k2_1t")


def test_every_config_names_a_valid_target():
  for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
    if name.endswith(".py"):
      config = load_config_file(os.path.join(REPO, "configs", name))
      targets.parse(config.target)  # raises TargetError if unknown
      if name[:-3] in SIZED_FOR_ACCELERATORS:
        assert targets.parse(config.target).chip is not None, name


def _experts_travel_by_all_to_all(m):
  """Expert parallelism on GPU hosts: XLA:GPU has no grouped GEMM for ragged_dot, so the
  blocked route (a while loop of GEMMs) runs; tokens go to their experts' devices and back by
  all-to-all, forward and backward, in every scanned layer."""
  assert m.mesh.expert > 1
  assert resolve_impl(m.model_cfg.runtime.moe_grouped_matmul, "gpu") == "blocked"
  assert re.search(r"\bwhile\(", m.hlo)
  assert len(re.findall(r"\ball-to-all(?:-start)?\(", m.hlo)) >= 4


# What else the targets' compilers show of these steps, read from the compile the fit test makes.
COMPILED_STEP_CHECKS = {name: _experts_travel_by_all_to_all
                        for name in ("mixtral_8x7b", "qwen3_30b_a3b", "qwen3_235b_a22b",
                                     "deepseek_v3_671b", "kimi_k2_1t")}


@pytest.mark.slow
@pytest.mark.parametrize("name", SIZED_FOR_ACCELERATORS)
def test_shipped_config_fits_its_target(name):
  config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  target = targets.parse(config.target)
  missing = targets.compiler_missing(target)
  if missing:
    pytest.skip(missing)
  m = measure.measure(config, targets.devices(target))
  assert m.backend == target.compiler  # the target's compiler, not an XLA:CPU estimate
  # At least 10% of the device's memory left to the runtime.
  assert m.total <= 0.9 * target.memory_bytes, (
      f"{name} needs {m.total / 2**30:.2f} GiB of {target.name}'s "
      f"{target.memory_bytes / 2**30:.1f} GiB per device")
  if name in COMPILED_STEP_CHECKS:
    COMPILED_STEP_CHECKS[name](m)


def test_llama8b_training_on_this_host_stops_before_allocating(tmp_path):
  """The 8B config on a CPU host: one line with needed and available GiB, exit 2, no files."""
  workdir = tmp_path / "run"
  proc = run_main("--config=configs/llama8b.py", f"--workdir={workdir}", timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert lines[0].startswith("does not fit: ")
  assert "89.75 GiB per device" in lines[0] and "GiB available" in lines[0]
  assert "--dry_run" in lines[0]
  assert not workdir.exists()
