"""Cost of checkpointing on the training loop's critical path.

For a config's full train state (params + AdamW moments): how long `save` blocks the caller
when asynchronous (the loop continues while files are written) versus a synchronous save of the
same state, and how long a restore takes. Prints one table; the last line is
`checkpoint: async_block_s=X sync_s=Y restore_s=Z` (for the largest model measured).

  python benchmarks/checkpoint.py [--sizes tiny,100m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np

from jaxtrain import data
from jaxtrain.checkpointing.checkpointer import Checkpointer, abstract_like
from jaxtrain.config import load_config_file
from jaxtrain.parallel.mesh import make_mesh
from jaxtrain.train import setup as train_setup
from jaxtrain.train.metrics import count_params


def config_for(size: str):
  c = load_config_file("configs/tiny.py")
  if size == "100m":  # ~100M parameters: 12 layers of width 768, byte vocab
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 12, 768, 12, 4
    m.head_dim, m.mlp_dim = 64, 3072
  c.train.seq_len, c.train.global_batch_size = 64, 2
  return c


def measure(size: str, repeats: int) -> tuple[int, float, float, float, float]:
  """(params, bytes, async block s, sync s, restore s), medians over `repeats` saves."""
  c = config_for(size)
  mesh = make_mesh(devices=jax.devices()[:1])
  setup = train_setup.build(c, mesh)
  state = train_setup.init_state(setup, 0)
  it = data.make_train_iterator(c)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  with tempfile.TemporaryDirectory() as root:
    results = {}
    for mode in ("async", "sync"):
      ckpt = Checkpointer(f"{root}/{mode}", every_steps=1, max_to_keep=2,
                          async_save=mode == "async")
      ckpt.save(0, state, it, {"step": 0})  # the first save also sets up the manager
      ckpt.wait()
      times = []
      for step in range(1, repeats + 1):
        start = time.perf_counter()
        ckpt.save(step, state, it, {"step": step})
        times.append(time.perf_counter() - start)  # time the loop is blocked
        ckpt.wait()
      results[mode] = float(np.median(times))
      if mode == "sync":
        with jax.set_mesh(mesh):
          shapes = jax.eval_shape(setup.init_fn, jax.random.key(0))
        abstract = abstract_like(shapes, setup.shardings)
        restore_times = []
        for _ in range(repeats):
          start = time.perf_counter()
          restored, _ = ckpt.restore(repeats, abstract, data.make_train_iterator(c))
          jax.block_until_ready(restored)
          restore_times.append(time.perf_counter() - start)
        results["restore"] = float(np.median(restore_times))
      ckpt.close()
  return (count_params(setup.model_cfg.arch), nbytes, results["async"], results["sync"],
          results["restore"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="tiny,100m")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  rows = [(size, *measure(size, args.repeats)) for size in args.sizes.split(",")]
  print(f"{'config':<8} {'params':>12} {'state MB':>9} {'async block s':>14} {'sync save s':>12} "
        f"{'async/sync':>11} {'restore s':>10}")
  for size, params, nbytes, async_s, sync_s, restore_s in rows:
    print(f"{size:<8} {params:>12,} {nbytes / 1e6:>9.1f} {async_s:>14.3f} {sync_s:>12.3f} "
          f"{async_s / sync_s:>11.1%} {restore_s:>10.3f}")
  _, _, _, async_s, sync_s, restore_s = rows[-1]
  print(f"checkpoint: async_block_s={async_s:.3f} sync_s={sync_s:.3f} restore_s={restore_s:.3f}")


if __name__ == "__main__":
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()  # CPU only where there is no accelerator
  main()
