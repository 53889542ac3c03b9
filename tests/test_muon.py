"""Muon (jaxtrain/train/muon.py): the update equals a float64 numpy reference of the algorithm,
matrix by matrix whatever the stacking; which leaves get Muon; bad settings refused."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain.config import MUON_ADJUST_LR, ConfigError, default_config
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from jaxtrain.train import muon
from jaxtrain.train.optim import make_optimizer
from jaxtrain.validation.checks import validate
from tests.helpers import (SMALL_TINY_ARGS, assert_curves_close, mesh_of, run_cli, run_tiny,
                           small_config, train_curves)
from tests.moe_helpers import on_short_rows

LR, WD, MOMENTUM = 0.02, 0.1, 0.95


def _reference_orthogonalize(u_AB: np.ndarray, steps: int) -> np.ndarray:
  """Newton-Schulz in float64, written from the definition (not from the module)."""
  a, b, c = 3.4445, -4.7750, 2.0315
  x = u_AB.T if u_AB.shape[0] > u_AB.shape[1] else u_AB
  x = x / (np.linalg.norm(x) + 1e-7)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if u_AB.shape[0] > u_AB.shape[1] else x


def _reference_steps(w_AB, grads_AB, steps=5, adjust="match_rms_adamw"):
  """Moonlight's Muon on one [in, out] matrix: momentum, Nesterov, NS, scale, decoupled decay."""
  w, m = w_AB.astype(np.float64), np.zeros_like(w_AB, np.float64)
  rows, cols = w_AB.shape
  scale = 0.2 * np.sqrt(max(rows, cols)) if adjust == "match_rms_adamw" else np.sqrt(
      max(1.0, cols / rows))
  for g in grads_AB:
    m = MOMENTUM * m + g
    u = g + MOMENTUM * m
    w = w - LR * (scale * _reference_orthogonalize(u, steps) + WD * w)
  return w


def _config(adjust="match_rms_adamw"):
  c = default_config()
  c.optim.name, c.optim.muon.adjust_lr = "muon", adjust
  c.train.steps, c.optim.warmup_steps, c.optim.min_lr_ratio = 100, 0, 1.0
  c.optim.learning_rate, c.optim.weight_decay, c.optim.grad_clip_norm = LR, WD, 0.0
  return c


@pytest.mark.parametrize("adjust", MUON_ADJUST_LR)
def test_update_equals_a_float64_reference_for_each_matrix_of_every_stacking(adjust):
  rng = np.random.default_rng(0)
  shapes = {"w_up_DF": (24, 40),            # a plain matrix [D, F]
            "w_down_FD": (3, 40, 24),        # scanned layers [L, F, D]: read [F, D] each
            "w_gate_XDF": (2, 3, 24, 40),    # experts per layer [L, X, D, F]
            "wo_HED": (4, 6, 24),            # [H, E, D] read as [H*E, D]
            "wq_DHE": (2, 24, 4, 6)}         # scanned [L, D, H, E] read as [D, H*E]
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  params["attn_norm"] = {"scale": jnp.ones((24,), jnp.float32)}  # AdamW, no decay
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
           for _ in range(3)]
  tx = make_optimizer(_config(adjust))
  state, new = tx.init(params), params
  for g in grads:
    updates, state = tx.update(g, state, new)
    new = optax.apply_updates(new, updates)

  def matrices(name, x):  # [N, in, out], as the module's docstring reads each name
    x = np.asarray(x)
    return {"w_up_DF": lambda: x[None], "w_down_FD": lambda: x,
            "w_gate_XDF": lambda: x.reshape(6, 24, 40), "wo_HED": lambda: x.reshape(1, 24, 24),
            "wq_DHE": lambda: x.reshape(2, 24, 24)}[name]()
  for name in shapes:
    got = matrices(name, new[name])
    start = matrices(name, params[name])
    for i in range(start.shape[0]):
      want = _reference_steps(start[i], [matrices(name, g[name])[i] for g in grads],
                              adjust=adjust)
      np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                 err_msg=f"{name}[{i}]")
  # The norm scale took AdamW's step: |update| = lr per element at Adam's first steps' sign.
  assert not np.allclose(np.asarray(new["attn_norm"]["scale"]), 1.0)


def test_projections_get_muon_and_embeddings_head_norms_router_get_adamw():
  config = small_config()
  config.moe.num_experts, config.moe.experts_per_token = 4, 2
  _, params, _ = abstract_model(ModelConfig.from_config(config), mesh_of((1, 1, 1)))
  labels = {jax.tree_util.keystr(p): v for p, v in
            jax.tree_util.tree_leaves_with_path(muon.labels(params))}
  muon_keys = {k for k, v in labels.items() if v == "muon"}
  assert muon_keys, labels
  for key, label in labels.items():
    adamw = any(n in key for n in ("embed_VD", "head_DV", "router", "norm", "scale"))
    assert label == ("adamw" if adamw else "muon"), (key, label)


@pytest.mark.parametrize("key,value,message", [
    ("optim.name", "sgd", "optim.name='sgd': unknown optimizer; choose one of adamw, muon"),
    ("optim.muon.ns_steps", 0, "optim.muon.ns_steps=0: Newton-Schulz needs at least 1"),
    ("optim.muon.adjust_lr", "rms", "optim.muon.adjust_lr='rms': choose one of"),
    ("optim.muon.momentum", 1.0, "optim.muon.momentum=1.0: must be in [0, 1)"),
])
def test_bad_muon_settings_are_refused_in_one_line(key, value, message):
  config = small_config()
  config.optim.name = "muon"
  group, *rest = key.split(".")
  target = config[group]
  for name in rest[:-1]:
    target = target[name]
  target[rest[-1]] = value
  with pytest.raises(ConfigError) as error:
    validate(config, num_devices=1, platform="cpu")
  assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("path,shape", [
    ("configs/tiny.py", {"data": 2, "fsdp": 2, "tensor": 2}),
    ("configs/moe_tiny.py", {"expert": 4, "fsdp": 2}),
])
def test_muon_on_eight_devices_equals_one_device_for_20_steps(path, shape):
  """Muon's orthogonalization spreads each stack's matrices over the devices (muon._spread) and
  brings the result back to the parameter's sharding: the same numbers as on one device."""
  config = on_short_rows(path)
  config.optim.name = "muon"
  one = train_curves(config, {}, steps=20)
  for axis, size in shape.items():
    setattr(config.mesh, axis, size)
  eight = train_curves(config, shape, steps=20)
  assert_curves_close(eight, one, rtol=1e-5)
  config.optim.name = "adamw"  # and Muon did train: its curve is not AdamW's
  adamw = train_curves(config, shape, steps=3)
  # (20x the parity tolerance: tiny.py is still warming up its learning rate at step 3)
  assert abs(adamw["loss"][2] - one["loss"][2]) > 1e-4, (adamw["loss"], one["loss"][:3])


@pytest.mark.slow(seconds=30)
def test_muon_run_resumes_bitwise_and_its_state_is_not_read_as_adamw(tmp_path):
  """A Muon run resumed from its step-8 checkpoint logs steps 9-12 exactly as the run that went
  on; the checkpoint's state refuses an AdamW run in one line."""
  args = ["--config.optim.name=muon", "--config.train.steps=12", "--config.train.log_every=1",
          "--config.train.eval_every=6", "--config.optim.warmup_steps=2",
          "--config.checkpoint.every_steps=4"]
  _, whole = run_tiny(tmp_path / "whole", *args)
  resumed_dir = tmp_path / "resumed"
  shutil.copytree(tmp_path / "whole" / "checkpoints" / "8", resumed_dir / "checkpoints" / "8")
  _, resumed = run_tiny(resumed_dir, *args)
  train = lambda records: {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}
  assert sorted(train(resumed)) == [9, 10, 11, 12]
  assert all(train(resumed)[s] == train(whole)[s] for s in range(9, 13))
  proc = run_cli("--config=configs/tiny.py", f"--workdir={resumed_dir}", *SMALL_TINY_ARGS,
                 *args[1:])
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert ("holds the optimizer state of optim.name='muon', this run has optim.name='adamw'"
          in proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]


def test_newton_schulz_flops_per_step_count_every_matrix_of_the_stack():
  """Two scanned [D=64, F=128] stacks of 2 layers, 5 steps: per matrix 5 * (4*64*64*128 +
  2*64**3) (the Gram and its square on the wide side), times 4 matrices."""
  params = {"layers": {"w_up_DF": jnp.zeros((2, 64, 128)), "w_down_FD": jnp.zeros((2, 128, 64)),
                       "mlp_norm": {"scale": jnp.zeros((2, 64))}}}
  assert muon.step_flops(params, 5) == 4 * 5 * (4 * 64 * 64 * 128 + 2 * 64 ** 3)
