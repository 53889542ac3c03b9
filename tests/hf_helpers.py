"""What the Hugging Face interop tests share: the committed fixtures, and a model's float32 logits
against the ones transformers computed for a fixture."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LOGIT_TOL = 1e-4


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, ids_BT):
  return nnx.merge(graphdef, params)(ids_BT)


def max_logit_error(model, path, what):
  """Max abs difference between `model`'s logits (highest matmul precision) on fixture `path`'s
  input ids and the logits transformers computed; at most LOGIT_TOL. Printed, and returned."""
  ids, want = (np.load(os.path.join(path, f)) for f in ("input_ids.npy", "logits.npy"))
  with jax.default_matmul_precision("highest"):
    got = np.asarray(_forward(*nnx.split(model), jnp.asarray(ids)))
  assert got.dtype == np.float32 and got.shape == want.shape
  err = float(np.abs(got - want).max())
  print(f"{what}: max abs logit error {err:.3e}")
  assert err <= LOGIT_TOL, f"{what}: max abs logit error {err:.3e} > {LOGIT_TOL}"
  return err
