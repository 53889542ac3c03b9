"""Per-step host overhead of the train step: our pure-state `jax.jit` vs graph-mode `nnx.jit`.

A model so small that compute is negligible makes the step time mostly Python and dispatch
overhead. Prints one table; the last line is `step_overhead: jax_jit_ms=X nnx_jit_ms=Y ratio=R`.

  python benchmarks/step_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtrain.config import default_config
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.decoder import Decoder
from jaxtrain.ops.cross_entropy import chunked_cross_entropy
from jaxtrain.parallel.mesh import LOGICAL_RULES, make_mesh
from jaxtrain.train import setup as train_setup, loop as trainer


def tiny_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 64, 2, 32, 2, 2
  m.head_dim, m.mlp_dim, m.remat_policy = 16, 64, "none"
  c.train.seq_len, c.train.global_batch_size, c.train.loss_chunk_size = 8, 1, 8
  c.optim.warmup_steps = 1
  return c


def batch_of(c):
  t = c.train.seq_len
  tokens = np.arange(t + 1, dtype=np.int32)[None] % c.model.vocab_size
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "loss_mask": np.ones((1, t), np.float32), "segment_ids": np.ones((1, t), np.int32),
          "positions": np.arange(t, dtype=np.int32)[None]}


def time_steps(step_fn, steps: int) -> float:
  """Median ms per step over `steps` calls, each blocked on (so overhead is not hidden)."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(step_fn())
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times[steps // 10:]))


def ours(c, steps: int) -> float:
  mesh = make_mesh(devices=jax.devices()[:1])
  setup = train_setup.build(c, mesh)
  holder = {"state": train_setup.init_state(setup, 0)}
  batch = trainer.to_global_batch(batch_of(c), mesh)

  def step():
    holder["state"], metrics = setup.train_step(holder["state"], batch)
    return metrics

  with jax.set_mesh(mesh):
    step()
    return time_steps(step, steps)


def graph_mode(c, steps: int) -> float:
  cfg = ModelConfig.from_config(c)
  mesh = make_mesh(devices=jax.devices()[:1])
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    b = {k: jnp.asarray(v) for k, v in batch_of(c).items()}

    @nnx.jit
    def train_step(model, opt, batch):
      def loss_fn(model):
        x = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
        total, count = chunked_cross_entropy(x, model.head_weights(), batch["targets"],
                                             batch["loss_mask"], 8)
        return total / count
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      opt.update(model, grads)
      return loss

    train_step(model, opt, b)
    return time_steps(lambda: train_step(model, opt, b), steps)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args()
  c = tiny_config()
  ours_ms = ours(c, args.steps)
  graph_ms = graph_mode(c, args.steps)
  print(f"{'train step':<34} {'ms/step (median)':>16}")
  print(f"{'pure-state jax.jit (jaxtrain)':<34} {ours_ms:>16.2f}")
  print(f"{'graph-mode nnx.jit + nnx.Optimizer':<34} {graph_ms:>16.2f}")
  print(f"step_overhead: jax_jit_ms={ours_ms:.2f} nnx_jit_ms={graph_ms:.2f} "
        f"ratio={graph_ms / ours_ms:.1f}")


if __name__ == "__main__":
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()  # CPU only where there is no accelerator
  main()
