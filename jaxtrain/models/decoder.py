"""The decoder-only language model every family builds: embeddings, a stack of shared layers
(models/layers.py), the final norm and the output head, in Flax NNX, free of parallelism code.

Layers are stacked on a leading `layers` axis (or kept as a list) and run by
`parallel/layer_stack.run_layers`: scanned or unrolled under remat with a named policy, or as
pipeline stages. The model also owns its decode step with a KV cache (`forward_with_cache`),
which generation and the GRPO rollouts call. Shape letters: B batch, T length, D model dim,
V vocab, L layers (the layers' own in layers.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models import attention_stats, moe, mtp
from jaxtrain.models.block import Block, attention_class
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import norm, param
from jaxtrain.models.remat import remat_policy
from jaxtrain.models.variables import Head
from jaxtrain.ops.max_logit import MAX_LOGIT
from jaxtrain.parallel import context_parallel, layer_stack
from jaxtrain.parallel.mesh import shard
from jaxtrain.peft import lora as lora_lib


def stack_options(cfg: ModelConfig) -> layer_stack.StackOptions:
  """How `cfg`'s layers run (parallel/layer_stack.py): loop, remat policy, pipeline schedule."""
  rt, par = cfg.runtime, cfg.parallel
  remat = rt.remat_policy != "none"
  # MXFP8's block-scaled matmuls are not dot_generals, which the shape-based policies look for:
  # their outputs are saved by name instead (as under pipeline stages).
  by_name = rt.matmul_precision == "mxfp8"
  return layer_stack.StackOptions(
      scan_layers=rt.scan_layers, remat=remat,
      policy=remat_policy(rt.remat_policy, by_name=by_name) if remat else None,
      stage_policy=remat_policy(rt.remat_policy, by_name=True) if remat else None,
      pipeline_microbatches=par.pipeline_microbatches, pipeline_repeats=par.pipeline_repeats,
      pipeline_gather_weights_once=par.pipeline_gather_weights_once)


def _uniform(values: tuple[bool, ...]) -> bool | None:
  """The one value of `values`, or None when they differ."""
  return values[0] if len(set(values)) == 1 else None


def check_layer_kinds(arch) -> None:
  """ValueError unless the MoE layers can be stacked: all of them, or all after a dense prefix
  (scanned layers share one structure per stack)."""
  moe = arch.moe_layers()
  first = moe.index(True) if any(moe) else len(moe)
  if not all(moe[first:]):
    dense = [i for i, m in enumerate(moe) if not m]
    raise ValueError(f"dense layers {dense} among the MoE layers: with model.scan_layers=True "
                     f"the dense layers must come first (moe.dense_layers=0,...,k-1 and "
                     f"moe.sparse_step=1); use model.scan_layers=False for other patterns")


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, sliding: tuple[bool, ...], moe: bool):
  """len(sliding) blocks stacked on a leading `layers` axis. A stacked layer cannot hold its own
  type as a static value: with both types in the stack, each call gets it from `layer_inputs`
  (a traced bool)."""
  @nnx.split_rngs(splits=len(sliding))
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make_stack(rngs):
    return Block(cfg, rngs, _uniform(sliding), moe)
  return make_stack(rngs)


class Decoder(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    lora_lib.check_config(cfg.peft, cfg.arch)
    if cfg.runtime.scan_layers:
      check_layer_kinds(cfg.arch)
    self.cfg = cfg
    a = cfg.arch
    self.embed_VD = param(rngs, (a.vocab_size, a.d_model), ("vocab", "embed"), a.init_std,
                          jnp.dtype(cfg.runtime.param_dtype))
    sliding, moe = a.sliding_layers(), a.moe_layers()
    if cfg.runtime.scan_layers:
      # One stacked module per run of layers with the same feed-forward block: all of them, or
      # a dense prefix (`dense_layers`, as DeepSeek's first layers) and the MoE rest.
      first_moe = moe.index(True) if any(moe) else 0
      if first_moe:
        self.dense_layers = _stacked_blocks(cfg, rngs, sliding[:first_moe], moe=False)
      self.layers = _stacked_blocks(cfg, rngs, sliding[first_moe:], moe=any(moe))
    else:
      self.layers = nnx.List([Block(cfg, rngs, s, m) for s, m in zip(sliding, moe)])
    self.final_norm = norm(cfg, a.d_model)
    if a.mtp_depth:  # multi-token prediction (models/mtp.py), after the layers in tree order
      self.mtp = nnx.List([mtp.PredictionModule(cfg, rngs) for _ in range(a.mtp_depth)])
    # Under LoRA the heads are trained master weights beside the float32 adapters, whatever the
    # frozen base's storage dtype (model.param_dtype).
    head_dtype = jnp.dtype(jnp.float32 if cfg.peft.lora_rank else cfg.runtime.param_dtype)
    if a.score_head:  # a reward model: one score per position instead of the vocabulary
      self.score_D1 = param(rngs, (a.d_model, 1), ("embed", None), a.init_std, head_dtype, Head)
    elif not a.tie_embeddings:
      self.head_DV = param(rngs, (a.d_model, a.vocab_size), ("embed", "vocab"), a.init_std,
                           jnp.dtype(cfg.runtime.param_dtype))
    if a.value_head:  # PPO's critic: one value per position, beside the vocabulary head
      self.value_D1 = param(rngs, (a.d_model, 1), ("embed", None), a.init_std, head_dtype, Head)

  def values(self, x_BTD) -> jax.Array:
    """The value head on final-normed hidden states: [B, T] float32 (PPO's critic)."""
    w_D1 = self.value_D1[...].astype(self.cfg.runtime.dtype)
    return jnp.einsum("BTD,DO->BTO", x_BTD, w_D1, preferred_element_type=jnp.float32)[..., 0]

  def _check_vocab_head(self):
    if self.cfg.arch.score_head:
      raise ValueError("this model has a score head (a reward model): it scores sequences "
                       "(model(tokens) -> [B, T]) and has no vocabulary head to predict tokens")

  def scores(self, x_BTD) -> jax.Array:
    """The score head on final-normed hidden states: [B, T] float32."""
    w_D1 = self.score_D1[...].astype(self.cfg.runtime.dtype)
    return jnp.einsum("BTD,DO->BTO", x_BTD, w_D1, preferred_element_type=jnp.float32)[..., 0]

  def head_weights(self) -> jax.Array:
    """Output projection [D, V] in the compute dtype (the embedding table when tied)."""
    self._check_vocab_head()
    w_DV = self.embed_VD[...].T if self.cfg.arch.tie_embeddings else self.head_DV[...]
    return w_DV.astype(self.cfg.runtime.dtype)

  def head(self) -> tuple[jax.Array, int]:
    """(output projection in the compute dtype, the axis of its vocab dim): head_DV and 1, or the
    tied embedding table [V, D] and 0 as stored, for the chunked losses to contract without a
    transposed copy (jaxtrain/ops/cross_entropy.py)."""
    self._check_vocab_head()
    if self.cfg.arch.tie_embeddings:
      return self.embed_VD[...].astype(self.cfg.runtime.dtype), 0
    return self.head_DV[...].astype(self.cfg.runtime.dtype), 1

  def _embed(self, table_VD, tokens_BT) -> jax.Array:
    x_BTD = jnp.take(table_VD, tokens_BT, axis=0)
    if self.cfg.arch.features.scale_embeddings:
      # sqrt(D) rounded to the compute dtype first, as Gemma's reference does.
      x_BTD = x_BTD * jnp.asarray(math.sqrt(self.cfg.arch.d_model), x_BTD.dtype)
    return x_BTD

  def _stacks(self):
    """[(stacked or listed layers, first layer, end)] in order: the dense prefix's stack, if
    any, then `layers`."""
    num_layers = self.cfg.arch.num_layers
    dense = getattr(self, "dense_layers", None)
    if dense is None:
      return [(self.layers, 0, num_layers)]
    first_moe = self.cfg.arch.moe_layers().index(True)
    return [(dense, 0, first_moe), (self.layers, first_moe, num_layers)]

  def _layer_types(self, start: int, end: int) -> np.ndarray | None:
    """Each stacked layer's `sliding` flag [end - start] when the stack mixes both types, else
    None (each layer knows its own)."""
    sliding = self.cfg.arch.sliding_layers()[start:end]
    if not self.cfg.runtime.scan_layers or _uniform(sliding) is not None:
      return None
    return np.asarray(sliding)

  def sequence_layout(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The [B, T] arrays of `batch` in the order `hidden_states` expects under the current mesh:
    unchanged, unless a `context` axis > 1 splits the sequence in the load-balanced layout
    (jaxtrain.parallel.context_parallel). Any per-token arrays (targets, loss masks) go through
    together, so per-token losses pair up as before."""
    return context_parallel.to_layout(batch, context_parallel.context_size(),
                                      self.cfg.parallel.context_load_balance)

  def hidden_states(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *,
                    dropout_key=None, routing_LBTK=None) -> jax.Array:
    """Final-normed hidden states [B, T, D]; the loss applies the head in chunks.

    Under a mesh whose `context` axis splits the sequence, the inputs must already be in its
    layout (`sequence_layout`; positions given), and the outputs are in that layout too.

    `dropout_key`: LoRA dropout (training); None (eval, generation) runs without. Each layer
    gets its own key from it, and each adapter folds in its projection's index.

    An MoE model reports its layers' router statistics to the objective that collects them
    (models/moe.collect_router_stats). `routing_LBTK` [num_layers, B, T, k]: each MoE layer's
    experts for each token, replayed instead of chosen (a rollout's, recorded by
    `forward_with_cache(..., with_routing=True)`; dense layers' rows unread).
    """
    return self._forward(tokens_BT, positions_BT, segment_ids_BT, dropout_key,
                         routing_LBTK=routing_LBTK)[0]

  def hidden_states_with_predictions(self, tokens_BT, positions_BT=None, segment_ids_BT=None,
                                     *, dropout_key=None) -> tuple[jax.Array, list[jax.Array]]:
    """`hidden_states`, and the multi-token-prediction modules' normed states [B, T, D], one
    per depth (models/mtp.py: depth k's position t predicts the main model's target at
    t + k); their router statistics are reported with the main layers'."""
    return self._forward(tokens_BT, positions_BT, segment_ids_BT, dropout_key, predictions=True)

  def _forward(self, tokens_BT, positions_BT, segment_ids_BT, dropout_key, predictions=False,
               routing_LBTK=None):
    cfg = self.cfg
    b, t = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    # Gather the table whole (in the compute dtype) before the lookup, as FSDP does for every
    # weight: a gather from a vocab-sharded table makes XLA replicate the result instead.
    table_VD = shard(self.embed_VD[...].astype(cfg.runtime.dtype), (None, None))
    x_BTD = shard(self._embed(table_VD, tokens_BT), ("act_batch", "act_length", "act_embed"))
    dropout_keys = None
    if dropout_key is not None and cfg.peft.lora_rank > 0 and cfg.peft.lora_dropout > 0:
      dropout_keys = jax.random.split(dropout_key, cfg.arch.num_layers)
    stats = []
    for layers, start, end in self._stacks():
      layer_inputs = {}
      if dropout_keys is not None:
        layer_inputs["dropout_key"] = dropout_keys[start:end]
      if routing_LBTK is not None:
        layer_inputs["routing"] = routing_LBTK[start:end]
      if (sliding := self._layer_types(start, end)) is not None:
        layer_inputs["sliding"] = sliding
      x_BTD, layer_stats = layer_stack.run_layers(layers, x_BTD, positions_BT, segment_ids_BT,
                                                  layer_inputs, stack_options(cfg))
      if layer_stats:
        stats.append(dict(layer_stats))
    states = []
    if predictions:
      h_BTD = x_BTD
      for k, module in enumerate(self.mtp, start=1):
        emb_BTD = self._embed(table_VD, mtp.shift_left(tokens_BT, k))
        h_BTD, module_stats = module(h_BTD, emb_BTD, positions_BT, segment_ids_BT)
        if module_stats:  # one layer's: stacked as a layer of its own, after the main ones
          stats.append(jax.tree.map(lambda v: v[None], module_stats))
        states.append(module.post_norm(h_BTD))
    max_logits = [s.pop(MAX_LOGIT) for s in stats if MAX_LOGIT in s]
    if max_logits:
      attention_stats.report_max_logits(jnp.concatenate(max_logits))
    stats = [s for s in stats if s]  # dense stacks report no router statistics
    if stats:
      moe.report_router_stats(jax.tree.map(lambda *s: jnp.concatenate(s), *stats))
    return self.final_norm(x_BTD), states

  def empty_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
    """A cache for `batch` rows of `length` positions, each entry stacked over the layers: keys
    and values {"k", "v"} [L, B, S, K, E]; under latent attention {"latent" [L, B, S, R],
    "k_rope" [L, B, S, P]} (models/mla.py)."""
    a = self.cfg.arch
    dtype = self.cfg.runtime.dtype
    # Under a mesh (the GRPO rollouts) rows follow the batch's data-parallel split and heads the
    # tensor axis, like the activations; a no-op without one. The cache is made inside the jit
    # and carried through the decode loop, so XLA updates it in place (no copy per token).
    return {name: shard(jnp.zeros((a.num_layers, *shape), dtype), (None, *names))
            for name, (shape, names) in attention_class(a).cache_shapes(a, batch,
                                                                        length).items()}

  def forward_with_cache(self, tokens_BC, start_B, cache, *, with_routing: bool = False):
    """(float32 logits [B, C, V], updated cache) for C new tokens per row at positions
    start_B + [0, C): the decode step of generation and the GRPO rollouts. `with_routing`: a
    third item, each layer's chosen experts [num_layers, B, C, k] int32 (zeros for dense
    layers; an MoE model's), what `hidden_states(routing_LBTK=)` replays."""
    cfg = self.cfg
    positions_BC = start_B[:, None] + jnp.arange(tokens_BC.shape[1], dtype=jnp.int32)[None]
    x_BCD = self._embed(self.embed_VD[...].astype(cfg.runtime.dtype), tokens_BC)
    b, c = tokens_BC.shape
    no_experts = lambda n: jnp.zeros((n, b, c, max(cfg.arch.experts_per_token, 1)), jnp.int32)
    if not cfg.runtime.scan_layers:
      layer_caches, routing = [], []
      for i, block in enumerate(self.layers):
        x_BCD, layer_cache, experts_BCK = block.decode(x_BCD, positions_BC,
                                                       {k: v[i] for k, v in cache.items()},
                                                       start_B)
        layer_caches.append(layer_cache)
        if with_routing:
          routing.append(no_experts(1)[0] if experts_BCK is None else experts_BCK)
      new_cache = jax.tree.map(lambda *c: jnp.stack(c), *layer_caches)
    else:
      stack_caches, routing = [], []
      stacks = self._stacks()
      for layers, start, end in stacks:
        sliding = self._layer_types(start, end)
        # One stack takes the cache whole (no slice: the decode loop updates it in place).
        stack_cache = (cache if len(stacks) == 1
                       else {k: v[start:end] for k, v in cache.items()})

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, None if sliding is None else 0),
                  out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run_stack(x_BCD, block, layer_cache, sliding):
          x_BCD, layer_cache, experts_BCK = block.decode(x_BCD, positions_BC, layer_cache,
                                                         start_B, sliding)
          # The experts leave the scan only when asked for: the decode loop's hot path.
          return x_BCD, (layer_cache, experts_BCK if with_routing else None)

        x_BCD, (stack_cache, experts_LBCK) = run_stack(x_BCD, layers, stack_cache, sliding)
        stack_caches.append(stack_cache)
        if with_routing:
          routing.append(no_experts(end - start) if experts_LBCK is None else experts_LBCK)
      new_cache = (stack_caches[0] if len(stack_caches) == 1
                   else jax.tree.map(lambda *c: jnp.concatenate(c), *stack_caches))
    x_BCD = self.final_norm(x_BCD)
    logits_BCV = jnp.einsum("BCD,DV->BCV", x_BCD, self.head_weights(),
                            preferred_element_type=jnp.float32)
    if with_routing:
      return logits_BCV, new_cache, jnp.concatenate(routing) if cfg.runtime.scan_layers else \
          jnp.stack(routing)
    return logits_BCV, new_cache

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *,
               dropout_key=None) -> jax.Array:
    """Logits [B, T, V] in float32 (for generation and interop; training uses the chunked loss),
    in the order of the inputs whatever the mesh; with a score head (a reward model), the
    scores [B, T] instead (a sequence's reward is its last real token's)."""
    b, t = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inputs = {"tokens": tokens_BT, "positions": positions_BT}
    if segment_ids_BT is not None:
      inputs["segment_ids"] = segment_ids_BT
    inputs = self.sequence_layout(inputs)
    x_BTD = self.hidden_states(inputs["tokens"], inputs["positions"], inputs.get("segment_ids"),
                               dropout_key=dropout_key)
    if self.cfg.arch.score_head:
      scores_BT = context_parallel.from_layout(self.scores(x_BTD), context_parallel.context_size(),
                                               self.cfg.parallel.context_load_balance)
      return shard(scores_BT, ("act_batch", "act_length"))
    logits_BTV = jnp.einsum("BTD,DV->BTV", x_BTD, self.head_weights(),
                            preferred_element_type=jnp.float32)
    logits_BTV = context_parallel.from_layout(logits_BTV, context_parallel.context_size(),
                                              self.cfg.parallel.context_load_balance)
    return shard(logits_BTV, ("act_batch", "act_length", "act_vocab"))
