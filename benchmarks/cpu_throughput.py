"""CPU training throughput and MFU of two fixed model shapes, plus compile time vs depth.

Trains in float32 on one CPU device with synthetic tokens, through the trainer's own build()
(the same jitted train step, optimizer and fused cross-entropy as `python -m jaxtrain.main`):

  S: d_model 256, 4 layers, 4 heads of 64, MLP 1024, vocab 32000, untied head (20.6M params)
  M: d_model 512, 8 layers, 8 heads of 64, MLP 2048, vocab 32000, untied head (66.3M params)
  both: sequence length 256, global batch 4 (1024 tokens per step)

MFU = tokens/s * model FLOPs per token / the float32 matmul peak measured in this run: the best
of timed 2048^3 matmuls on all cores (`metrics.measure_cpu_matmul_peak`), measured before and
again after the training runs, the larger taken (this machine is shared and noisy; the larger
peak gives the lower, conservative MFU). Model FLOPs per token are
those of `metrics.flops_per_token`: 6 * N_matmul + 6 * L * T * H * E, where N_matmul counts the
weights used in matmuls (all layer projections and the output head, not the embedding lookup)
and the second term is causal attention (QK^T and AV, forward + backward). Recomputation and
elementwise work are not model FLOPs.

Compile time is measured for the M shape at 4 and 32 layers, with scan over layers on and off
(lowering + XLA compilation of the train step; the scan column should stay flat in depth).

  python benchmarks/cpu_throughput.py [--steps 8] [--skip_compile]

Last line: `cpu_throughput: mfu=X tokens_per_sec=Y compile_ratio_32_vs_4=Z` (mfu and tokens/s of
M; the compile ratio of the scanned 32-layer vs 4-layer step).
"""

from __future__ import annotations

import argparse
import os
import time

# One CPU device: XLA:CPU then runs each op on the host's intra-op thread pool (all cores).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

from jaxtrain import host_memory, platforms  # pylint: disable=wrong-import-position

if __name__ == "__main__":
  # As `python -m jaxtrain.main` does: the CPU backend only where there is no accelerator, and
  # a restart with huge pages for glibc's large blocks.
  platforms.choose_jax_platforms()
  host_memory.reexec_with_hugepages()

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from jaxtrain.config import default_config  # pylint: disable=wrong-import-position
from jaxtrain.parallel.mesh import make_mesh  # pylint: disable=wrong-import-position
from jaxtrain.train import metrics as metrics_lib  # pylint: disable=wrong-import-position
from jaxtrain.train import setup as train_setup, loop as trainer  # pylint: disable=wrong-import-position
from jaxtrain.train.step import batch_shardings  # pylint: disable=wrong-import-position

SHAPES = {  # name: (d_model, layers, heads, mlp)
    "S": (256, 4, 4, 1024),
    "M": (512, 8, 8, 2048),
}
SEQ_LEN, BATCH, VOCAB, HEAD_DIM = 256, 4, 32000, 64


def shape_config(d_model: int, layers: int, heads: int, mlp: int, *, scan: bool = True):
  c = default_config()
  m = c.model
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = VOCAB, layers, d_model, mlp
  m.num_heads = m.num_kv_heads = heads
  m.head_dim, m.tie_embeddings, m.scan_layers = HEAD_DIM, False, scan
  m.param_dtype = m.dtype = "float32"
  # Activations of these shapes fit easily in host memory: no recomputation (remat costs FLOPs
  # that MFU does not count).
  m.remat_policy = "none"
  m.max_position_embeddings = SEQ_LEN
  c.train.seq_len, c.train.global_batch_size = SEQ_LEN, BATCH
  c.train.loss_chunk_size = SEQ_LEN
  c.optim.warmup_steps = 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  return c


def synthetic_batch(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (BATCH, SEQ_LEN + 1), dtype=np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "loss_mask": np.ones((BATCH, SEQ_LEN), np.float32),
          "segment_ids": np.ones((BATCH, SEQ_LEN), np.int32),
          "positions": np.broadcast_to(np.arange(SEQ_LEN, dtype=np.int32), (BATCH, SEQ_LEN))}


def _setup(config):
  mesh = make_mesh(devices=jax.devices()[:1])
  return mesh, train_setup.build(config, mesh)


def train_throughput(config, steps: int) -> dict[str, float]:
  """Median step time over `steps` timed steps after two warm-up steps (compile excluded)."""
  mesh, setup = _setup(config)
  with jax.set_mesh(mesh):
    state = train_setup.init_state(setup, seed=0)
    batches = [trainer.to_global_batch(synthetic_batch(i), mesh) for i in range(4)]
    for i in range(2):
      state, out = setup.train_step(state, batches[i])
    jax.block_until_ready(out)
    times = []
    for i in range(steps):
      start = time.perf_counter()
      state, out = setup.train_step(state, batches[i % len(batches)])
      jax.block_until_ready(out)
      times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  return {"step_s": step_s, "tokens_per_sec": BATCH * SEQ_LEN / step_s,
          "loss": float(out["loss"])}


def compile_seconds(config) -> float:
  """Wall time of lowering + compiling the train step for abstract inputs (nothing runs)."""
  mesh, setup = _setup(config)
  with jax.set_mesh(mesh):
    state_shapes = jax.eval_shape(setup.init_fn, jax.random.key(0))
    state_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            state_shapes, setup.shardings)
    batch_in = {k: jax.ShapeDtypeStruct((BATCH, SEQ_LEN), v.dtype, sharding=batch_shardings(mesh)[k])
                for k, v in synthetic_batch(0).items()}
    start = time.perf_counter()
    setup.train_step.lower(state_in, batch_in).compile()
    return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=8, help="timed steps per shape")
  parser.add_argument("--skip_compile", action="store_true", help="skip the compile-time table")
  args = parser.parse_args()

  peak_before = metrics_lib.measure_cpu_matmul_peak.__wrapped__()
  print(f"host: {os.cpu_count()} CPUs, jax {jax.__version__}, host memory: "
        f"{host_memory.describe()}; float32 matmul peak measured "
        f"before training: {peak_before / 1e9:.1f} GFLOP/s", flush=True)
  results = {}
  for name, dims in SHAPES.items():
    config = shape_config(*dims)
    _, setup = _setup(config)
    n_params = metrics_lib.count_params(setup.model_cfg.arch)
    flops_token = metrics_lib.flops_per_token(setup.model_cfg.arch, SEQ_LEN)
    r = train_throughput(config, args.steps)
    r.update(n_params=n_params, flops_token=flops_token,
             achieved=r["tokens_per_sec"] * flops_token)
    results[name] = r
  peak_after = metrics_lib.measure_cpu_matmul_peak.__wrapped__()
  peak = max(peak_before, peak_after)
  print(f"float32 matmul peak measured after training: {peak_after / 1e9:.1f} GFLOP/s; MFU uses "
        f"the larger, {peak / 1e9:.1f} GFLOP/s", flush=True)
  print(f"{'shape':<6} {'params':>8} {'GFLOP/token':>12} {'step s':>8} {'tokens/s':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6}", flush=True)
  for name, r in results.items():
    r["mfu"] = r["achieved"] / peak
    print(f"{name:<6} {r['n_params'] / 1e6:7.1f}M {r['flops_token'] / 1e9:12.4f} "
          f"{r['step_s']:8.3f} {r['tokens_per_sec']:9.0f} {r['achieved'] / 1e12:8.4f} "
          f"{r['mfu']:6.1%}", flush=True)

  ratio = float("nan")
  if not args.skip_compile:
    d, _, h, f = SHAPES["M"]
    print(f"\ncompile time of the M train step (s): {'layers':>6} {'scan':>7} {'unrolled':>9}",
          flush=True)
    times = {}
    for layers in (4, 32):
      times[layers] = {scan: compile_seconds(shape_config(d, layers, h, f, scan=scan))
                       for scan in (True, False)}
      print(f"{'':38}{layers:>6} {times[layers][True]:7.1f} {times[layers][False]:9.1f}",
            flush=True)
    ratio = times[32][True] / times[4][True]
  m = results["M"]
  print(f"cpu_throughput: mfu={m['mfu']:.3f} tokens_per_sec={m['tokens_per_sec']:.0f} "
        f"compile_ratio_32_vs_4={ratio:.2f}")


if __name__ == "__main__":
  main()
