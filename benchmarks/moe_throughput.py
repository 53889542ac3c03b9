"""Throughput of a Mixture-of-Experts layer on this host: dropless grouped matmul against
computing every expert densely, and the capacity mode.

One MoE feed-forward block (router, experts, routing weights; models/moe.py) forward and
backward on a batch of tokens, jitted, on one device:

  dropless (blocked)   the default on CPU and GPU: assignments sorted by expert, a loop of
                       GEMMs over expert-aligned blocks of rows (jaxtrain/ops/grouped_matmul.py)
  dropless (ragged)    jax.lax.ragged_dot (the TPU's grouped kernel; XLA:CPU expands it into
                       every expert's product, masked)
  dense                every expert on every token, the outputs combined with the routing
                       weights (zero for experts a token did not choose): the baseline an MoE
                       implementation must beat
  capacity 1.25        each expert takes at most 1.25x its even share, batched matmuls

Shapes: moe_tiny's layer (D=128, 4 experts of F=192, top 2) on its batch of 16 x 256 tokens,
and a wider one (8 and 32 experts, top 2) where dense computing wastes more. Prints a table
(tokens per second, forward + backward, median of the timed repeats) and last
`moe_throughput: dropless_tokens_per_sec=N dense_tokens_per_sec=N` (moe_tiny's shape).

  python benchmarks/moe_throughput.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models.moe import Routing, moe_layer, route

SHAPES = {  # name: (tokens, D, experts, F, top-k)
    "moe_tiny": (16 * 256, 128, 4, 192, 2),
    "8 experts": (16 * 256, 128, 8, 192, 2),
    "32 experts": (16 * 256, 128, 32, 96, 2),
}


def _inputs(tokens, d, x, f, seed=0):
  rng = np.random.default_rng(seed)
  def normal(*shape, std=0.1):
    return jnp.asarray(rng.normal(size=shape) * std, jnp.float32)
  return (normal(1, tokens, d, std=1.0), normal(d, x), {
      "gate": normal(x, d, f), "up": normal(x, d, f), "down": normal(x, f, d)})


def dense_moe(x_BTD, router_DX, experts, top_k):
  """Every expert on every token, combined with the top-k routing weights (others 0)."""
  x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
  logits_NX = x_ND @ router_DX
  routing = Routing(num_experts=router_DX.shape[1], top_k=top_k, norm_topk_prob=True,
                    capacity_factor=0.0, activation="silu", matmul_impl="blocked",
                    dtype="float32")
  _, weights_NK, experts_NK = route(logits_NX, routing)
  full_NX = jnp.zeros_like(logits_NX).at[jnp.arange(x_ND.shape[0])[:, None], experts_NK].set(
      weights_NK)
  h_XNF = (jax.nn.silu(jnp.einsum("ND,XDF->XNF", x_ND, experts["gate"]))
           * jnp.einsum("ND,XDF->XNF", x_ND, experts["up"]))
  y_XND = jnp.einsum("XNF,XFD->XND", h_XNF, experts["down"])
  return jnp.einsum("XND,NX->ND", y_XND, full_NX).reshape(x_BTD.shape)


def _step(kind: str, top_k: int, num_experts: int):
  def loss(x, router, experts):
    if kind == "dense":
      return jnp.sum(dense_moe(x, router, experts, top_k) ** 2)
    impl, cf = {"dropless (blocked)": ("blocked", 0.0), "dropless (ragged)": ("ragged", 0.0),
                "capacity 1.25": ("blocked", 1.25)}[kind]
    routing = Routing(num_experts=num_experts, top_k=top_k, norm_topk_prob=True,
                      capacity_factor=cf, activation="silu", matmul_impl=impl,
                      dtype="float32")
    out, stats, _ = moe_layer(x, jnp.ones(x.shape[:2], bool), {"weight": router}, experts,
                              routing)
    return jnp.sum(out ** 2) + stats["aux_loss"]
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def tokens_per_sec(kind: str, shape, seconds: float) -> float:
  tokens, d, x, f, k = shape
  args = _inputs(tokens, d, x, f)
  step = _step(kind, k, x)
  jax.block_until_ready(step(*args))  # compile and warm up
  times, start = [], time.perf_counter()
  while time.perf_counter() - start < seconds or len(times) < 3:
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t0)
  return tokens / statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per row")
  args = parser.parse_args()
  kinds = ("dropless (blocked)", "dropless (ragged)", "dense", "capacity 1.25")
  print(f"MoE layer forward + backward on {jax.devices()[0].device_kind} "
        f"({jax.device_count()} device(s)), float32; tokens/s (median)")
  print(f"{'shape':<12} {'tokens':>6} {'D':>4} {'X':>3} {'F':>4} {'k':>2}  "
        + "  ".join(f"{k:>18}" for k in kinds) + "  dropless/dense")
  results = {}
  for name, shape in SHAPES.items():
    row = {kind: tokens_per_sec(kind, shape, args.seconds) for kind in kinds}
    results[name] = row
    tokens, d, x, f, k = shape
    print(f"{name:<12} {tokens:>6} {d:>4} {x:>3} {f:>4} {k:>2}  "
          + "  ".join(f"{row[kind]:>18,.0f}" for kind in kinds)
          + f"  {row['dropless (blocked)'] / row['dense']:>14.2f}")
  tiny = results["moe_tiny"]
  print(f"moe_throughput: dropless_tokens_per_sec={tiny['dropless (blocked)']:.0f} "
        f"dense_tokens_per_sec={tiny['dense']:.0f}")


if __name__ == "__main__":
  main()
