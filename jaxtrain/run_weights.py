"""A run's weights as a plain model, for export, generation and evaluation.

A full fine-tuning (or pre-training) checkpoint holds every param. A LoRA run's checkpoint holds
only its adapters: they are merged here, W + (alpha / r) A @ B, into the base the run trained
on (its config's checkpoint.init_from, or the seed's random init for a smoke run without one),
dequantized first under QLoRA. Either way the result is the tree of a plain Llama, which
`interop.hf.save_model`, `checkpoint.save_params` and `generate` take as it is.
"""

from __future__ import annotations

import copy

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxtrain import checkpoint as ckpt_lib
from jaxtrain.models.config import ModelConfig
from jaxtrain.sharding import abstract_model, init_params_fn


def load_plain_model(checkpoint: str, config, mesh: Mesh, model_cfg: ModelConfig | None = None):
  """(plain model, the directory its weights came from) of `checkpoint` (a run's workdir,
  checkpoints/ or step directory, or a weights directory) trained with `config`."""
  cfg = model_cfg or ModelConfig.from_config(config)
  if cfg.peft.lora_rank == 0:
    graphdef, abstract, _ = abstract_model(cfg, mesh)
    params, source = ckpt_lib.load_params(checkpoint, abstract)
    return nnx.merge(graphdef, params), source
  from jaxtrain import peft  # pylint: disable=import-outside-toplevel
  graphdef, (abstract_adapters, _), (_, frozen_shardings) = abstract_model(
      cfg, mesh, filters=(peft.trainable_filter(cfg), ...))
  adapters, source = ckpt_lib.load_params(checkpoint, abstract_adapters)
  plain_cfg = peft.plain_config(cfg)
  plain_graphdef, abstract_base, base_shardings = abstract_model(plain_cfg, mesh)
  # The base the run actually trained on: its saved config's (command-line overrides included)
  # when the checkpoint is a run's, else the given config's.
  saved = ckpt_lib.saved_config(checkpoint)
  init_from = (saved or config.to_dict())["checkpoint"]["init_from"]
  seed = (saved or config.to_dict())["train"]["seed"]
  with jax.set_mesh(mesh):
    if init_from:
      base, _ = ckpt_lib.load_params(init_from, abstract_base)
    else:  # the trainer's random base of a run without init_from: same seed, same weights
      base = jax.jit(init_params_fn(plain_cfg), out_shardings=base_shardings)(
          jax.random.key(seed))
    frozen = jax.jit(lambda b: peft.frozen_from_base(b, cfg), out_shardings=frozen_shardings,
                     donate_argnums=0 if cfg.peft.base_quant == "none" else ())(base)
    merged = jax.jit(lambda a, f: peft.merged_params(nnx.merge(graphdef, a, f)),
                     out_shardings=base_shardings)(adapters, frozen)
  return nnx.merge(plain_graphdef, merged), source


def plain_run_config(config):
  """A copy of a run's config describing the plain model `load_plain_model` returns (no
  adapters, no quantization): what `interop.hf.save_model` checks the weights against."""
  plain = copy.deepcopy(config)
  with plain.unlocked():
    plain.lora.rank = 0
    plain.lora.quantize_base = "none"
  return plain
