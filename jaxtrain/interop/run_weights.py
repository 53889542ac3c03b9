"""A run's weights as a plain model, for export, generation and evaluation.

A full fine-tuning (or pre-training) checkpoint holds every param. A LoRA run's checkpoint holds
only its adapters: they are merged here, W + (alpha / r) A @ B, into the base the run trained
on (its config's checkpoint.init_from, or the seed's random init for a smoke run without one),
dequantized first under QLoRA. Either way the result is the tree of a plain Llama, which
`interop.hf.save_model`, `checkpoint.save_params` and `generate` take as it is.
"""

from __future__ import annotations

import copy
import os

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.checkpointing import weights as ckpt_lib
from jaxtrain.config import ConfigError, load_config_file
from jaxtrain.interop import hf_config
from jaxtrain.interop import hf_io
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model, init_params_fn
from jaxtrain.peft import state as peft_state


def load_plain_model(checkpoint: str, config, mesh: Mesh, model_cfg: ModelConfig | None = None):
  """(plain model, the directory its weights came from) of `checkpoint` (a run's workdir,
  checkpoints/ or step directory, or a weights directory) trained with `config`."""
  cfg = model_cfg or ModelConfig.from_config(config)
  if cfg.peft.lora_rank == 0:
    graphdef, abstract, _ = abstract_model(cfg, mesh)
    params, source = ckpt_lib.load_params(checkpoint, abstract)
    return nnx.merge(graphdef, params), source
  graphdef, (abstract_adapters, _), (_, frozen_shardings) = abstract_model(
      cfg, mesh, filters=(peft_state.trainable_filter(cfg), ...))
  adapters, source = ckpt_lib.load_params(checkpoint, abstract_adapters)
  plain_cfg = peft_state.plain_config(cfg)
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
    frozen = jax.jit(lambda b: peft_state.frozen_from_base(b, cfg), out_shardings=frozen_shardings,
                     donate_argnums=0 if cfg.peft.base_quant == "none" else ())(base)
    merged = jax.jit(lambda a, f: peft_state.merged_params(nnx.merge(graphdef, a, f)),
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


def model_config(checkpoint: str, config_path: str | None = None,
                 hf_dtype: str = "float32") -> tuple[ml_collections.ConfigDict, bool]:
  """(the config of the model at `checkpoint`, whether it is a Hugging Face directory), no
  weights read. `checkpoint`: a run's workdir, checkpoints/ or step directory (the config the
  run saved), a weights directory with its config.py (`python -m jaxtrain.interop.hf import`),
  or a Hugging Face directory (config.json; its params in `hf_dtype`). `config_path` overrides
  the config of a jaxtrain directory. ConfigError (one line) for anything else."""
  if not os.path.isdir(checkpoint):
    raise ConfigError(f"{checkpoint!r}: no such directory")
  if os.path.exists(os.path.join(checkpoint, "config.json")) and not config_path:
    return hf_config.to_jaxtrain_config(hf_config.read_hf_config(checkpoint),
                                        os.path.abspath(checkpoint), hf_dtype), True
  if config_path:
    return load_config_file(config_path), False
  try:
    saved = ckpt_lib.saved_config(checkpoint)
  except ConfigError:  # neither a run's checkpoint nor a weights directory
    saved = None
  if saved is not None:
    return ml_collections.ConfigDict(saved), False
  if os.path.exists(os.path.join(checkpoint, "config.py")):
    return load_config_file(os.path.join(checkpoint, "config.py")), False
  raise ConfigError(f"{checkpoint!r}: no model config found: not a run's workdir or checkpoint, "
                    f"a weights directory with config.py, or a Hugging Face directory with "
                    f"config.json")


def load_model(checkpoint: str, mesh: Mesh, config_path: str | None = None, *,
               hf_dtype: str = "float32", adjust=None) -> tuple[nnx.Module, ml_collections.ConfigDict]:
  """(plain model sharded over `mesh`, its config) from any directory `model_config` takes; a
  LoRA run's adapters come merged into its base. `adjust(config)`: changes to how the model
  runs (remat, attention) made to the config before the model is built."""
  config, is_hf = model_config(checkpoint, config_path, hf_dtype)
  if adjust is not None:
    adjust(config)
  if is_hf:
    config.model.mtp_depth = hf_io.prediction_modules(os.path.abspath(checkpoint), config)
    return hf_io.load_weights(os.path.abspath(checkpoint), config, mesh=mesh), config
  model, _ = load_plain_model(checkpoint, config, mesh)
  return model, config
