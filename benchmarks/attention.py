"""Attention forward+backward on GPU: our Pallas kernel vs cuDNN vs the XLA reference.

Causal self-attention in bfloat16, E = 128, Llama-3-8B heads (H = 32 query heads over K = 8 kv
heads), batch sized so each row of the table holds 16k tokens. Times the jitted
`vjp(attention)(q, k, v)` with a random cotangent (forward + backward), median of `--iters`
runs after warm-up, and reports achieved TFLOP/s with the usual flash-attention convention:
forward 4·B·H·T²·E / 2 (the causal half of two matmuls), backward 2.5 × forward (five matmuls
where the forward has two), so forward+backward = 3.5 × forward. An implementation that runs
out of memory (the XLA reference materializes [B, H, T, T] scores) is reported as OOM.

Before timing, each implementation's output and gradients are checked against the XLA
reference in float32 at a small size (`--check` only does that).

  python benchmarks/attention.py [--seq_lens 2048 4096 8192] [--iters 20] [--check]

The last line is `attention: pallas_over_cudnn=R` (the pallas/cudnn time ratio at the longest
length; below 1 means the Pallas kernel is faster).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.ops import attention as attention_lib

HEADS, KV_HEADS, HEAD_DIM, TOKENS_PER_ROW = 32, 8, 128, 16384
IMPLS = ("pallas", "cudnn", "xla")


def _inputs(b, t, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(k[0], (b, t, HEADS, HEAD_DIM), dtype)
  kk = jax.random.normal(k[1], (b, t, KV_HEADS, HEAD_DIM), dtype)
  v = jax.random.normal(k[2], (b, t, KV_HEADS, HEAD_DIM), dtype)
  do = jax.random.normal(k[3], (b, t, HEADS, HEAD_DIM), dtype)
  return q, kk, v, do


def _fwd_bwd(impl):
  def run(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: attention_lib.attention(q, k, v, impl=impl), q, k, v)
    return out, vjp(do)
  return jax.jit(run)


def check(impls) -> dict[str, float]:
  """Max abs error of output and dq/dk/dv vs the float32 XLA reference (bf16 inputs)."""
  q, k, v, do = _inputs(2, 1024, jnp.bfloat16, seed=1)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want_out, want_grads = _fwd_bwd("xla")(*f32)
  errors = {}
  for impl in impls:
    out, grads = _fwd_bwd(impl)(q, k, v, do)
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
              for a, b in zip((out, *grads), (want_out, *want_grads)))
    scale = max(float(jnp.max(jnp.abs(b))) for b in (want_out, *want_grads))
    errors[impl] = err / scale
    print(f"check {impl:6s}: max abs error of out/dq/dk/dv vs float32 xla = {err:.3e} "
          f"({err / scale:.2e} of the largest value)", flush=True)
  return errors


def time_impl(impl, t, iters) -> float | None:
  """Median seconds of one forward+backward; None when it does not fit in memory."""
  b = max(1, TOKENS_PER_ROW // t)
  q, k, v, do = _inputs(b, t, jnp.bfloat16)
  fn = _fwd_bwd(impl)
  try:
    jax.block_until_ready(fn(q, k, v, do))
    jax.block_until_ready(fn(q, k, v, do))
    times = []
    for _ in range(iters):
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v, do))
      times.append(time.perf_counter() - start)
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
      return None
    raise
  return float(np.median(times))


def flops(t) -> float:
  b = max(1, TOKENS_PER_ROW // t)
  forward = 4 * b * HEADS * t * t * HEAD_DIM / 2
  return 3.5 * forward


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq_lens", type=int, nargs="+", default=[2048, 4096, 8192])
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--check", action="store_true", help="only check correctness")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    print(f"benchmarks/attention.py times GPU kernels; this backend is "
          f"{jax.default_backend()!r}. Install jaxtrain[cuda12] on a GPU machine (the CPU "
          f"tests check the kernel in interpret mode: tests/test_flash_attention.py).",
          file=sys.stderr)
    return 2
  print(f"device: {jax.devices()[0].device_kind}; H={HEADS} K={KV_HEADS} E={HEAD_DIM} bf16 "
        f"causal, {TOKENS_PER_ROW} tokens per row", flush=True)
  errors = check(IMPLS[:2])
  if args.check:
    return 0 if all(e < 2e-2 for e in errors.values()) else 1
  print(f"{'T':>6} {'B':>3} | " + " | ".join(f"{i + ' ms':>10} {'TFLOP/s':>8}" for i in IMPLS))
  ratio = None
  for t in args.seq_lens:
    row = {impl: time_impl(impl, t, args.iters) for impl in IMPLS}
    cells = [(f"{1e3 * s:10.2f} {flops(t) / s / 1e12:8.1f}" if s else f"{'OOM':>10} {'-':>8}")
             for s in (row[i] for i in IMPLS)]
    print(f"{t:6d} {max(1, TOKENS_PER_ROW // t):3d} | " + " | ".join(cells), flush=True)
    if row["pallas"] and row["cudnn"]:
      ratio = row["pallas"] / row["cudnn"]
  print(f"attention: pallas_over_cudnn={ratio:.3f}" if ratio is not None
        else "attention: pallas_over_cudnn=nan")
  return 0


if __name__ == "__main__":
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()  # CPU only where there is no accelerator
  sys.exit(main())
