"""`python -m jaxtrain.generate`: load a model from a checkpoint and continue prompts.

  python -m jaxtrain.generate --checkpoint=runs/tiny --prompt="def main(" [--prompt=...]
      [--max_new_tokens=64] [--temperature=0.0] [--top_p=1.0] [--seed=0] [--config=FILE]

--checkpoint takes a run's workdir, its checkpoints/ directory or one step directory (the
params and the config the run saved), a weights directory from `python -m jaxtrain.interop.hf
import` (with its config.py), or a Hugging Face Llama directory (config.json + safetensors);
any of them on s3:// or gs:// too (of a run there, its newest complete step is downloaded).
--config overrides the model config for weights directories. Prompts are tokenized with the
config's `data.tokenizer`; BOS is prepended when the tokenizer has one.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from jaxtrain import storage
from jaxtrain.config import ConfigError
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.generate.sampler import SamplingConfig, generate
from jaxtrain.interop import hf_storage
from jaxtrain.interop import run_weights
from jaxtrain.parallel.mesh import make_mesh

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Run workdir, checkpoint step directory, "
                                  "weights directory or Hugging Face directory.")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "A prompt to continue (repeatable: batched).")
_CONFIG = flags.DEFINE_string("config", None, "Config file (default: the checkpoint's own).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; else softmax temperature.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep tokens up to this mass.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def load(checkpoint: str, config_path: str | None = None):
  """(model on one device's mesh, config) from any checkpoint form --checkpoint accepts."""
  import jax  # pylint: disable=import-outside-toplevel

  def for_generation(config):
    # One token at a time: no remat, and the dense xla attention suffices.
    config.model.remat_policy = "none"
    config.attention.impl = "xla"
  try:
    if storage.is_url(checkpoint):
      # The newest complete step of a run (or a weights directory), downloaded into staging.
      try:
        checkpoint = hf_storage.download_checkpoint(checkpoint)
      except storage.StorageError as e:
        raise ConfigError(str(e)) from None
    return run_weights.load_model(checkpoint, make_mesh(devices=jax.devices()[:1]), config_path,
                                  adjust=for_generation)
  except ConfigError as e:
    raise ConfigError(f"--checkpoint={e}" + ("; pass --config" if "no model config" in str(e)
                                              else "")) from None


def run(argv=None):
  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    if not _CHECKPOINT.value or not _PROMPT.value:
      print("error: --checkpoint and at least one --prompt are required", file=sys.stderr)
      sys.exit(2)
    try:
      sampling = SamplingConfig(max_new_tokens=_MAX_NEW_TOKENS.value,
                                temperature=_TEMPERATURE.value, top_p=_TOP_P.value)
      model, config = load(_CHECKPOINT.value, _CONFIG.value)
      tokenizer = load_tokenizer(config.data.tokenizer)
    except (ConfigError, ValueError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    sampling = SamplingConfig(max_new_tokens=sampling.max_new_tokens,
                              temperature=sampling.temperature, top_p=sampling.top_p,
                              eos_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size)
    prompts = [tokenizer.encode_document(p, add_bos=tokenizer.bos_id is not None, add_eos=False)
               for p in _PROMPT.value]
    for prompt, ids in zip(_PROMPT.value, generate(model, prompts, sampling, seed=_SEED.value)):
      text = tokenizer.decode([int(i) for i in ids if i != tokenizer.eos_id])
      print(f"--- prompt: {prompt!r}\n{prompt}{text}", flush=True)

  app.run(main, argv=argv)
