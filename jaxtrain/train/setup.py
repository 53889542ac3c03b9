"""Everything derived from a config and a mesh before the first step: the abstract model split
into trained and frozen weights, their shardings, and the jitted init, train and eval steps.
Allocates nothing until `init_state` (or the trainer's restore) runs.

Under LoRA the trained weights are the adapters and the frozen ones the (possibly quantized)
base; for DPO under full fine-tuning the frozen weights are the reference. Frozen weights are
built from the plain model's params (`checkpoint.init_from`, or a random init of the seed).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxtrain import objectives
from jaxtrain.checkpointing.checkpointer import abstract_like
from jaxtrain.config import ConfigError
from jaxtrain.models.config import ModelConfig, qk_clip_threshold
from jaxtrain.models.sharding import abstract_model, init_params_fn
from jaxtrain.objectives import LanguageModel, Objective
from jaxtrain.objectives.forward import Frozen
from jaxtrain.parallel.mesh import mesh_platform
from jaxtrain.train import optim
from jaxtrain.train.step import (TrainState, jit_eval_step, jit_train_step, make_eval_step,
                                 make_train_step, state_shardings)
from jaxtrain.peft import state as peft_state


@dataclasses.dataclass
class Setup:
  """Everything derived from a config and a mesh before the first step runs."""
  mesh: Mesh
  model_cfg: ModelConfig
  graphdef: Any
  shardings: TrainState
  init_fn: Callable[[jax.Array], TrainState]  # key -> fresh state (frozen weights not set)
  state_from_params: Callable[[Any], TrainState]  # given params, fresh optimizer, step 0
  train_step: Callable
  eval_step: Callable
  # The plain model's params (no adapters, not quantized): what checkpoint.init_from holds and
  # what the frozen weights are built from.
  abstract_base: Any
  base_init_fn: Callable[[jax.Array], Any]  # key -> random plain params, on their shardings
  # Plain params -> the frozen weights (LoRA base, DPO reference); None when nothing is frozen.
  make_frozen: Callable[[Any], Frozen] | None
  objective: Objective = dataclasses.field(default_factory=LanguageModel)
  abstract_params: Any = None  # the trained params (or adapters), shapes with shardings
  frozen_shardings: Frozen | None = None
  # LoRA with a score or value head: (fresh trainable params, plain params) -> the params with
  # the heads' starting values from the plain ones (peft_state.heads_from_base); else None.
  heads_from_base: Callable[[Any, Any], Any] | None = None


def abstract_state(setup: Setup, seed: int = 0) -> TrainState:
  """The full state a run trains (frozen weights included) as ShapeDtypeStructs with their
  shardings: what the dry run compiles for."""
  with jax.set_mesh(setup.mesh):
    # The key is made inside eval_shape: eagerly it would run on this process's backend, which
    # a deviceless target's mesh (a TPU topology in a CPU process) cannot take.
    shapes = jax.eval_shape(lambda: setup.init_fn(jax.random.key(seed)))
    if setup.make_frozen is not None:
      shapes = shapes.replace(frozen=jax.eval_shape(setup.make_frozen, setup.abstract_base))
  shardings = setup.shardings.replace(frozen=setup.frozen_shardings)
  return abstract_like(shapes, shardings)


def _split_model(model_cfg: ModelConfig, mesh: Mesh):
  """(graphdef, trained abstract params, their shardings, frozen abstract params or None, their
  shardings or None): all params, or under LoRA the adapters and the rest."""
  if model_cfg.peft.lora_rank == 0:
    graphdef, abstract_params, shardings = abstract_model(model_cfg, mesh)
    return graphdef, abstract_params, shardings, None, None
  graphdef, (abstract_params, abstract_rest), (shardings, rest_shardings) = abstract_model(
      model_cfg, mesh, filters=(peft_state.trainable_filter(model_cfg), ...))
  return graphdef, abstract_params, shardings, abstract_rest, rest_shardings


def build(config, mesh: Mesh, model_cfg: ModelConfig | None = None) -> Setup:
  """Abstract model, shardings and the jitted init/train/eval functions; allocates nothing.

  `model_cfg` overrides the model config derived from `config` and the mesh's platform (the
  dry run models an accelerator's dtype and attention while compiling for CPU).
  """
  model_cfg = model_cfg or ModelConfig.from_config(config, platform=mesh_platform(mesh))
  objective = objectives.get(config)
  graphdef, abstract_params, param_shardings, abstract_rest, rest_shardings = _split_model(
      model_cfg, mesh)
  lora = model_cfg.peft.lora_rank > 0
  base_cfg = model_cfg
  if lora:
    base_cfg = peft_state.plain_config(model_cfg)
    try:  # before jit meets shards it cannot split evenly
      peft_state.check_mesh(model_cfg, mesh)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  _, abstract_base, base_shardings = abstract_model(base_cfg, mesh)
  tx = optim.make_optimizer(config, param_shardings)
  schedule = optim.learning_rate_schedule(config)

  frozen_shardings, make_frozen, heads_from_base = None, None, None
  if lora and (model_cfg.arch.score_head or model_cfg.arch.value_head):
    heads_from_base = jax.jit(peft_state.heads_from_base, out_shardings=param_shardings)
  if lora:
    frozen_shardings = Frozen(base=rest_shardings)
    # The loaded base is not needed afterwards: its buffers become the frozen ones, unless
    # quantized (new shapes: donating would only warn).
    make_frozen = jax.jit(lambda base: Frozen(base=peft_state.frozen_from_base(base, model_cfg)),
                          out_shardings=frozen_shardings,
                          donate_argnums=0 if model_cfg.peft.base_quant == "none" else ())
  elif objective.uses_reference:
    # Full fine-tuning: the reference is a frozen copy of the initial params.
    frozen_shardings = Frozen(reference=param_shardings)
    make_frozen = jax.jit(lambda base: Frozen(reference=base), out_shardings=frozen_shardings,
                          donate_argnums=0)
  shardings = state_shardings(tx, abstract_params, param_shardings, mesh)

  make_params = init_params_fn(model_cfg, trainable_only=lora)

  def from_params(params):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      bad_streak=jnp.zeros((), jnp.int32))

  init_fn = jax.jit(lambda key: from_params(make_params(key)), out_shardings=shardings)
  state_from_params = jax.jit(from_params, out_shardings=shardings, donate_argnums=0)
  base_init_fn = jax.jit(init_params_fn(base_cfg), out_shardings=base_shardings)
  full_shardings = shardings.replace(frozen=frozen_shardings)
  dropout_seed = config.train.seed if model_cfg.peft.lora_dropout > 0 else None
  step = make_train_step(graphdef, tx, schedule,
                         grad_accum_steps=config.train.grad_accum_steps,
                         loss_chunk_size=config.train.loss_chunk_size,
                         param_shardings=param_shardings, objective=objective,
                         dropout_seed=dropout_seed,
                         bias_update_rate=_bias_update_rate(model_cfg),
                         qk_clip_threshold=qk_clip_threshold(config),
                         rope_head_dim=model_cfg.arch.qk_rope_head_dim)
  batch_shardings = objective.batch_shardings(config, mesh)
  train_step = jit_train_step(step, full_shardings, mesh, batch_shardings)
  eval_step = jit_eval_step(make_eval_step(graphdef, config.train.loss_chunk_size,
                                           objective=objective),
                            param_shardings, mesh, frozen_shardings, batch_shardings)
  return Setup(mesh, model_cfg, graphdef, shardings, init_fn, state_from_params, train_step,
               eval_step, abstract_base, base_init_fn, make_frozen, objective,
               abstract_params=abstract_params, frozen_shardings=frozen_shardings,
               heads_from_base=heads_from_base)


def _bias_update_rate(model_cfg: ModelConfig) -> float:
  """moe.bias_update_rate where the routers' correction biases are trained weights; 0 under
  LoRA, whose frozen base holds them."""
  if not model_cfg.arch.router_bias or model_cfg.peft.lora_rank > 0:
    return 0.0
  return model_cfg.runtime.moe_bias_update_rate


def init_state(setup: Setup, seed: int) -> TrainState:
  """A fresh state: random params (or adapters) and, where the run has frozen weights, those
  built from a random plain model of the same seed."""
  with jax.set_mesh(setup.mesh):
    state = setup.init_fn(jax.random.key(seed))
    if setup.make_frozen is not None:
      state = state.replace(frozen=setup.make_frozen(setup.base_init_fn(jax.random.key(seed))))
  return state
