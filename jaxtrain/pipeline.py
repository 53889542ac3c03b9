"""Pipeline parallelism: layers split into stages over a `stage` mesh axis, microbatches flowing
through them in one SPMD program (the schedule; the trainer's use of it is to come).

Every stage runs at once on its own microbatch, as one `vmap` over a leading stage dim that is
sharded over the `stage` mesh axis; after each iteration the activations shift one stage on
(`jnp.roll` along that dim, which XLA compiles to a collective-permute over `stage`). With S
stages and M microbatches the scan has M + S - 1 iterations, of which each stage idles S - 1:
the bubble, (S-1)/(M+S-1) of the time.

Circular (interleaved) schedule, R repeats: the L layers are cut into R·S groups of L/(R·S);
stage s holds groups s, S+s, 2S+s, ... and each microbatch goes around the S stages R times,
running group r·S+s on stage s in its r-th pass. The scan then has M·R + S - 1 iterations and
the bubble shrinks to (S-1)/(R·M+S-1). A microbatch leaving the last stage waits in a buffer of
M slots until stage 0 is free for its next pass, which needs M >= S.

Shapes: per-microbatch arrays carry a leading M dim (x_M..., also positions and segment ids,
which travel with their microbatch); stage parameters a leading [S, R, L/(R·S)] (see
`to_stages`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxtrain.mesh import axis_size

AXIS = "stage"


def stage_count(mesh=None) -> int:
  """The size of the `stage` axis of `mesh` (default: the current abstract mesh); 1 without."""
  return axis_size(AXIS, mesh)


def resolve_microbatches(configured: int, stages: int) -> int:
  """`pipeline.microbatches`, with 0 meaning one per stage (the fewest that fill them)."""
  return configured or stages


def iterations(stages: int, microbatches: int, repeats: int = 1) -> int:
  """Scan length of the schedule: every microbatch's R passes, plus the pipeline's fill."""
  return microbatches * repeats + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The share of stage-iterations spent idle: (S-1) / (R·M + S - 1)."""
  return (stages - 1) / iterations(stages, microbatches, repeats)


def check_schedule(num_layers: int, stages: int, microbatches: int, repeats: int = 1) -> None:
  """ValueError (one line) for a schedule that cannot run."""
  if num_layers % (stages * repeats):
    raise ValueError(f"{num_layers} layers do not split into stages*repeats = "
                     f"{stages}*{repeats} = {stages * repeats} equal groups")
  if microbatches % stages:
    raise ValueError(f"{microbatches} microbatches are not a multiple of the {stages} stages")


def to_stages(layers: Any, stages: int, repeats: int = 1) -> Any:
  """Stacked layer params [L, ...] (the model's order) -> [S, R, L/(R·S), ...]: entry [s, r] is
  layer group r·S + s, the layers stage s runs in pass r."""
  def split(x):
    per = x.shape[0] // (stages * repeats)
    return x.reshape(repeats, stages, per, *x.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(split, layers)


def from_stages(stage_layers: Any) -> Any:
  """The inverse of `to_stages`: [S, R, L/(R·S), ...] -> [L, ...] in the model's order."""
  def merge(x):
    return x.swapaxes(0, 1).reshape(-1, *x.shape[3:])
  return jax.tree.map(merge, stage_layers)


def _constrain_stages(x):
  """Leading dim over the `stage` mesh axis (the rest left to propagation); a no-op without a
  mesh that has it."""
  if stage_count() == 1:
    return x
  spec = jax.sharding.PartitionSpec(AXIS, *([jax.sharding.PartitionSpec.UNCONSTRAINED]
                                            * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, spec)


def pipeline(stage_fn: Callable, stage_layers: Any, x_M: jax.Array, carried_M: Any = None, *,
             repeats: int = 1) -> jax.Array:
  """Runs every microbatch of `x_M` through all layers, stage by stage; returns the outputs in
  microbatch order, shaped like `x_M`.

  `stage_fn(layers, x, carried) -> x` applies one stage's group of layers ([L/(R·S), ...]
  params) to one microbatch; `carried_M` (a pytree of [M, ...] arrays, e.g. positions and
  segment ids) is what the microbatch brings along, unchanged. `stage_layers` is
  `to_stages(layers, S, repeats)`.
  """
  stages = jax.tree.leaves(stage_layers)[0].shape[0]
  microbatches = x_M.shape[0]
  if microbatches < stages:
    raise ValueError(f"{microbatches} microbatches cannot fill {stages} stages")
  total = microbatches * repeats
  stage_ids = jnp.arange(stages)
  carried_M = {} if carried_M is None else carried_M

  def step(carry, i):
    buffer_M, outputs_S = carry
    # Which microbatch and pass each stage has now (stage s is s iterations behind stage 0).
    k_S = i - stage_ids
    active_S = (k_S >= 0) & (k_S < total)
    m_S = jnp.mod(k_S, microbatches)
    r_S = jnp.clip(k_S // microbatches, 0, repeats - 1)
    # Stage 0 takes its microbatch from the buffer (the input, or its previous pass's output);
    # every other stage takes what the stage before it produced last iteration.
    shifted_S = jnp.roll(outputs_S, 1, axis=0)
    inputs_S = shifted_S.at[0].set(buffer_M[jnp.mod(i, microbatches)])
    inputs_S = _constrain_stages(inputs_S)
    carried_S = jax.tree.map(lambda c: c[m_S], carried_M)
    layers_S = jax.tree.map(
        lambda p: jax.vmap(lambda ps, r: jax.lax.dynamic_index_in_dim(ps, r, 0, False))(p, r_S),
        stage_layers)
    new_S = jax.vmap(stage_fn)(layers_S, inputs_S, carried_S)
    # Idle stages (filling or draining) keep zeros: nothing they compute is ever read.
    new_S = jnp.where(active_S.reshape((-1,) + (1,) * (new_S.ndim - 1)), new_S, 0)
    new_S = _constrain_stages(new_S)
    # The last stage's output goes back to the buffer slot of its microbatch.
    last = stages - 1
    slot = m_S[last]
    write = active_S[last]
    buffer_M = buffer_M.at[slot].set(jnp.where(write, new_S[last], buffer_M[slot]))
    return (buffer_M, new_S), None

  outputs_S = _constrain_stages(jnp.zeros((stages,) + x_M.shape[1:], x_M.dtype))
  (buffer_M, _), _ = jax.lax.scan(step, (x_M, outputs_S),
                                  jnp.arange(iterations(stages, microbatches, repeats)))
  return buffer_M
