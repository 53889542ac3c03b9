"""Pipeline parallelism: layers split into stages over a `stage` mesh axis, microbatches flowing
through them in one SPMD program (the schedule; `layer_stack.run_layers` runs a model's layers
with it under a mesh with stages).

Every stage runs at once on its own microbatch, as one `vmap` over a leading stage dim that is
sharded over the `stage` mesh axis; after each iteration the activations shift one stage on
(`jnp.roll` along that dim, which XLA compiles to a collective-permute over `stage`). With S
stages and M microbatches the scan has M + S - 1 iterations, of which each stage idles S - 1:
the bubble, (S-1)/(M+S-1) of the time.

Circular (interleaved) schedule, R repeats: the L layers are cut into R·S groups of L/(R·S);
stage s holds groups s, S+s, 2S+s, ... and each microbatch goes around the S stages R times,
running group r·S+s on stage s in its r-th pass. The scan then has M·R + S - 1 iterations and
the bubble shrinks to (S-1)/(R·M+S-1). A microbatch leaving the last stage waits in a queue of
M slots until stage 0 is free for its next pass, which needs M >= S.

Memory: under `remat` the backward pass keeps each iteration's stage inputs (one microbatch per
stage, M·R+S-1 iterations) and recomputes one iteration at a time, so a stage holds its layers'
saved activations for one microbatch, not for all M as plain autodiff through the scan would
(GPipe). The queue of the M microbatches (and its cotangent) is the other cost that grows with M.

Shapes: per-microbatch arrays carry a leading M dim (x_M..., also positions and segment ids,
which travel with their microbatch); stage parameters a leading [S, R, L/(R·S)] (see
`to_stages`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxtrain.parallel.mesh import axis_size, logical_to_spec

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


def describe(stages: int, num_layers: int, microbatches: int, repeats: int,
             rows_per_device: float) -> str:
  """The run table's and the dry run's `pipeline` row: "4 stages × 20 layers each, 16
  microbatches of 2 seq per device, bubble 15.8%"."""
  groups = f" (in {repeats} groups)" if repeats > 1 else ""
  return (f"{stages} stages × {num_layers // stages} layers each{groups}, {microbatches} "
          f"microbatches of {rows_per_device / microbatches:g} seq per device (grad accum within "
          f"them), bubble {100 * bubble_fraction(stages, microbatches, repeats):.1f}%")


def check_schedule(num_layers: int, stages: int, microbatches: int, repeats: int = 1) -> None:
  """ValueError (one line) for a schedule that cannot run."""
  if num_layers % (stages * repeats):
    raise ValueError(f"{num_layers} layers do not split into stages*repeats = "
                     f"{stages}*{repeats} = {stages * repeats} equal groups")
  if microbatches % stages:
    raise ValueError(f"{microbatches} microbatches are not a multiple of the {stages} stages")


def to_stages(layers: Any, stages: int, repeats: int = 1, spec=None) -> Any:
  """Stacked layer params [L, ...] (the model's order) -> [S, R, L/(R·S), ...]: entry [s, r] is
  layer group r·S + s, the layers stage s runs in pass r.

  `spec`: the PartitionSpec of every leaf's [L, ...] (its lead the `stage` axis), or None. With
  it, the gradient's way back to [L, ...] is constrained step by step (see `_split_bwd`)."""
  if spec is None:
    return jax.tree.map(lambda x: _split(x, stages, repeats), layers)
  return jax.tree.map(lambda x: _split_constrained(x, stages, repeats, spec), layers)


def _split(x, stages: int, repeats: int):
  per = x.shape[0] // (stages * repeats)
  return x.reshape(repeats, stages, per, *x.shape[1:]).swapaxes(0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _split_constrained(x, stages, repeats, spec):
  return _split(x, stages, repeats)


def _split_fwd(x, stages, repeats, spec):
  return _split(x, stages, repeats), None


def _split_bwd(stages, repeats, spec, _, ct_SR):
  """[S, R, ...] -> [L, ...] with the stage axis moved from S to R (each stage's share of the
  layers in the model's order) by one explicit reshard of [R, S, ...]: an all-to-all per leaf.
  Left to autodiff's transpose, the move is at the reshape, where XLA may instead gather the
  whole leaf over `stage` ("involuntary full rematerialization", jax 0.12)."""
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  lead, rest = spec[:1], tuple(spec[1:])
  ct_RS = jax.lax.with_sharding_constraint(ct_SR, P(*lead, None, None, *rest)).swapaxes(0, 1)
  ct_RS = jax.lax.with_sharding_constraint(ct_RS, P(None, *lead, None, *rest))
  ct_RS = jax.lax.with_sharding_constraint(ct_RS, P(*lead, None, None, *rest))
  return (ct_RS.reshape(-1, *ct_RS.shape[3:]),)


_split_constrained.defvjp(_split_fwd, _split_bwd)


def from_stages(stage_layers: Any) -> Any:
  """The inverse of `to_stages`: [S, R, L/(R·S), ...] -> [L, ...] in the model's order."""
  def merge(x):
    return x.swapaxes(0, 1).reshape(-1, *x.shape[3:])
  return jax.tree.map(merge, stage_layers)


def _constrain(x, lead: str | None, names: Sequence[str | None] | None):
  """[lead, *microbatch dims]: the leading dim over mesh axis `lead` (None: whole), the rest by
  their logical `names` (None: left to propagation); a no-op without stages. Without these
  constraints XLA may gather the microbatches' batch dim onto every device."""
  if stage_count() == 1:
    return x
  rest = (logical_to_spec(names) if names is not None
          else [jax.sharding.PartitionSpec.UNCONSTRAINED] * (x.ndim - 1))
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(lead, *rest))


def _constrain_one(x, names: Sequence[str | None] | None):
  """One microbatch by its logical `names` (None: left to propagation); a no-op without stages.
  Between the queue and the stage dim: unconstrained, the stage axis may spread from a stage's
  slice into the queue's microbatch dim, which then is gathered every iteration."""
  if stage_count() == 1 or names is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names))


@jax.custom_vjp
def _pick_groups(p_SR, r_S):
  """p_SR[s, r_S[s]] for every stage s: [S, R, ...] -> [S, ...], each stage its pass's group."""
  if p_SR.shape[1] == 1:
    return p_SR[:, 0]
  return jax.vmap(lambda p, r: jax.lax.dynamic_index_in_dim(p, r, 0, False))(p_SR, r_S)


def _pick_groups_fwd(p_SR, r_S):
  return _pick_groups(p_SR, r_S), (r_S, jnp.zeros((0,) + p_SR.shape[1:], p_SR.dtype))


def _pick_groups_bwd(residuals, ct_S):
  """The cotangent into the picked group by a one-hot product (local to each stage's devices):
  autodiff's own transpose, a scatter with per-stage offsets, becomes all-to-alls over `stage`
  in every iteration of the backward pass (9 per iteration on the tiny model)."""
  r_S, like = residuals
  onehot_SR = jax.nn.one_hot(r_S, like.shape[1], dtype=ct_S.dtype)
  onehot_SR = onehot_SR.reshape(onehot_SR.shape + (1,) * (ct_S.ndim - 1))
  # Each stage's part stays on its devices (left to propagation, XLA gathered it over `stage`).
  return _constrain(onehot_SR * _constrain(ct_S, AXIS, None)[:, None], AXIS, None), None


_pick_groups.defvjp(_pick_groups_fwd, _pick_groups_bwd)


def pipeline(stage_fn: Callable, stage_layers: Any, x_M: jax.Array, carried_M: Any = None, *,
             repeats: int = 1, remat: bool = False,
             names: Sequence[str | None] | None = None) -> jax.Array:
  """Runs every microbatch of `x_M` through all layers, stage by stage; returns the outputs in
  microbatch order, shaped like `x_M`.

  `stage_fn(layers, x, carried) -> x` applies one stage's group of layers ([L/(R·S), ...]
  params) to one microbatch; `carried_M` (a pytree of [M, ...] arrays, e.g. positions and
  segment ids) is what the microbatch brings along, unchanged. `stage_layers` is
  `to_stages(layers, S, repeats)`. `names`: the logical axis names of one microbatch's dims
  (e.g. ("act_batch", "act_length", "act_embed")), which keep it sharded as the model's
  activations are.

  `remat`: the backward pass keeps only each iteration's stage inputs ([S, microbatch...], M·R+S-1
  of them) and recomputes the iteration from them; `stage_fn`'s own remat policy then decides
  what that recompute keeps. Without it, autodiff keeps everything `stage_fn` saves for every
  microbatch at once (GPipe's memory: the whole batch's activations of a stage's layers).
  """
  stages = jax.tree.leaves(stage_layers)[0].shape[0]
  microbatches = x_M.shape[0]
  if microbatches < stages:
    raise ValueError(f"{microbatches} microbatches cannot fill {stages} stages")
  total = microbatches * repeats
  stage_ids = jnp.arange(stages)
  carried_M = {} if carried_M is None else carried_M

  def run_stages(stage_layers, r_S, active_S, inputs_S, carried_S):
    # The pass's group is picked inside, from the loop-invariant `stage_layers`: picked outside,
    # each iteration's pick would be a residual of its own (a copy of the weights per iteration).
    layers_S = jax.tree.map(lambda p: _pick_groups(p, r_S), stage_layers)
    # spmd_axis_name: the model's sharding constraints inside a stage keep the stage dim on
    # `stage` (left unconstrained, propagation may pick otherwise).
    new_S = jax.vmap(stage_fn, spmd_axis_name=AXIS if stage_count() > 1 else None)(
        layers_S, inputs_S, carried_S)
    # Idle stages (filling or draining) give zeros: what they compute is never read, and zeros
    # keep it finite. Masked in here, so remat keeps the [S] flags rather than a full-size mask.
    return jnp.where(active_S.reshape((-1,) + (1,) * (new_S.ndim - 1)), new_S, 0)
  if remat:
    run_stages = jax.checkpoint(run_stages, policy=jax.checkpoint_policies.nothing_saveable,
                                prevent_cse=False)  # inside a scan CSE cannot undo the remat

  last = stages - 1

  def step(carry, i, write: bool):
    queue_M, outputs_S = carry
    # Which microbatch and pass each stage has now (stage s is s iterations behind stage 0).
    k_S = i - stage_ids
    active_S = (k_S >= 0) & (k_S < total)
    m_S = jnp.mod(k_S, microbatches)
    r_S = jnp.clip(k_S // microbatches, 0, repeats - 1)
    # Stage 0 takes the head of the queue (microbatch i mod M: the input, or its previous pass's
    # output); every other stage takes what the stage before it produced last iteration.
    head = _constrain_one(queue_M[0], names)
    inputs_S = _constrain(jnp.roll(outputs_S, 1, axis=0).at[0].set(head), AXIS, names)
    carried_S = jax.tree.map(lambda c: c[m_S], carried_M)
    new_S = _constrain(run_stages(stage_layers, r_S, active_S, inputs_S, carried_S), AXIS, names)
    # The queue turns by one. The last stage has just finished microbatch (i-S+1) mod M, whose
    # slot is now at M-S: a fixed place, so every queue operation has static indices (XLA
    # partitions those without gathering the queue). Before the last stage's first output
    # (`write` False) that slot still holds an input.
    queue_M = jnp.roll(queue_M, -1, axis=0)
    if write:
      queue_M = queue_M.at[microbatches - stages].set(_constrain_one(new_S[last], names))
    return (_constrain(queue_M, None, names), new_S), None

  # Microbatch m starts at slot m, so it is the head at iteration m.
  carry = (_constrain(x_M, None, names),
           _constrain(jnp.zeros((stages,) + x_M.shape[1:], x_M.dtype), AXIS, names))
  # Two scans, M·R + S - 1 iterations in all: the fill (S - 1), before the last stage's first
  # output, and the rest, in which the last stage finishes a microbatch every iteration.
  carry, _ = jax.lax.scan(functools.partial(step, write=False), carry, jnp.arange(last))
  (queue_M, _), _ = jax.lax.scan(functools.partial(step, write=True), carry,
                                 jnp.arange(last, iterations(stages, microbatches, repeats)))
  # After the last iteration microbatch m sits at slot (m - S + 1) mod M.
  return jnp.roll(queue_M, last, axis=0)
