"""Every shipped config names its target; one config of each architecture fits its target as
shipped, by that target's own compiler (every shipped config's fit is `python -m
jaxtrain.dryrun.check_configs`, which CI runs after the suite: tests/README.md); a run that
cannot fit this machine stops before allocating anything; and the workstation configs train a
step here at toy size."""

import os
import re

import jax
import numpy as np
import pytest

from jaxtrain import hardware as targets
from jaxtrain.config import load_config_file
from jaxtrain.dryrun import check_configs, interconnect
from jaxtrain.hardware import format_bytes
from jaxtrain.ops.grouped_matmul import resolve_impl
from jaxtrain.parallel.mesh import make_mesh
from jaxtrain.train import hlo_collectives, metrics
from jaxtrain.train import loop as trainer, setup as train_setup
from jaxtrain.validation.checks import resolve_mesh_shape, validate
from tests.dry_run_helpers import collectives_by_regex
from tests.helpers import REPO, dpo_pair_batch, packed_batch, run_main

SIZED_FOR_ACCELERATORS = ("llama3_1b", "llama3_3b", "llama8b", "llama70b", "llama405b",
                          "sft_lora_llama8b", "dpo_llama8b", "reward_llama8b", "qlora_llama8b",
                          "llama8b_128k",
                          "grpo_llama8b", "qwen3_8b", "qwen3_32b", "mistral_7b", "gemma3_27b",
                          "sft_lora_qwen3_8b", "qlora_gemma3_27b", "mixtral_8x7b",
                          "qwen3_30b_a3b", "qwen3_235b_a22b", "qlora_qwen3_30b_a3b",
                          "deepseek_v3_671b", "kimi_k2_1t", "qlora_llama8b_32k",
                          "qlora_llama70b", "dpo_qlora_llama70b")
# One shipped config per distinct architecture and compiler, all for GPU (no shipped config
# targets a TPU): dense (llama8b), context-parallel (llama8b_128k), and latent attention with
# experts (kimi_k2_1t, the cheaper of DeepSeek-V3's two shapes), whose step is also the expert
# one: the same MoE block, blocked grouped GEMMs and all-to-all as the grouped-query MoE configs
# (qwen3_*_a*b, mixtral), which differ only in attention, and dense attention is llama8b's.
# QLoRA on one small GPU is the check_configs test below; the pipeline's GPU compile is in
# tests/test_pipeline.py. The others are rows of check_configs.
ONE_PER_ARCHITECTURE = ("llama8b", "llama8b_128k", "kimi_k2_1t")


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


def _fsdp_collectives_as_the_hlo_counts_them(m):
  """fsdp over the 8 H100s: the weights travel by all-gather and the gradients by
  reduce-scatter, once per microbatch at least (16 of them); the dry run's collectives section
  prints what an independent count of the HLO's instructions finds (executed instructions,
  group size, bytes: dry_run_helpers.collectives_by_regex), timed at NVLink's 450 GB/s."""
  assert (m.mesh.fsdp, m.mesh.tensor, m.backend) == (8, 1, "gpu")
  independent = collectives_by_regex(m.hlo)
  assert {"all-gather", "reduce-scatter"} <= set(independent)
  weights = 2 * metrics.count_params(m.model_cfg.arch)  # bytes in bfloat16
  assert independent["all-gather"][1] >= 16 * weights
  assert independent["reduce-scatter"][1] >= 16 * weights
  target = targets.parse("h100x8")
  lines = interconnect.section(m, target)
  assert lines[1] == interconnect.HEADER
  rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ")
          and line.split()[0] in hlo_collectives.KINDS}
  assert set(rows) == set(independent)
  found = hlo_collectives.count(m.hlo)
  for kind, (executed, size, n) in independent.items():
    k = found.of(kind)
    assert (k.executed, k.bytes, k.group_sizes) == (executed, size, (n,)), kind
    assert k.link_bytes == pytest.approx(size * hlo_collectives.ring_factor(kind, n))
    row = rows[kind]
    assert row[1:3] == [f"{executed:,}", str(n)] and " ".join(row[3:5]) == format_bytes(size)
    assert " ".join(row[7:]) == interconnect.format_seconds(k.link_bytes / 450e9), row


# What else the targets' compilers show of these steps, read from the compile the fit test makes.
COMPILED_STEP_CHECKS = {"kimi_k2_1t": _experts_travel_by_all_to_all,
                        "llama8b": _fsdp_collectives_as_the_hlo_counts_them}


def test_check_configs_covers_every_shipped_config():
  assert check_configs.shipped_configs(os.path.join(REPO, "configs")) == sorted(
      SIZED_FOR_ACCELERATORS)


def _skip_without_compiler(name):
  config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  missing = targets.compiler_missing(targets.parse(config.target))
  if missing:
    pytest.skip(missing)


@pytest.mark.slow
@pytest.mark.parametrize("name", ONE_PER_ARCHITECTURE)
def test_shipped_config_fits_its_target(name):
  _skip_without_compiler(name)
  row, m = check_configs.check(name, os.path.join(REPO, "configs"))
  assert row.fits == "yes", row.line()  # the target's compiler, 10% of memory to spare
  assert m.backend == targets.parse(row.target).compiler
  assert row.headroom_gib > 0 and row.total_gib == m.total / 2**30
  if name in COMPILED_STEP_CHECKS:
    COMPILED_STEP_CHECKS[name](m)


@pytest.mark.slow(seconds=10)
def test_check_configs_prints_a_row_per_config_and_its_last_line(capsys):
  """The command's contract on the QLoRA config (one L4): its row, the last line, exit 0; an
  unknown name exits 2 naming the shipped ones."""
  _skip_without_compiler("qlora_llama8b")
  assert check_configs.main(["configs/qlora_llama8b.py"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0].split() == ["config", "target", "compiler", "total_gib", "headroom", "fits"]
  row = lines[1].split()
  assert row[:3] == ["qlora_llama8b", "l4x1", "gpu"] and row[-1] == "yes", lines[1]
  assert 0 < float(row[3]) < 0.9 * 24 and float(row[4]) > 0
  assert lines[-1] == "check_configs: configs=1 fit=1"
  with pytest.raises(SystemExit) as e:
    check_configs.main(["no_such_config"])
  assert e.value.code == 2
  assert "no_such_config: not a shipped config" in capsys.readouterr().err


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


# The workstation configs (docs/finetuning.md, "One workstation") shrunk to a toy model that
# trains on this host: their objective, adapters, NF4 base, remat, gradient accumulation,
# optimizer placement and mesh axes over as many CPU devices as the target has cards, as
# shipped; only the model's dims, the sequence, the quantization group (to divide the toy dims
# over the mesh) and the attention kernel (cuDNN and our Triton kernels are GPU-only: XLA's
# here) change.
WORKSTATION_CONFIGS = ("qlora_llama8b_32k", "qlora_llama70b", "dpo_qlora_llama70b")


def _toy(name):
  config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  m = config.model
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 128, 2, 64, 128
  m.num_heads, m.num_kv_heads, m.head_dim = 8, 2, 8
  config.lora.quant_group_size = 16
  config.train.seq_len = 31 if config.train.objective == "dpo" else 32  # rows of 32
  config.train.loss_chunk_size = 16
  config.attention.impl = "xla"
  config.attention.block_q = config.attention.block_k = 0
  return config


@pytest.mark.parametrize("name", WORKSTATION_CONFIGS)
def test_workstation_config_trains_a_step_at_toy_size(name):
  shipped = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  config = _toy(name)
  devices = targets.parse(config.target).num_devices
  validate(config, devices, "cpu")
  mesh = make_mesh(resolve_mesh_shape(config, devices), jax.devices()[:devices])
  setup = train_setup.build(config, mesh)
  assert setup.model_cfg.peft.base_quant == "nf4" and setup.model_cfg.peft.lora_rank == 16
  assert setup.model_cfg.runtime.remat_policy == "full"
  assert dict(mesh.shape)["fsdp"] == devices  # fsdp over every card, as on the target
  state = train_setup.init_state(setup, seed=0)
  assert state.frozen.reference is None  # DPO too: the reference is the base, no second copy
  assert np.dtype(np.uint8) in {x.dtype for x in jax.tree.leaves(state.frozen.base)}  # NF4
  b = config.train.global_batch_size
  if config.train.objective == "dpo":
    batch = dpo_pair_batch(b=b, t=config.train.seq_len + 1)
  else:
    batch = packed_batch(b, config.train.seq_len, config.model.vocab_size)
  adapters = jax.device_get(state.params)
  with jax.set_mesh(setup.mesh):
    state, m = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
  assert (config.train.global_batch_size, config.train.grad_accum_steps,
          config.optim.offload_state) == (shipped.train.global_batch_size,
                                          shipped.train.grad_accum_steps,
                                          shipped.optim.offload_state)
  assert int(state.step) == 1 and np.isfinite(float(m["loss"]))
  if config.train.objective == "dpo":  # fresh adapters: the policy is the reference
    assert float(m["loss"]) == pytest.approx(np.log(2), abs=1e-6)
  after = jax.tree.leaves(jax.device_get(state.params))
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(adapters), after))
