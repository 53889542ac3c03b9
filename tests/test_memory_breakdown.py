"""The buffers live at the memory peak (dryrun/breakdown.py), and the per-layer weight cast
(weight_cast.py) that keeps a bfloat16 copy of the stacked weights out of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import hardware as targets
from jaxtrain.ops import weight_cast
from jaxtrain.train import memory_breakdown as breakdown, measure
from tests.helpers import small_config


def test_the_peak_lists_the_largest_live_temporary_with_its_source(tmp_path):
  def step(x):
    y = jnp.exp(x @ x.T)  # [512, 512] f32, live until the sort below is done with it
    return (jnp.sort(y, axis=0) * y).sum()

  x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
  compiled = jax.jit(step).lower(x).compile(breakdown.compile_options(str(tmp_path)))
  found = breakdown.read(str(tmp_path), module="jit_step")
  assert found is not None
  assert found.temp_bytes == compiled.memory_analysis().temp_size_in_bytes
  largest = found.temporaries()[0]
  assert largest.shape == "f32[512,512]" and largest.size == 512 * 512 * 4
  assert largest.source, largest  # named after the JAX operation that made it
  argument = [b for b in found.buffers if b.kind == "argument"]
  assert [b.shape for b in argument] == ["f32[512,64]"]
  assert found.peak_bytes >= largest.size + argument[0].size


def test_nothing_is_read_where_the_compiler_wrote_nothing(tmp_path):
  assert breakdown.read(str(tmp_path)) is None


def test_sources_read_as_passes_and_argument_paths():
  assert breakdown.describe_source(
      "jit(train_step)/transpose(jvp())/while/body/dot_general") == "backward/while/body/dot_general"
  assert breakdown.describe_source(
      "convert of state.params['layers']['mlp']['w_up_DF'].value") == \
      "convert of params.layers.mlp.w_up_DF"
  assert breakdown.describe_source("") == "(made by the compiler)"


def test_the_weight_cast_is_astype_bit_for_bit_and_differentiates_like_it():
  rng = np.random.default_rng(0)
  finite = rng.standard_normal(20_000).astype(np.float32) * np.float32(10.0) ** rng.integers(
      -44, 38, 20_000).astype(np.float32)
  # Exact ties (round to even), the largest finite values (round up to infinity), subnormals,
  # infinities, zeros and NaNs with payloads of both signs.
  ties = ((np.arange(1, 2 ** 16, 97, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
  special = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000,
                      0, 0x80000000, 0x7F800001, 0xFFC00123, 0x7FFFFFFF], np.uint32).view(np.float32)
  x = np.concatenate([finite, ties, special])
  ours = jax.jit(lambda v: weight_cast.to_compute_dtype(v, jnp.bfloat16))(x)
  theirs = jax.jit(lambda v: v.astype(jnp.bfloat16))(x)
  assert ours.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(ours).view(np.uint16),
                                np.asarray(theirs).view(np.uint16))
  w = x[:64].reshape(8, 8)
  loss = lambda cast: lambda v: (cast(v).astype(jnp.float32) ** 2).sum()
  np.testing.assert_array_equal(
      jax.grad(loss(lambda v: weight_cast.to_compute_dtype(v, jnp.bfloat16)))(w),
      jax.grad(loss(lambda v: v.astype(jnp.bfloat16)))(w))
  # Other dtype pairs are astype itself.
  halved = w.astype(jnp.bfloat16)
  assert weight_cast.to_compute_dtype(w, jnp.float32).dtype == jnp.float32
  np.testing.assert_array_equal(weight_cast.to_compute_dtype(halved, jnp.float32),
                                halved.astype(jnp.float32))


def _bf16_weight_stacks_at_peak(monkeypatch, cast):
  """bfloat16 copies of whole [L, ...] layer weights among the peak's temporaries of a small
  model's step, compiled by libtpu for v5p-8 with `cast` as the weights' cast."""
  target = targets.parse("v5p-8")
  if targets.compiler_missing(target):
    pytest.skip(targets.compiler_missing(target))
  monkeypatch.setattr("jaxtrain.ops.projection.to_compute_dtype", cast)
  # Weights large enough for libtpu to make the copies (at D=64 it does not).
  config = small_config(remat_policy="full", d_model=256, mlp_dim=1024, head_dim=32)
  config.mesh.fsdp, config.train.global_batch_size = 4, 4
  m = measure.measure(config, targets.devices(target), with_breakdown=True)
  assert m.breakdown is not None and m.temp == m.breakdown.temp_bytes
  return [b for b in m.breakdown.temporaries()
          if b.shape.startswith("bf16[2,")
          and "params.layers" in breakdown.describe_source(b.source)]


def test_stacked_weights_are_cast_per_layer_not_copied_whole(monkeypatch):
  # With a plain astype, libtpu's bfloat16 propagation makes one bfloat16 copy of each whole
  # [L, ...] weight before the layer loops, live through the step; the per-layer cast does not.
  hoisted = _bf16_weight_stacks_at_peak(monkeypatch, lambda w, dtype: w.astype(dtype))
  assert len(hoisted) >= 3, hoisted  # at least the MLP's three
  assert _bf16_weight_stacks_at_peak(monkeypatch, weight_cast.to_compute_dtype) == []
