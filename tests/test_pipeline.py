"""The pipeline schedule on 8 CPU devices: outputs and gradients equal running every layer in
order, for plain and circular schedules; distinct microbatches; the scan length; the
collective-permutes over `stage`; the layer order of `to_stages`."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxtrain.parallel import pipeline as pp
from tests.dry_run_helpers import run_dry_run
from tests.helpers import (assert_curves_close, assert_one_line_config_error, cli_curves,
                           dpo_pair_batch, lora_config, mesh_of, small_config,
                           train_curves)

D, L = 16, 8


def _layer(w, b, x, pos):
  return jnp.tanh(x @ w + b + 0.01 * pos[..., None])


def _stage_fn(layers, x, carried):
  def body(x, wb):
    return _layer(*wb, x, carried["positions"]), None
  return jax.lax.scan(body, x, (layers["w"], layers["b"]))[0]


def _sequential(layers, x_M, pos_M):
  """Every microbatch through all L layers in the model's order: the reference."""
  def one(x, pos):
    for l in range(L):
      x = _layer(layers["w"][l], layers["b"][l], x, pos)
    return x
  return jax.vmap(one)(x_M, pos_M)


def _inputs(microbatches):
  rng = np.random.default_rng(0)
  layers = {"w": jnp.asarray(rng.normal(size=(L, D, D)) / np.sqrt(D), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(L, D)) * 0.1, jnp.float32)}
  # Every microbatch distinct, so a schedule that mixes them up shows.
  x_M = jnp.asarray(rng.normal(size=(microbatches, 2, 3, D)), jnp.float32)
  pos_M = jnp.asarray(rng.integers(0, 50, size=(microbatches, 2, 3)), jnp.int32)
  return layers, x_M, pos_M


def _mesh(stages):
  return jax.make_mesh((stages, 8 // stages), ("stage", "data"),
                       axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 4, 1), (2, 4, 2), (4, 8, 1),
                                                         (4, 4, 2), (1, 2, 1)])
def test_pipeline_equals_the_layers_in_order_with_gradients(stages, microbatches, repeats):
  layers, x_M, pos_M = _inputs(microbatches)
  mesh = _mesh(stages)

  def piped(layers, x_M):
    stage_layers = pp.to_stages(layers, stages, repeats)
    stage_layers = jax.tree.map(
        lambda p: jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P("stage"))),
        stage_layers)
    return pp.pipeline(_stage_fn, stage_layers, x_M, {"positions": pos_M}, repeats=repeats)

  def loss(fn):
    return lambda layers, x_M: jnp.sum(jnp.sin(fn(layers, x_M)))

  # The reference jitted too (eagerly, each of its operations would compile on its own).
  want = jax.jit(_sequential)(layers, x_M, pos_M)
  want_grads = jax.jit(jax.grad(loss(lambda p, x: _sequential(p, x, pos_M)), argnums=(0, 1)))(
      layers, x_M)
  with jax.set_mesh(mesh):
    got = jax.jit(piped)(layers, x_M)
    grads = jax.jit(jax.grad(loss(piped), argnums=(0, 1)))(layers, x_M)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_scan_length_is_m_times_r_plus_s_minus_1():
  layers, x_M, pos_M = _inputs(4)
  jaxpr = jax.make_jaxpr(lambda l, x: pp.pipeline(_stage_fn, pp.to_stages(l, 2, 2), x,
                                                  {"positions": pos_M}, repeats=2))(layers, x_M)
  # The fill (S-1 iterations, before the last stage's first output), then the rest (M·R).
  lengths = [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert lengths == [2 - 1, 4 * 2] and sum(lengths) == pp.iterations(2, 4, 2) == 4 * 2 + 2 - 1


def test_compiled_pipeline_passes_activations_with_collective_permutes():
  layers, x_M, pos_M = _inputs(4)
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    stage_layers = jax.device_put(pp.to_stages(layers, 2, 1), NamedSharding(mesh, P("stage")))
    hlo = jax.jit(lambda l, x: pp.pipeline(_stage_fn, l, x, {"positions": pos_M})).lower(
        stage_layers, x_M).compile().as_text()
  assert "collective-permute" in hlo


def test_to_stages_gives_stage_s_pass_r_the_group_r_times_s_plus_s():
  layers = {"w": jnp.arange(12)}
  staged = pp.to_stages(layers, stages=2, repeats=3)["w"]  # 6 groups of 2 layers
  assert staged.shape == (2, 3, 2)
  assert staged[1, 2].tolist() == [10, 11]  # group 2*2+1 = 5
  assert staged[0, 1].tolist() == [4, 5]  # group 1*2+0 = 2
  np.testing.assert_array_equal(pp.from_stages({"w": staged})["w"], layers["w"])


def test_bubble_and_bad_schedules():
  assert pp.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pp.bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)
  with pytest.raises(ValueError, match="8 layers do not split into stages\\*repeats = 3\\*1"):
    pp.check_schedule(8, 3, 6)
  with pytest.raises(ValueError, match="6 microbatches are not a multiple of the 4 stages"):
    pp.check_schedule(8, 4, 6)


# ------------------------------------------------------------------------------ in the trainer


def _config(**settings):
  c = small_config()
  c.model.num_layers = 4
  for key, value in settings.items():
    group = (c.pipeline if key in ("microbatches", "repeats", "gather_weights_once") else
             c.train if key == "grad_accum_steps" else c.mesh)
    group[key] = value
  return c


@pytest.fixture(scope="module")
def one_device_curves():
  """Losses and grad norms of 3 steps on one device: what every pipelined mesh must follow."""
  return train_curves(_config(), (1, 1, 1))


@pytest.mark.slow
@pytest.mark.parametrize("shape,schedule", [
    ({"stage": 2, "data": 2, "fsdp": 2}, {"microbatches": 4}),
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {"microbatches": 4, "repeats": 2}),
    # Also: accumulation folded into the pipeline's microbatches, weights gathered once a step.
    ({"stage": 4, "fsdp": 2}, {"microbatches": 8, "grad_accum_steps": 2,
                               "gather_weights_once": True}),
])
def test_pipelined_training_losses_equal_one_device(one_device_curves, shape, schedule):
  curves = train_curves(_config(**shape, **schedule), shape)
  assert_curves_close(curves, one_device_curves, rtol=1e-5)


@pytest.mark.slow
def test_dpo_with_lora_adapters_under_stages_equals_one_device():
  """Adapters train, the frozen base (the DPO reference) runs through the same pipeline, and the
  chosen and rejected rows travel in the microbatches: per-step losses and grad norms equal one
  device's."""
  from jaxtrain.train import loop as trainer  # pylint: disable=import-outside-toplevel
  from jaxtrain.train import setup as train_setup  # pylint: disable=import-outside-toplevel

  def curves(shape, microbatches):
    config = lora_config(objective="dpo")
    config.train.seq_len, config.pipeline.microbatches = 32, microbatches
    for axis, size in shape.items():
      config.mesh[axis] = size
    setup = train_setup.build(config, mesh_of(shape))
    state, out = train_setup.init_state(setup, seed=0), {"loss": [], "grad_norm": []}
    with jax.set_mesh(setup.mesh):
      for step in range(3):
        batch = trainer.to_global_batch(dpo_pair_batch(seed=step), setup.mesh)
        state, metrics = setup.train_step(state, batch)
        for key, values in out.items():
          values.append(float(metrics[key]))
    return out
  one = curves({"fsdp": 1}, 0)
  piped = curves({"stage": 2, "fsdp": 2, "tensor": 2}, 4)
  assert one["loss"][-1] < one["loss"][0]  # the adapters learn: the steps are not all log 2
  assert_curves_close(piped, one, rtol=1e-5)


@pytest.mark.slow
def test_fsdp_gathers_each_weight_once_per_step_with_gather_weights_once():
  """Counted in the compiled circular step (M=4, R=2: 9 iterations of 1-layer groups), loops by
  their trip counts. By default each of a layer's 7 fsdp-sharded weights is gathered per
  iteration and pass (forward, and the backward pass's recompute); gathered once, fewer than
  two gathers per weight remain. Either way the 9 stacked leaves move to the circular order
  with one all-to-all each per step, never per iteration."""
  from jaxtrain.train.hlo_flops import executed_ops  # pylint: disable=import-outside-toplevel
  from jaxtrain.train.measure import compile_step  # pylint: disable=import-outside-toplevel
  gathers, all_to_alls = {}, {}
  for once in (False, True):
    config = _config(stage=2, fsdp=4, microbatches=4, repeats=2, gather_weights_once=once)
    config.train.global_batch_size = 16
    hlo = compile_step(config, jax.devices())[0].as_text()
    gathers[once], all_to_alls[once] = (executed_ops(hlo, "all-gather"),
                                        executed_ops(hlo, "all-to-all"))
  weights = 7
  assert gathers[False] >= weights * pp.iterations(2, 4, 2) * 2, gathers
  assert gathers[True] < weights * 2, gathers
  assert all_to_alls == {False: 9, True: 9}, all_to_alls


@pytest.mark.parametrize("settings,words", [
    ({"stage": 3, "fsdp": 1, "microbatches": 3}, ["model.num_layers=4", "mesh.stage*pipeline"
                                                  ".repeats=3*1=3"]),
    ({"stage": 2, "fsdp": 4, "microbatches": 3}, ["pipeline.microbatches=3", "multiple of "
                                                  "mesh.stage=2"]),
    ({"stage": 2, "fsdp": 4, "microbatches": 4}, ["train.global_batch_size=8",
                                                  "*pipeline.microbatches=1*4*4=16"]),
    ({"stage": 2, "fsdp": 2, "microbatches": 2, "grad_accum_steps": 4},
     ["pipeline.microbatches=2", "train.grad_accum_steps=4", "use 4"]),
    ({"stage": 2, "fsdp": 2, "repeats": 4}, ["model.num_layers=4", "2*4=8"]),
])
def test_bad_pipeline_settings_are_one_line_errors(settings, words):
  config = _config(**settings)
  assert_one_line_config_error(config, config.mesh.stage * config.mesh.fsdp, words)


# ------------------------------------------------------------------------------ the CLI

# configs/tiny.py's 4 layers (2 stages x 2 groups) and batch of 16 (the schedule's line below),
# narrower and on shorter rows: the same schedule, a quarter of the work.
SMALL = ["--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=4",
         "--config.optim.warmup_steps=2", "--config.optim.decay_steps=200",
         "--config.train.eval_batches=2", "--config.model.d_model=64",
         "--config.model.mlp_dim=128", "--config.model.head_dim=16",
         "--config.train.seq_len=64"]
PIPELINED = ["--config.mesh.stage=2", "--config.mesh.data=2", "--config.mesh.fsdp=2",
             "--config.mesh.tensor=1", "--config.pipeline.microbatches=4"]


def _cli_curves(workdir, *args, devices=None):
  """(stdout, logged losses and grad norms) of a CLI run in this process."""
  return cli_curves(workdir, "--config=configs/tiny.py", *SMALL, *args, devices=devices)


def _last(curves, n):
  return {key: values[-n:] for key, values in curves.items()}


def _first(curves, n):
  return {key: values[:n] for key, values in curves.items()}


@pytest.mark.slow
def test_cli_circular_run_logs_one_device_losses_and_checkpoints_cross_meshes(tmp_path):
  """The circular schedule from the command line (the plain one trains the same mesh in
  test_pipelined_training_losses_equal_one_device); its checkpoint resumes on one device, and a
  one-device checkpoint resumes under stages: the stored layer order is the model's."""
  every_2 = "--config.checkpoint.every_steps=2"
  circular = [*PIPELINED, "--config.pipeline.repeats=2"]
  _, one = _cli_curves(tmp_path / "one", every_2)
  assert len(one["loss"]) == len(one["grad_norm"]) == 4
  out, first = _cli_curves(tmp_path / "piped", *circular, every_2, "--config.train.steps=2",
                           devices=8)
  assert ("2 stages × 2 layers each (in 2 groups), 4 microbatches of 1 seq per device (grad "
          "accum within them), bubble 11.1%") in out, out
  assert_curves_close(first, _first(one, 2), rtol=1e-5)
  out, resumed = _cli_curves(tmp_path / "piped", every_2)
  assert "resumed from step 2" in out
  assert_curves_close(_last(resumed, 2), _last(one, 2), rtol=1e-5)
  # Back: the one-device run's step-2 checkpoint, continued under stages.
  shutil.copytree(tmp_path / "one", tmp_path / "back")
  shutil.rmtree(tmp_path / "back" / "checkpoints" / "4")
  out, back = _cli_curves(tmp_path / "back", *circular, every_2, devices=8)
  assert "resumed from step 2" in out
  assert_curves_close(_last(back, 2), _last(one, 2), rtol=1e-5)


@pytest.mark.slow
def test_llama70b_with_four_stages_compiles_for_h100x64():
  from jaxtrain import hardware as targets  # pylint: disable=import-outside-toplevel
  missing = targets.compiler_missing(targets.parse("h100x64"))
  if missing:
    pytest.skip(missing)
  proc = run_dry_run("--config=configs/llama70b.py", "--config.mesh.stage=4",
                     "--config.pipeline.microbatches=16", "--dry_run_target=h100x64").cli
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "stage=4 fsdp=16" in proc.stdout
  assert proc.stdout.strip().splitlines()[-1].startswith(
      "dry_run: target=h100x64 compiler=gpu devices=64")


@pytest.mark.parametrize("by_name,saved", [(False, 0), (True, 6)])
def test_remat_by_name_saves_the_projections_under_the_stage_vmap(capsys, by_name, saved):
  """Each stage has its own weights, so the stage vmap batches both operands of every projection
  and `minimal`'s shape test ("no batch dims") matches none; by checkpoint name it still saves the
  q/k/v/o/gate/up outputs (down's is the layer's output, kept as the next layer's input)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.remat import remat_policy  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.sharding import create_model  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig.of(vocab_size=53, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_dim=64, max_position_embeddings=64)
  graphdef, layers = nnx.split(create_model(cfg, mesh_of((1, 1, 1))).layers)
  x_SBTD = jnp.ones((2, 2, 16, 32))
  pos_SBT = jnp.broadcast_to(jnp.arange(16), (2, 2, 16))
  policy = remat_policy("minimal", by_name=by_name)

  def stages(layers, x_SBTD):
    def layer(state, x, pos):
      return nnx.merge(graphdef, state)(x, pos, None)[0]  # (x, router statistics)
    return jnp.sum(jax.vmap(jax.checkpoint(layer, policy=policy))(layers, x_SBTD, pos_SBT))
  jax.ad_checkpoint.print_saved_residuals(stages, layers, x_SBTD)
  printed = capsys.readouterr().out
  names = ["query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up"]
  assert sum(f"named '{n}'" in printed for n in names) == saved, printed
  assert "output of dot_general" not in printed, printed
