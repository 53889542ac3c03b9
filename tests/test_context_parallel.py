"""Context parallelism on 8 CPU devices: the sequence layout, ring and all-gather attention
against the reference, training losses against one device, the collectives in the compiled
step, checkpoints across meshes, and the config errors."""

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import hardware as targets
from jaxtrain.ops import attention
from jaxtrain.parallel import context_parallel as cp
from jaxtrain.parallel.context_attention import context_attention
from jaxtrain.train import setup as train_setup
from jaxtrain.train.measure import compile_setup, compile_step
from tests.helpers import (assert_curves_close, assert_one_line_config_error, cli_curves,
                           mesh_of, run_cli, small_config, train_curves)


# ------------------------------------------------------------------------------ the layout


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("balanced", [False, True])
def test_layout_round_trips_exactly(shards, balanced):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 64, 5)), jnp.float32)
  laid = cp.to_layout({"x": x}, shards, balanced)["x"]
  np.testing.assert_array_equal(cp.from_layout(laid, shards, balanced), x)
  perm = cp.layout_permutation(64, shards, balanced)
  assert sorted(perm.tolist()) == list(range(64))
  np.testing.assert_array_equal(laid, x[:, perm])


def test_dual_chunk_swap_gives_device_i_chunks_i_and_2c_minus_1_minus_i():
  rows = cp.global_positions(16, 4, balanced=True)  # 8 chunks of 2
  assert rows.tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
  assert cp.global_positions(16, 4, balanced=False).tolist()[3] == [12, 13, 14, 15]


def test_load_balance_equalizes_the_causal_work():
  plain = cp.causal_pairs_per_device(131072, 8, balanced=False)
  balanced = cp.causal_pairs_per_device(131072, 8, balanced=True)
  assert plain.sum() == balanced.sum() == 131072 * 131073 // 2
  assert len(set(balanced.tolist())) == 1  # every device the same
  assert plain.max() / plain.mean() > 1.8  # the last device: (2C-1)/C of the mean


# ------------------------------------------------------------------------------ attention

B, T, H, K, E = 2, 64, 8, 4, 16


@pytest.fixture(scope="module")
def qkv():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, H, E)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, T, K, E)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, T, K, E)), jnp.float32)
  # Packed rows: three documents of uneven lengths, then padding (segment 0).
  seg = np.zeros((B, T), np.int32)
  seg[0, :20], seg[0, 20:23], seg[0, 23:60] = 1, 2, 3
  seg[1, :41], seg[1, 41:] = 1, 2
  dout = jnp.asarray(rng.normal(size=(B, T, H, E)), jnp.float32)
  return q, k, v, jnp.asarray(seg), dout


def _assert_equals_reference(qkv, shape, balanced, split_attention):
  """`split_attention(q, k, v, seg)` (sequences in the context layout, under the mesh `shape`)
  against xla_attention on the original order: the output and the gradients of q, k and v."""
  q, k, v, seg, dout = qkv
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: attention.xla_attention(q, k, v, seg), q, k, v)
  perm = cp.layout_permutation(T, shape["context"], balanced)
  inverse = np.argsort(perm)

  def split(q, k, v):  # in the layout, as the model sees it; back in order for comparison
    return split_attention(q[:, perm], k[:, perm], v[:, perm], seg[:, perm])[:, inverse]

  with jax.set_mesh(mesh_of(shape)):
    out, vjp = jax.vjp(jax.jit(split), q, k, v)
    grads = vjp(dout)
  np.testing.assert_allclose(out, ref_out, atol=2e-6)
  for got, want in zip(grads, ref_vjp(dout)):
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("shape", [{"context": 4, "fsdp": 2},
                                   {"context": 2, "data": 2, "tensor": 2},
                                   {"context": 8}])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("balanced", [False, True])
def test_context_attention_equals_reference_forward_and_gradients(qkv, shape, strategy,
                                                                   balanced):
  _assert_equals_reference(qkv, shape, balanced, lambda q, k, v, seg: context_attention(
      q, k, v, seg, strategy=strategy, balanced=balanced, tile=4))


@pytest.mark.parametrize("strategy,shape", [
    pytest.param("ring", {"context": 4, "fsdp": 2}, marks=pytest.mark.slow),
    ("all_gather", {"context": 2, "data": 2, "tensor": 2})])
def test_pallas_kernels_per_chunk_pair_equal_reference(qkv, strategy, shape):
  """The GPU route (our flash kernels per chunk pair, merged by log-sum-exp), run in the Pallas
  interpreter."""
  _assert_equals_reference(qkv, shape, True, lambda q, k, v, seg: attention.attention(
      q, k, v, seg, impl="pallas", interpret=True, platform="cpu", context_parallel=strategy))


@pytest.mark.slow
def test_h100_step_runs_our_kernels_per_chunk_pair():
  """The ring (the route with its own backward pass); both strategies' collectives are checked
  on CPU by test_compiled_step_has_the_strategys_collectives."""
  strategy, collective = "ring", "collective-permute"
  target = targets.parse("h100x8")
  missing = targets.compiler_missing(target)
  if missing is not None:
    pytest.skip(f"no deviceless compiler for h100x8: {missing}")
  config = _config(4, strategy, fsdp=2)
  config.target, config.attention.impl = "h100x8", "auto"
  config.train.seq_len = 256
  compiled, setup, _, _, note, _ = compile_step(config, targets.devices(target))
  hlo = compiled.as_text()
  triton = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton', hlo)
  assert len(triton) >= 2, note  # forward and backward kernels
  assert collective in hlo and "__cudnn$fmha" not in hlo
  assert "our Pallas kernels per chunk pair" in note
  assert setup.model_cfg.runtime.platform == "gpu"


def test_tiles_above_the_causal_diagonal_are_skipped():
  """The ring's tiles run under lax.cond: a device whose keys all follow its queries computes
  nothing for them (here the first device of a plain split: 1 of C parts visible)."""
  from jaxtrain.ops import attention_tiles as tiles  # pylint: disable=import-outside-toplevel
  calls = []
  real = tiles._scores  # pylint: disable=protected-access

  def counting(*args):
    calls.append(1)
    return real(*args)

  q = jnp.ones((1, 8, 1, 4))
  k = jnp.ones((1, 8, 1, 4))
  seg = jnp.zeros((1, 8), jnp.int32)
  stats = tiles.init_stats(q, 1, 4)
  # Queries 0..7 against keys 8..15: every tile is above the diagonal.
  later = tiles.accumulate(stats, q, k, k, seg, seg, jnp.arange(8), jnp.arange(8, 16),
                           causal=True, sm_scale=1.0, tile_q=4, tile_k=4)
  np.testing.assert_array_equal(later.l, stats.l)  # nothing was added
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(tiles, "_scores", counting)
    jax.make_jaxpr(lambda: tiles.accumulate(stats, q, k, k, seg, seg, jnp.arange(8),
                                            jnp.arange(8), causal=True, sm_scale=1.0,
                                            tile_q=4, tile_k=4))()
  assert calls  # traced once inside the cond's branch; the cond decides at run time


# ------------------------------------------------------------------------------ training


def _config(context, strategy, **mesh):
  c = small_config()
  c.train.seq_len = 64
  c.attention.context_parallel = strategy
  c.mesh.context = context
  for axis, size in mesh.items():
    c.mesh[axis] = size
  return c


@pytest.fixture(scope="module")
def one_device_curves():
  """Losses and grad norms of 3 steps on one device: what every context mesh must follow."""
  return train_curves(_config(1, "all_gather"), (1, 1, 1))


@pytest.mark.parametrize("strategy,shape", [
    ("all_gather", {"context": 4, "fsdp": 2}),
    ("ring", {"context": 2, "data": 2, "tensor": 2}),
    ("ring", {"context": 4, "fsdp": 2}),
])
def test_training_losses_equal_one_device(one_device_curves, strategy, shape):
  curves = train_curves(_config(strategy=strategy, **shape), shape)
  assert_curves_close(curves, one_device_curves, rtol=1e-5)


def test_gradient_accumulation_on_the_unbalanced_layout_equals_one_device(one_device_curves):
  """Accumulation under context, on the plain (load_balance=False) layout: both change only how
  the work is split, never the losses."""
  config = _config(4, "ring", fsdp=2)
  config.train.grad_accum_steps = 2
  config.attention.load_balance = False
  curves = train_curves(config, {"context": 4, "fsdp": 2})
  assert_curves_close(curves, one_device_curves, rtol=1e-5)


@pytest.mark.parametrize("strategy,collective", [("ring", "collective-permute"),
                                                 ("all_gather", "all-gather")])
def test_compiled_step_has_the_strategys_collectives(strategy, collective):
  config = _config(4, strategy, fsdp=2)
  setup = train_setup.build(config, mesh_of({"context": 4, "fsdp": 2}))
  compiled, _, _ = compile_setup(setup, config)
  hlo = compiled.as_text()
  assert collective in hlo
  if strategy == "ring":
    # K, V and segment ids pass on at every step but the last, in the forward and backward.
    assert hlo.count("collective-permute-start") + hlo.count("collective-permute(") >= 3


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("overrides,words", [
    ({"seq_len": 60}, ["train.seq_len=60", "2*mesh.context = 8 chunks", "train.seq_len=56"]),
    ({"seq_len": 62, "load_balance": False}, ["train.seq_len=62", "mesh.context = 4 parts",
                                             "train.seq_len=60"]),
    ({"strategy": "ring", "context": 1}, ["attention.context_parallel='ring'",
                                          "mesh.context > 1"]),
    ({"strategy": "zigzag"}, ["attention.context_parallel='zigzag'", "all_gather, ring"]),
])
def test_bad_context_settings_are_one_line_errors(overrides, words):
  config = _config(overrides.get("context", 4), overrides.get("strategy", "all_gather"),
                   fsdp=-1)
  config.train.seq_len = overrides.get("seq_len", 64)
  config.attention.load_balance = overrides.get("load_balance", True)
  assert_one_line_config_error(config, 8, words)


# ------------------------------------------------------------------------------ the CLI

SMALL = ["--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.mlp_dim=128",
         "--config.model.num_heads=4", "--config.model.num_kv_heads=2",
         "--config.model.head_dim=16", "--config.train.seq_len=64",
         "--config.train.global_batch_size=8", "--config.train.eval_batches=2",
         "--config.train.steps=6", "--config.train.log_every=1", "--config.train.eval_every=6",
         "--config.optim.warmup_steps=2", "--config.optim.decay_steps=6",
         "--config.checkpoint.every_steps=3"]


def _cli(workdir, *overrides, devices=None):
  """(stdout, logged losses and grad norms) of a CLI run in this process."""
  return cli_curves(workdir, "--config=configs/tiny.py", *SMALL, *overrides, devices=devices)


def _last(curves, n):
  return {key: values[-n:] for key, values in curves.items()}


def _first(curves, n):
  return {key: values[:n] for key, values in curves.items()}


CONTEXT_RING = ["--config.mesh.context=4", "--config.mesh.fsdp=2", "--config.mesh.data=1",
                "--config.mesh.tensor=1", "--config.attention.context_parallel=ring"]


@pytest.mark.slow
def test_cli_ring_run_logs_one_device_losses_and_its_checkpoint_moves_across_meshes(tmp_path):
  _, one = _cli(tmp_path / "one")
  assert len(one["loss"]) == len(one["grad_norm"]) == 6
  # Steps 1-3 under context=4, saved at step 3; resumed on one device without context.
  out, ring = _cli(tmp_path / "ring", *CONTEXT_RING, "--config.train.steps=3", devices=8)
  assert "context=4" in out and "ring" in out
  assert_curves_close(ring, _first(one, 3), rtol=1e-5)
  out, after = _cli(tmp_path / "ring")
  assert "resumed from step 3" in out
  assert_curves_close(_last(after, 3), _last(one, 3), rtol=1e-5)
  # And back: the one-device run's step-3 checkpoint, steps 4-6 under context=4.
  shutil.copytree(tmp_path / "one", tmp_path / "back")
  shutil.rmtree(tmp_path / "back" / "checkpoints" / "6")
  out, after = _cli(tmp_path / "back", *CONTEXT_RING, devices=8)
  assert "resumed from step 3" in out
  assert_curves_close(_last(after, 3), _last(one, 3), rtol=1e-5)


def test_cli_bad_sequence_length_exits_2_with_one_line(tmp_path):
  proc = run_cli("--config=configs/tiny.py", f"--workdir={tmp_path}", *CONTEXT_RING,
                 "--config.train.seq_len=100", devices=8)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "train.seq_len=100" in lines[0] and "train.seq_len=96" in lines[0]
