"""Training a Mixture of Experts (configs/moe_tiny.py): expert parallelism on 8 emulated devices
equals one device step by step, checkpoints move between those meshes, the step compiles for
GPU and TPU targets with its grouped matmul and all-to-all, and decoding with a cache equals the
forward pass."""

import os
import re

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import hardware as targets
from jaxtrain.interop import hf
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import create_model
from jaxtrain.ops.grouped_matmul import resolve_impl
from jaxtrain.train import measure
from tests.moe_helpers import on_short_rows
from tests.helpers import (REPO, absl_cli_module, assert_curves_close, cli_curves, mesh_of,
                          metrics_records, run_cli, run_entry, train_curves)

MOE_TINY = os.path.join(REPO, "configs", "moe_tiny.py")
# moe_tiny's model on shorter, fewer rows: the same experts, routing and losses, faster steps.
SHORT = ("--config.train.seq_len=64", "--config.train.global_batch_size=8",
         "--config.train.loss_chunk_size=64", "--config.train.log_every=1",
         "--config.train.eval_every=1000", "--config.train.eval_batches=1")


def _moe_tiny(**mesh):
  return on_short_rows(MOE_TINY, **mesh)


@pytest.fixture(scope="module")
def one_device_curves():
  return train_curves(_moe_tiny(), {}, steps=20)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(expert=4, fsdp=2)])
def test_expert_parallel_training_equals_one_device_for_20_steps(one_device_curves, mesh):
  """Float32 losses and gradient norms (with the aux and z losses in the objective) within
  1e-5 of one device's at each of 20 dropless steps. (The experts split 2 ways beside data
  and tensor parallelism: tests/test_deepseek.py, on DeepSeek's router.)"""
  curves = train_curves(_moe_tiny(**mesh), mesh, steps=20)
  assert_curves_close(curves, one_device_curves, rtol=1e-5)


@pytest.mark.slow
def test_checkpoints_resume_across_expert_parallel_and_one_device(tmp_path):
  """One run's life across meshes: two steps on 8 devices with the experts split 4 ways, two
  more resumed on one device, two more resumed on the 8 again; steps 3-6 equal the
  uninterrupted one-device run's."""
  ep = ("--config.mesh.expert=4", "--config.mesh.fsdp=2")
  common = (f"--config={MOE_TINY}", *SHORT, "--config.checkpoint.every_steps=2",
            "--config.checkpoint.async_save=False", "--config.optim.decay_steps=6")
  _, whole = cli_curves(tmp_path / "whole", *common, "--config.train.steps=6", devices=1)
  for steps, mesh in ((2, ep), (4, ()), (6, ep)):
    out, resumed = cli_curves(tmp_path / "moved", *common, f"--config.train.steps={steps}",
                              *mesh, devices=8 if mesh else 1)
    assert steps == 2 or f"resumed from step {steps - 2}" in out, out[-2000:]
  assert len(resumed["loss"]) == 6  # the workdir's metrics.jsonl, over its three runs
  assert_curves_close({k: v[2:] for k, v in resumed.items()},
                      {k: v[2:] for k, v in whole.items()}, rtol=1e-5)
  assert "moe_aux_loss" in metrics_records(tmp_path / "whole")[0]


@pytest.mark.slow
@pytest.mark.parametrize("name,grouped", [
    # The TPU compiler's own grouped-matmul kernel for ragged_dot. (GPU targets: the expert
    # configs' fit tests, tests/test_shipped_configs.py, check their steps the same way.)
    ("v5p-8", r"ragged-dot")])
def test_moe_tiny_step_compiles_for_the_target_with_grouped_matmul_and_all_to_all(name,
                                                                                grouped):
  target = targets.parse(name)
  missing = targets.compiler_missing(target)
  if missing is not None:
    pytest.skip(f"no deviceless compiler for {name}: {missing}")
  config = _moe_tiny(expert=4, fsdp=target.num_devices // 4)  # v5p-8 is 4 chips
  config.target = name
  compiled, setup, _, _, _, _ = measure.compile_step(config, targets.devices(target))
  hlo = compiled.as_text()
  assert setup.model_cfg.runtime.platform == target.compiler
  assert resolve_impl(setup.model_cfg.runtime.moe_grouped_matmul, target.compiler) == (
      "ragged" if target.compiler == "tpu" else "blocked")
  assert re.search(grouped, hlo)
  # Dispatch and return in the forward, their transposes in the backward, per scanned layer.
  assert len(re.findall(r"\ball-to-all(?:-start)?\(", hlo)) >= 4


def test_decode_with_cache_equals_the_forward_pass_with_a_dense_first_layer():
  config = _moe_tiny()
  config.model.num_layers, config.moe.dense_layers = 3, "0"
  model = create_model(ModelConfig.from_config(config, platform="cpu"), mesh_of({}), seed=0)
  assert hasattr(model, "dense_layers")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
  want = np.asarray(nnx.jit(type(model).__call__)(model, tokens))
  step = nnx.jit(type(model).forward_with_cache)
  logits, cache = step(model, tokens[:, :8], jnp.zeros((2,), jnp.int32), model.empty_cache(2, 16))
  got = [np.asarray(logits)]
  for t in range(8, 12):
    logits, cache = step(model, tokens[:, t:t + 1], jnp.full((2,), t, jnp.int32), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=2e-5, rtol=1e-5)


# The tiny fine-tuning configs' model as moe_tiny's Mixture of Experts.
MOE_FLAGS = ("--config.model.family=mixtral", "--config.moe.num_experts=4",
             "--config.moe.experts_per_token=2", "--config.moe.expert_mlp_dim=192")


def _run(config, workdir, *overrides):
  proc = run_cli(f"--config=configs/{config}", f"--workdir={workdir}", *MOE_FLAGS, *overrides)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  records = metrics_records(workdir)
  return (proc.stdout, [r for r in records if "loss" in r],
          [r for r in records if "eval_loss" in r])


@pytest.mark.slow(seconds=20)
def test_lora_on_experts_qlora_and_dpo_fine_tune_an_moe_model(tmp_path):
  """An SFT'd MoE base; QLoRA, adapters on attention and on every expert's projections over its
  NF4-quantized experts, improves its held-out loss; the QLoRA run's export (adapters merged,
  experts dequantized) computes what generation's merged model does; DPO trains the MoE
  policy with its router losses."""
  base = tmp_path / "sft"
  # Rows of 64 tokens and one eval batch: a quarter of the configs' work per step.
  short = ("--config.train.seq_len=64", "--config.train.loss_chunk_size=64",
           "--config.train.eval_batches=1")
  # A base ten steps in, with room left for the adapters to improve it.
  _, train, evals = _run("sft_tiny.py", base, *short, "--config.train.steps=10",
                         "--config.optim.warmup_steps=3", "--config.train.log_every=1",
                         "--config.train.eval_every=10", "--config.checkpoint.every_steps=10")
  assert train[-1]["loss"] < train[0]["loss"] - 0.8 and "moe_aux_loss" in train[-1]
  # QLoRA: adapters on attention and on every expert's projections over the NF4 experts (plain
  # LoRA is the same adapters over an unquantized base: tests/test_lora_training.py).
  out, _, lora_evals = _run("qlora_tiny.py", tmp_path / "qlora_tiny", *short,
                            "--config.train.steps=8", "--config.optim.warmup_steps=4",
                            "--config.train.eval_every=8", "--config.checkpoint.every_steps=8",
                            "--config.lora.targets=q,v,gate,up,down",
                            f"--config.checkpoint.init_from={base}")
  assert "4 experts" in out and "adapter params" in out and "stored nf4" in out
  assert lora_evals[-1]["eval_loss"] < evals[-1]["eval_loss"] - 0.01, lora_evals

  with absl_cli_module("jaxtrain.generate.cli") as generate_cli:
    merged, _ = generate_cli.load(str(tmp_path / "qlora_tiny"))
  proc = run_entry(hf.main, "export", f"--checkpoint={tmp_path / 'qlora_tiny'}",
                   f"--out={tmp_path / 'hf'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  exported, exported_config = hf.load_model(str(tmp_path / "hf"))
  assert exported_config.model.family == "mixtral" and exported_config.moe.num_experts == 4
  tokens = np.arange(24, dtype=np.int32).reshape(2, 12) + 97
  np.testing.assert_allclose(np.asarray(exported(tokens)), np.asarray(merged(tokens)),
                             atol=1e-5, rtol=1e-5)

  _, dpo, _ = _run("dpo_tiny.py", tmp_path / "dpo", "--config.train.steps=4",
                   "--config.train.log_every=1", "--config.train.eval_every=4",
                   "--config.train.eval_batches=1")
  assert dpo[-1]["loss"] < dpo[0]["loss"] and "reward_accuracy" in dpo[-1]
  assert 0.9 < dpo[-1]["moe_aux_loss"] < 2.0
