"""How a model's stack of layers runs: the one hook through which parallelism reaches the layers.

A model hands over its layers (stacked on a leading `layers` axis by `nnx.vmap`, or a list) and
what one layer needs besides its input; `run_layers` owns the rest:

- on one pipeline stage, the layers scanned (`nnx.scan`) or unrolled, each under remat with the
  model's policy;
- with a mesh `stage` axis > 1, the layers as pipeline stages (`pipeline.pipeline`): the batch
  cut into microbatches that flow through the stages, each layer under the policy chosen by
  checkpoint names (a stage's vmap gives every matmul a batch dim), each pipeline iteration
  under remat too.

Every layer is called as `layer(x_BTD, positions_BT, segment_ids_BT, **inputs)`, where `inputs`
holds this layer's row of each per-layer array the model hands over (a dropout key, the layer's
type), and returns `(x_BTD, stats)`: a dict of per-layer figures (an MoE layer's router
statistics; empty for a dense layer), which come back stacked on a leading layer axis. So a new
model family gets scanning, remat and pipelining without code of its own. The context layout
(context_parallel) applies to the sequence before the layers and needs nothing here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from jaxtrain.parallel import pipeline as pipeline_lib
from jaxtrain.parallel.mesh import gathered_spec, logical_to_spec


@dataclasses.dataclass(frozen=True)
class StackOptions:
  """How the stack runs (from the model config). `remat` off: every layer's activations are
  kept for the backward pass; on, each layer is rematerialized under `policy` (what it saves)."""
  scan_layers: bool
  remat: bool
  policy: Any  # jax.checkpoint policy of each layer, when `remat`
  stage_policy: Any  # the same choice by checkpoint names, for layers inside pipeline stages
  pipeline_microbatches: int = 0
  pipeline_repeats: int = 1
  pipeline_gather_weights_once: bool = False


def run_layers(layers, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT,
               layer_inputs: dict[str, Any], options: StackOptions):
  """(x_BTD through every layer, the layers' stats stacked [L, ...]); each array [L, ...] of
  `layer_inputs` goes one row per layer, as the keyword argument of its name."""
  stages = pipeline_lib.stage_count()
  if stages > 1:
    return _pipelined(layers, x_BTD, positions_BT, segment_ids_BT, layer_inputs, options,
                      stages), {}

  def layer_fn(layer, x_BTD, inputs):
    return layer(x_BTD, positions_BT, segment_ids_BT, **inputs)

  if options.remat:
    layer_fn = nnx.remat(layer_fn, policy=options.policy, prevent_cse=not options.scan_layers)
  if options.scan_layers:
    # The per-layer inputs are scanned over with the layers (none: nothing to scan).
    @nnx.scan(in_axes=(nnx.Carry, 0, 0 if layer_inputs else None), out_axes=(nnx.Carry, 0),
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def run_stack(x_BTD, layer, inputs):
      return layer_fn(layer, x_BTD, inputs)
    return run_stack(x_BTD, layers, layer_inputs)
  all_stats = []
  for i, layer in enumerate(layers):
    x_BTD, stats = layer_fn(layer, x_BTD, {name: a[i] for name, a in layer_inputs.items()})
    if stats:  # dense layers have none
      all_stats.append(stats)
  return x_BTD, jax.tree.map(lambda *rows: jax.numpy.stack(rows), *all_stats) if all_stats else {}


def _pipelined(layers, x_BTD, positions_BT, segment_ids_BT, layer_inputs,
               options: StackOptions, stages: int):
  """The layers as pipeline stages over the mesh's `stage` axis: the batch is cut into
  microbatches (strided, so each spans every data-parallel device), which flow through the
  stages; the result is the same as the plain scan's."""
  if not options.scan_layers:
    raise ValueError("pipeline stages need model.scan_layers=True (stacked layers)")
  m = pipeline_lib.resolve_microbatches(options.pipeline_microbatches, stages)
  b = x_BTD.shape[0]
  graphdef, state = nnx.split(layers)
  # Each layer under its policy by name (the stage vmap gives every matmul a batch dim), and
  # each pipeline iteration under remat (pipeline.py): the backward pass keeps every
  # iteration's stage inputs and recomputes one iteration at a time, so what the layer policy
  # saves is held for one microbatch, not all of them.

  def layer(x_BTD, layer_state, carried):
    block = nnx.merge(graphdef, layer_state)
    # Dense layers only (config_checks refuses MoE layers under stages): no stats to carry.
    return block(x_BTD, carried["positions"], carried["segment_ids"], **carried["inputs"])[0]
  if options.remat:
    layer = jax.checkpoint(layer, policy=options.stage_policy, prevent_cse=False)

  def stage_fn(stage_layers, x_BTD, carried):
    def body(x_BTD, xs):
      layer_state, inputs = xs
      return layer(x_BTD, layer_state, {**carried, "inputs": inputs}), None
    return jax.lax.scan(body, x_BTD, (stage_layers["state"], stage_layers["inputs"]))[0]

  def to_microbatches(x):  # [B, ...] -> [M, B/M, ...], microbatch i = rows i, i+M, ...
    return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)

  def stage_weight(v):
    # Each weight to the circular order with its own sharding (to_stages: the gradient's way
    # back an all-to-all, not a gather over `stage`).
    names = v.get_metadata().get("out_sharding")
    if names is None:
      return v.replace(pipeline_lib.to_stages(v[...], stages, options.pipeline_repeats))
    if options.pipeline_gather_weights_once:
      # Whole along fsdp/context here, outside the pipeline's loop: one gather per step (and
      # one reduce-scatter of the gradients) instead of one per microbatch and pass.
      spec = gathered_spec(names)
      value = jax.lax.with_sharding_constraint(v[...], spec)
    else:
      spec, value = logical_to_spec(names), v[...]
    return v.replace(pipeline_lib.to_stages(value, stages, options.pipeline_repeats, spec))
  staged = jax.tree.map(stage_weight, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  stage_layers = {"state": staged,
                  "inputs": pipeline_lib.to_stages(dict(layer_inputs), stages,
                                                   options.pipeline_repeats)}
  carried = {"positions": to_microbatches(positions_BT),
             "segment_ids": (None if segment_ids_BT is None
                             else to_microbatches(segment_ids_BT))}
  out_M = pipeline_lib.pipeline(stage_fn, stage_layers, to_microbatches(x_BTD), carried,
                                repeats=options.pipeline_repeats, remat=options.remat,
                                names=("act_batch", "act_length", "act_embed"))
  return out_M.swapaxes(0, 1).reshape(x_BTD.shape)
