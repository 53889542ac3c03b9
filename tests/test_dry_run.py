"""Dry run (AOT compile on abstract inputs), remat policies, optimizer-state dtype and offload."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import compat, config as config_lib
from jaxtrain.config import ConfigError
from jaxtrain.dryrun import command, suggestions
from jaxtrain.hardware import GIB, verdict
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.remat import remat_policy
from jaxtrain.models.sharding import abstract_model, init_params
from jaxtrain.objectives.forward import loss_sum_fn
from jaxtrain.ops.attention import xla_attention
from jaxtrain.ops.blockwise_attention import blockwise_attention
from jaxtrain.train import hlo_flops
from jaxtrain.train import measure as aot
from jaxtrain.train.loop import to_global_batch
from jaxtrain.train.optim import learning_rate_schedule, make_optimizer, weight_decay_mask
from jaxtrain.train.setup import build, init_state
from jaxtrain.validation import checks as config_checks
from jaxtrain.validation.checks import validate
from tests.dry_run_helpers import DRY_RUN_LAST_LINE as LAST_LINE
from tests.helpers import mesh_of, packed_batch, run_cli, run_main, small_config

# Memory sizes the verdicts are for: one nothing fits on (judged first), one everything small
# fits on.
TABLE = {"Tiny 1KiB": 2**-20 * GIB, "H100 80GB": 80 * GIB}


def _dry_config(fsdp=2):
  """Small model, remat 'full' and microbatch 1, so the suggestions need no extra compile."""
  c = small_config(remat_policy="full")
  c.mesh.fsdp = fsdp
  c.train.global_batch_size = fsdp
  return c


def _exact_param_bytes(config, mesh_shape):
  _, abstract, shardings = abstract_model(ModelConfig.from_config(config), mesh_of(mesh_shape))
  return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
             for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


@pytest.fixture(scope="module")
def fsdp2():
  """The command on 2 CPU devices modelling an unnamed accelerator (no target, as with
  --dry_run_devices=2), its verdicts for TABLE's memory sizes."""
  lines = []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(command, "memories_for", lambda target, config: dict(TABLE))
    result = command.run(_dry_config(2), jax.devices()[:2], None, "small", out=lines.append)
  return result, lines


def test_a_repeated_dry_run_is_measured_again_not_served_from_the_compilation_cache(fsdp2):
  """The suite runs with a persistent compilation cache (conftest.py), as a user may: the same
  dry run again compiles again, so its buffer assignment (the peak breakdown, and TPU's
  temporaries) is read from a fresh dump, not lost to a cached executable that writes none."""
  assert jax.config.jax_compilation_cache_dir
  first, _ = fsdp2
  # A compile of the same program without the dump (as check_configs and pre-flight compile)
  # puts its executable in the cache; the dry run's own compile must not take it.
  plain = aot.measure(_dry_config(2), jax.devices()[:2], "gpu")
  assert plain.breakdown is None and plain.temp == first.base.temp
  again = command.run(_dry_config(2), jax.devices()[:2], None, "small", out=lambda line: None)
  assert first.base.breakdown is not None and again.base.breakdown is not None
  assert again.base.breakdown.temp_bytes == first.base.breakdown.temp_bytes == again.base.temp
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # restored after


def test_last_line_is_machine_readable_and_params_are_exact(fsdp2):
  result, lines = fsdp2
  assert lines[-1] == result.last_line
  match = LAST_LINE.match(lines[-1])
  assert match, lines[-1]
  target, compiler, devices, params, opt, temp, total, fits = match.groups()
  assert (target, compiler, int(devices)) == ("none", "cpu", 2)
  assert fits == "no" and not result.fits  # judged against the first size, Tiny 1KiB
  exact = _exact_param_bytes(_dry_config(2), (1, 2, 1))
  assert result.base.params == exact
  assert float(params) == pytest.approx(exact / 2**30, rel=1e-5)
  assert float(opt) == pytest.approx(result.base.opt_device / 2**30, rel=1e-5)
  assert float(temp) > 0 and float(total) > float(params) + float(opt) + float(temp) * 0.999
  # Adam's two float32 moments (+ scalar step counts) are exactly twice the params.
  assert 2 * exact <= result.base.opt_device < 2 * exact + 64
  # The compiler's argument bytes agree with the exact ones (+ the 2 int32 state scalars).
  assert result.base.compiler_arguments == (result.base.params + result.base.opt_device
                                            + result.base.batch + 8)
  text = "\n".join(lines)
  assert "ESTIMATE for accelerators" in text
  assert "compute bfloat16" in text  # model.dtype="auto" modelled as on an accelerator
  assert "layers.mlp.w_up_DF" in text and "P('stage', ('fsdp', 'context', 'expert'), 'tensor')" in text


def test_the_report_lists_the_largest_temporaries_at_the_memory_peak(fsdp2):
  result, lines = fsdp2
  peak = result.base.breakdown
  assert peak is not None and peak.temp_bytes == result.base.temp  # XLA:CPU: the same figure
  start = next(i for i, line in enumerate(lines) if line.startswith("largest temporaries"))
  rows = lines[start + 1:start + 1 + min(command.PEAK_ROWS, len(peak.temporaries()))]
  largest = peak.temporaries()[0]
  assert largest.shape in rows[0] and largest.opcode in rows[0], rows
  # The layers' saved inputs are live at the peak: remat 'full' keeps one [B, T, D] per layer,
  # stacked by the scan over layers, in the bfloat16 compute dtype, each device its B / fsdp rows.
  c = _dry_config(2)
  saved = (f"bf16[{c.model.num_layers},{c.train.global_batch_size // c.mesh.fsdp},"
           f"{c.train.seq_len},{c.model.d_model}]")
  assert any(t.shape == saved for t in peak.temporaries()), [t.shape for t in peak.temporaries()]


def test_param_bytes_halve_when_fsdp_doubles(fsdp2):
  base2 = fsdp2[0].base
  base4 = aot.measure(_dry_config(4), jax.devices()[:4])
  assert base4.params == _exact_param_bytes(_dry_config(4), (1, 4, 1))
  # Everything but the tiny replicated norm scales halves.
  assert base2.params / base4.params == pytest.approx(2.0, rel=0.03)
  assert base4.temp > 0 and base4.flops > 0


def test_a_config_that_does_not_fit_gets_suggestions(fsdp2):
  result, lines = fsdp2
  assert verdict(TABLE["Tiny 1KiB"], result.base.total).status == "does not fit"
  assert verdict(TABLE["H100 80GB"], result.base.total).fits
  at = next(i for i, line in enumerate(lines) if line.startswith("verdict:"))
  tiny, h100 = lines[at + 1:at + 3]  # one line per memory size, in TABLE's order
  assert tiny.split()[:2] == ["Tiny", "1KiB"] and "does not fit" in tiny
  assert h100.split()[:2] == ["H100", "80GB"] and " fits " in h100
  labels = [o.label for o in result.options]
  assert "optim.state_dtype=bfloat16" in labels and "optim.offload_state=True" in labels
  assert any(label.startswith("--dry_run_devices=4") for label in labels)
  by_label = {o.label: o for o in result.options}
  saved = result.base.total - by_label["optim.offload_state=True"].total
  assert saved == result.base.opt_device
  text = "\n".join(lines)
  assert "suggestions:" in text and "Tiny 1KiB" in text.split("cheapest change")[1]


def _measurement(temp_gib):
  return aot.Measurement(
      num_devices=1, backend="cpu", platform="gpu", mesh=None, model_cfg=None, params=0,
      opt_device=0, opt_host=0, batch=0, temp=int(temp_gib * 2**30), outputs=0,
      compiler_arguments=0, flops=0.0, xla_flops=0.0, loops_without_trip_count=0, compile_s=0.0,
      param_shards=[], attention_note="")


def test_microbatch_suggestion_interpolates_between_compiles():
  """Memory is taken as linear in the microbatch between the two compiled points."""
  base, small = _measurement(17), _measurement(2)  # microbatch 16 and 1: 1 GiB per sequence
  table = {"A": 10 * GIB}  # 9 GiB usable: microbatch <= 8
  assert suggestions._largest_microbatch(base, small, 16, 1, table) == {"A": (8, 2)}


def test_remat_policy_names_are_validated():
  config = small_config(remat_policy="minimal_offlaod")
  with pytest.raises(ConfigError) as err:
    validate(config, 1)
  message = str(err.value)
  assert "model.remat_policy='minimal_offlaod'" in message and "minimal_offload" in message
  for name in config_lib.REMAT_POLICIES:  # every accepted name is a policy the model knows
    validate(small_config(remat_policy=name), 1)
    remat_policy(name)


def test_offload_needs_pinned_host_memory(monkeypatch):
  monkeypatch.setattr(config_checks, "host_memory_kinds", lambda platform: {"device"})
  for key, value in (("model.remat_policy", "save_dots_offload"), ("optim.offload_state", True)):
    config = small_config()
    group, name = key.split(".")
    config[group][name] = value
    with pytest.raises(ConfigError, match="no pinned_host memory"):
      validate(config, 1)


def test_optimizer_state_dtype():
  config = small_config()
  config.optim.warmup_steps = 0
  params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32),
            "final_norm": {"scale": jnp.ones(4)}}
  grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
  # float32 moments: the same numbers as optax.adamw.
  o = config.optim
  reference = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm),
                          optax.adamw(learning_rate_schedule(config), b1=o.b1, b2=o.b2, eps=o.eps,
                                      weight_decay=o.weight_decay, mask=weight_decay_mask))
  tx = make_optimizer(config)
  ours, _ = tx.update(grads, tx.init(params), params)
  theirs, _ = reference.update(grads, reference.init(params), params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), ours, theirs)
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(reference.init(params))
  # bfloat16 moments stay bfloat16 through updates; params and updates keep their dtype.
  config.optim.state_dtype = "bfloat16"
  tx = make_optimizer(config)
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)
  adam = state[1][0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(updates)} == {jnp.dtype(jnp.float32)}
  config.optim.state_dtype = "float16"
  with pytest.raises(ConfigError, match="optim.state_dtype='float16'"):
    validate(config, 1)


def test_compute_dtype_auto():
  assert config_lib.resolve_compute_dtype("auto", "cpu") == "float32"
  assert config_lib.resolve_compute_dtype("auto", "tpu") == "bfloat16"
  config = small_config()
  assert config.model.dtype == "auto"
  assert ModelConfig.from_config(config).runtime.dtype == "float32"  # this backend is the CPU
  assert ModelConfig.from_config(config, platform="gpu").runtime.dtype == "bfloat16"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_offload_on_cpu(optimizer):
  """XLA:CPU has pinned_host memory: the state lives there and training is unchanged (AdamW's
  moments; Muon's momentum beside the AdamW moments of its other weights)."""
  config = small_config()
  config.optim.name = optimizer
  mesh = mesh_of((1, 1, 1))
  plain = build(config, mesh)
  config.optim.offload_state = True
  offload = build(config, mesh)
  assert {s.memory_kind for s in jax.tree.leaves(offload.shardings.params)} == {"device"}
  state = init_state(plain, 0)
  batch = to_global_batch(packed_batch(8, 32, 128), mesh)
  with jax.set_mesh(mesh):
    # A second init (compiled once) rather than the same buffers: both steps donate their state.
    moved = jax.device_put(init_state(plain, 0), offload.shardings)
    want, want_metrics = plain.train_step(state, batch)
    got, got_metrics = offload.train_step(moved, batch)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(got.opt_state) if x.ndim}
  assert kinds == {"pinned_host"}
  assert float(got_metrics["loss"]) == float(want_metrics["loss"])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               (got.params, got.opt_state), (want.params, want.opt_state))
  # The dry run counts it as host memory, not device memory.
  measured = aot.measure(config, jax.devices()[:1])
  assert measured.opt_device < 64
  if optimizer == "adamw":
    assert measured.opt_host >= 2 * measured.params - 64
  else:  # one buffer for the matrices: more than the params, less than AdamW's two moments
    assert measured.params < measured.opt_host < measured.adamw_opt - measured.params / 2


def test_offload_remat_policies_give_the_same_grads():
  """On CPU the offload annotations compile and run; values equal the base policy's."""
  batch = packed_batch(4, 32, 128)
  mesh = mesh_of((1, 1, 1))
  _, params = init_params(ModelConfig.from_config(small_config()), mesh, seed=0)
  results = {}
  for policy in ("minimal", "minimal_offload", "save_dots_offload", "save_qkv_proj_offload"):
    graphdef, _, _ = abstract_model(ModelConfig.from_config(small_config(remat_policy=policy)),
                                    mesh)
    grad = jax.jit(jax.value_and_grad(
        lambda p, graphdef=graphdef: loss_sum_fn(p, graphdef, batch, 16)[0]))
    # XLA:CPU's own fusion emitters, as a user's run has them (the suite turns them off to
    # compile faster): with them the policies' gradients agree to this tolerance; the classic
    # emitters fuse each policy's recomputation differently and round a few elements apart.
    compiled = grad.lower(params).compile(compat.cpu_emitter_options(fusion_emitters=True))
    results[policy] = jax.tree.map(np.asarray, compiled(params))
  for result in results.values():
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), result,
                 results["minimal"])


@pytest.mark.parametrize("segments,block", [(False, 16), (True, 16), (True, 40), (True, 512)])
def test_blockwise_attention_matches_xla(segments, block):
  rng = np.random.default_rng(0)
  b, t, h, k, e = 2, 40, 4, 2, 8
  q = jnp.asarray(rng.normal(size=(b, t, h, e)), jnp.float32)
  kk = jnp.asarray(rng.normal(size=(b, t, k, e)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, t, k, e)), jnp.float32)
  seg = None
  if segments:
    seg = np.ones((b, t), np.int32)
    seg[0, 15:], seg[1, 30:] = 2, 0  # two documents; padding
    seg = jnp.asarray(seg)
  w = jnp.asarray(rng.normal(size=(b, t, h, e)), jnp.float32)

  def loss(fn):
    return lambda q, kk, v: jnp.sum(fn(q, kk, v, seg) * w)
  blockwise = lambda *x: blockwise_attention(*x, block=block)
  np.testing.assert_allclose(jax.jit(blockwise)(q, kk, v, seg), xla_attention(q, kk, v, seg),
                             atol=2e-6)
  got = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, kk, v)
  want = jax.jit(jax.grad(loss(xla_attention), argnums=(0, 1, 2)))(q, kk, v)
  for g, w_ in zip(got, want):
    np.testing.assert_allclose(g, w_, atol=5e-6)


def test_blockwise_attention_in_the_model_under_remat():
  """The dry run's stand-in for fused attention: same loss and grads as XLA attention under
  remat policies."""
  batch = packed_batch(2, 32, 128)
  mesh = mesh_of((1, 1, 1))
  base = ModelConfig.from_config(small_config())
  _, params = init_params(base, mesh, seed=0)
  results = []
  for impl, policy in (("xla", "minimal"), ("blockwise", "minimal"), ("blockwise", "save_dots")):
    graphdef, _, _ = abstract_model(
        base.replace(attention_impl=impl, remat_policy=policy), mesh)
    grad = jax.jit(jax.value_and_grad(
        lambda p, graphdef=graphdef: loss_sum_fn(p, graphdef, batch, 16)[0]))
    results.append(jax.tree.map(np.asarray, grad(params)))
  for result in results[1:]:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), result,
                 results[0])


def test_blockwise_attention_is_opaque_to_remat_policies(capsys):
  """Like a fused kernel, its inner matmuls are never saved, even by save_dots."""
  q, kv = jnp.ones((1, 64, 4, 8)), jnp.ones((1, 64, 2, 8))
  f = jax.checkpoint(lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, block=16)),
                     policy=jax.checkpoint_policies.dots_saveable)
  jax.ad_checkpoint.print_saved_residuals(f, q, kv, kv)
  saved = capsys.readouterr().out.strip().splitlines()
  assert len(saved) == 3 and all("from the argument" in line for line in saved), saved


def test_hlo_flops_count_every_loop_iteration():
  """XLA's cost_analysis counts a scan body once; hlo_flops multiplies by the trip count."""
  def f(w_LDD, x_BD):
    def body(x_BD, w_DD):
      return jnp.tanh(x_BD @ w_DD), None
    return jax.lax.scan(body, x_BD, w_LDD)[0]
  layers, b, d = 6, 16, 32
  compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((layers, d, d), jnp.float32),
                              jax.ShapeDtypeStruct((b, d), jnp.float32)).compile()
  counted = hlo_flops.count(compiled.as_text())
  assert counted.flops == layers * 2 * b * d * d
  assert counted.loops == 1 and counted.loops_without_trip_count == 0


def test_hlo_flops_count_only_the_window_taps_that_read_the_input():
  """libtpu writes a [T, D] x [D, H, E] projection as a convolution whose window spans the
  heads over a padded input of size 1 (one tap of H reads data), and a contraction over a dim
  as a window as wide as its input (every tap reads data)."""
  hlo = """HloModule m

ENTRY %main (x: bf16[16,8,1], w: bf16[4,8,8], y: bf16[16,4,8], v: bf16[4,8,8]) -> bf16[16,8,1] {
  %x = bf16[16,8,1]{2,1,0} parameter(0)
  %w = bf16[4,8,8]{2,1,0} parameter(1)
  %heads = bf16[16,4,8]{2,1,0} convolution(%x, %w), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
  %y = bf16[16,4,8]{2,1,0} parameter(2)
  %v = bf16[4,8,8]{2,1,0} parameter(3)
  ROOT %back = bf16[16,8,1]{2,1,0} convolution(%y, %v), window={size=4}, dim_labels=b0f_0io->bf0
}
"""
  t, d, h, e = 16, 8, 4, 8
  assert hlo_flops.count(hlo).flops == 2 * t * d * h * e + 2 * t * e * h * d


@pytest.mark.slow  # two interpreters: the command and the one it re-runs
def test_cli_reruns_itself_with_emulated_devices():
  """The real process (the point: a process's CPU device count is fixed when JAX starts, so the
  command re-runs itself with more)."""
  proc = run_main("--config=configs/tiny.py", "--dry_run", "--dry_run_devices=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  assert "re-running with 2 emulated CPU devices" in lines[0]
  match = LAST_LINE.match(lines[-1])
  assert match, lines[-1]
  assert (match["target"], match["compiler"], match["devices"]) == ("none", "cpu", "2")


def test_cli_config_error_is_one_line_exit_2():
  proc = run_cli("--config=configs/tiny.py", "--dry_run", "--dry_run_devices=2",
                 "--config.model.remat_policy=everything_offload")
  assert proc.returncode == 2
  assert proc.stderr.strip().startswith("config error: model.remat_policy='everything_offload'")
  assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_llama8b_on_8_devices():
  """The full-size path: llama8b at microbatch 1 with full remat, on 8 CPU devices (this
  process's 8, so no re-run)."""
  proc = run_cli("--config=configs/llama8b.py", "--dry_run", "--dry_run_devices=8",
                 "--config.train.grad_accum_steps=32", "--config.model.remat_policy=full",
                 devices=8)
  assert proc.returncode == 0, proc.stderr[-3000:]
  match = LAST_LINE.match(proc.stdout.strip().splitlines()[-1])
  assert match, proc.stdout[-3000:]
  assert (match["target"], match["compiler"], match["devices"]) == ("none", "cpu", "8")
  params_gib = float(match["params"])
  assert params_gib == pytest.approx(8.03e9 * 4 / 8 / 2**30, rel=0.01)
  assert float(match["opt"]) == pytest.approx(2 * params_gib, rel=0.001)
  assert "H100 80GB" in proc.stdout
