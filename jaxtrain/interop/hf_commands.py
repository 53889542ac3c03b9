"""The two commands of `python -m jaxtrain.interop.hf` (parsed in hf_cli.py): `import_command`
(a Hugging Face directory -> a weights directory with a ready config for checkpoint.init_from)
and `export_command` (a run's checkpoint or weights directory -> a Hugging Face directory),
over hf.py's load_model and save_model, on this host's devices.
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import shutil
from typing import Any

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from jaxtrain import storage
from jaxtrain.config import ConfigError, load_config_file
from jaxtrain.interop import hf_config, hf_storage
from jaxtrain.interop.hf_io import (DEFAULT_MAX_FILE_BYTES, TOKENIZER_FILES, check_divisible,
                                 default_mesh, existing_weights, load_model, save_model)
from jaxtrain.checkpointing import weights as checkpoint
from jaxtrain.checkpointing.weights import saved_config
from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.interop.run_weights import load_plain_model, plain_run_config
from jaxtrain.models import registry
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from jaxtrain.models.variables import WEIGHTS
from jaxtrain.parallel.mesh import make_mesh
from jaxtrain.peft import state as peft_state


def _host_mesh(cfg: ModelConfig) -> Mesh:
  """All local devices along fsdp when every parameter splits evenly over them, else one."""
  n = jax.local_device_count()
  if n > 1:
    mesh = make_mesh({"fsdp": n}, jax.local_devices())
    if _splits_evenly(cfg, mesh):
      return mesh
  return default_mesh()


def _splits_evenly(cfg: ModelConfig, mesh: Mesh) -> bool:
  """Whether the model's parameters (and a QLoRA run's quantization groups) divide over `mesh`:
  the model dim may, while a latent attention rank or a head count does not."""
  _, abstract_params, _ = abstract_model(cfg, mesh)
  try:
    check_divisible(abstract_params, mesh)
    if cfg.peft.base_quant != "none":
      peft_state.check_mesh(cfg, mesh)
  except (HFFormatError, ValueError):
    return False
  return True


def _config_py(overrides: dict[str, Any], source: str, stored_dtype: str,
               url: str | None = None) -> str:
  lines = [f"  c.{k} = {v!r}" for k, v in overrides.items()
           if k not in ("data.tokenizer", "model.param_dtype")]
  if "data.tokenizer" in overrides:
    lines.append('  c.data.tokenizer = "hf:" + os.path.join(HERE, "tokenizer.json")')
  body = "\n".join(lines)
  family = overrides.get("model.family", "llama")
  if overrides.get("model.score_head"):
    family += " reward-model"  # a *ForSequenceClassification: score head, reward objective
  where = ""
  if url:  # a config file is loaded from local disk (config_flags), never from a bucket
    tokenizer = (f" --config.data.tokenizer=hf:{url}/tokenizer.json"
                 if "data.tokenizer" in overrides else "")
    where = (f"\nUploaded to {url}. A config file is read from local disk: download the\n"
             f"directory with\n  {_download_line(url)}\nand pass {posixpath.basename(url)}"
             f"/config.py, or train from another config file with the values below\nas "
             f"--config.* flags and\n  --config.checkpoint.init_from={url}{tokenizer}\n")
  return f'''"""jaxtrain config for the {family} weights in this directory.

Written by `python -m jaxtrain.interop.hf import` from
  {source}
The weights are stored as {stored_dtype}; they are cast to model.param_dtype (float32 master
weights) when a run starts. Train from them with (add your data.* keys):

  python -m jaxtrain.main --config={{this file}} --workdir=runs/finetune
{where}"""

import os

from jaxtrain.config import default_config

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = default_config()
{body}
  c.checkpoint.init_from = HERE
  return c
'''


def _download_line(url: str) -> str:
  """The command that copies the directory at `url` to ./<its name>."""
  if url.startswith("s3://"):
    return f"aws s3 cp --recursive {url} {posixpath.basename(url)}"
  return f"gcloud storage cp -r {url} ."


def import_command(hf_dir: str, out: str, dtype: str = "float32",
                   mtp_depth: int | None = None) -> str:
  """Converts a Hugging Face directory into a weights directory for checkpoint.init_from:
  OUT/params (Orbax), OUT/config.py (ready-to-train config), OUT/jaxtrain_config.json (the
  values), and the tokenizer files. `mtp_depth`: as load_model's. Either directory may be an
  s3:// or gs:// URL (hf_storage.py). Returns the training command line."""
  # Orbax and grain load only for the CLI; load_model/save_model do not need them.

  hf_dir, out = (p if storage.is_url(p) else os.path.abspath(p)
                 for p in (_bare(hf_dir), _bare(out)))
  if storage.is_url(out):
    hf_storage.check(out, "--out")
  if storage.exists(storage.join(out, checkpoint.WEIGHTS_ITEM)):
    raise HFFormatError(f"--out={out}: already holds {checkpoint.WEIGHTS_ITEM}/; choose an "
                        f"empty directory")
  local_hf = hf_storage.download_hf_dir(hf_dir) if storage.is_url(hf_dir) else hf_dir
  local_out = hf_storage.fresh_staging(out) if storage.is_url(out) else out
  with hf_storage.as_urls({local_hf: hf_dir, local_out: out}):
    overrides = _import(local_hf, local_out, dtype, mtp_depth)
  # What the written files record is where the directories are, not where they were staged.
  if "data.tokenizer" in overrides:
    overrides["data.tokenizer"] = "hf:" + storage.join(out, "tokenizer.json")
  overrides["model.param_dtype"] = "float32"  # master weights; the stored dtype is cast on load
  url = out if storage.is_url(out) else None
  with open(os.path.join(local_out, "jaxtrain_config.json"), "w", encoding="utf-8") as f:
    json.dump({"source": hf_dir, "stored_dtype": dtype,
               "overrides": {**overrides, "checkpoint.init_from": out}}, f, indent=2)
  with open(os.path.join(local_out, "config.py"), "w", encoding="utf-8") as f:
    f.write(_config_py(overrides, hf_dir, dtype, url))
  if url:
    storage.upload_dir(local_out, url, last=("config.py",))
  flags = " ".join(f"--config.{k}={shlex.quote(str(v))}" for k, v in overrides.items())
  others = (f"# or, from another config file, the same values:\n"
            f"#   {flags} --config.checkpoint.init_from={out}")
  if url:
    return (f"{_download_line(url)}\npython -m jaxtrain.main "
            f"--config={posixpath.basename(url)}/config.py --workdir=runs/finetune\n{others}")
  return (f"python -m jaxtrain.main --config={os.path.join(out, 'config.py')} "
          f"--workdir=runs/finetune\n{others}")


def _bare(path: str) -> str:
  """A URL without its trailing slash (URLs are joined with "/"); a local path as it is."""
  return path.rstrip("/") if storage.is_url(path) else path


def _import(hf_dir: str, out: str, dtype: str, mtp_depth: int | None) -> dict[str, Any]:
  """Writes OUT/params and the tokenizer files of the local Hugging Face directory `hf_dir`;
  returns the config overrides of the model."""

  hf = hf_config.read_hf_config(hf_dir)
  overrides = hf_config.overrides_for(hf, hf_dir, dtype)
  cfg = ModelConfig.from_config(hf_config.to_jaxtrain_config(hf, hf_dir, dtype))
  model, config = load_model(hf_dir, mesh=_host_mesh(cfg), dtype=dtype, mtp_depth=mtp_depth)
  if registry.get(cfg.arch.family).multi_token_prediction:
    overrides["model.mtp_depth"] = int(config.model.mtp_depth)
  os.makedirs(out, exist_ok=True)
  checkpoint.save_params(out, nnx.state(model, WEIGHTS))
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(hf_dir, name)):
      shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out, name))
  return overrides


def export_command(checkpoint: str, config_path: str | None, out: str, dtype: str | None = None,
                   max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                   rope_spelling: str = "rope_parameters",
                   overwrite: bool = False) -> list[str]:
  """Exports a run's checkpoint or a weights directory as a Hugging Face directory; returns the
  files written. CHECKPOINT and OUT may be s3:// or gs:// URLs (hf_storage.py)."""
  if config_path and storage.is_url(config_path):
    raise HFFormatError(f"--config={config_path}: a config file is read from local disk; "
                        f"download it and pass its local path")
  checkpoint, out = _bare(checkpoint), _bare(out)
  url = out if storage.is_url(out) else None
  # OUT is checked before a checkpoint is downloaded or loaded (minutes), not after.
  if url:
    hf_storage.check(url, "--out")
    replaced = hf_storage.existing_weights(url, overwrite)
  else:
    existing_weights(out, overwrite)
  places = {}
  if storage.is_url(checkpoint):
    local = hf_storage.download_checkpoint(checkpoint)
    places[local] = checkpoint
    checkpoint = local
  if url:
    out = hf_storage.fresh_staging(url)
    places[out] = url
  with hf_storage.as_urls(places):
    files = _export(checkpoint, config_path, out, dtype, max_file_bytes, rope_spelling,
                    overwrite)
  if url:
    hf_storage.replace(url, out, replaced, last="config.json")
  return files


def _export(checkpoint: str, config_path: str | None, out: str, dtype: str | None,
            max_file_bytes: int, rope_spelling: str, overwrite: bool) -> list[str]:
  """export_command on local directories."""
  saved = None
  if config_path is None:
    config_path = os.path.join(checkpoint, "config.py")
    if not os.path.isfile(config_path):
      try:
        saved = saved_config(checkpoint)
      except ConfigError:  # not a run's checkpoint either: the message below says what to pass
        saved = None
    if not os.path.isfile(config_path) and saved is None:
      raise HFFormatError(f"--config: required, since {checkpoint} has neither config.py nor a "
                          f"run's saved config; give the config file the run was trained with")
  elif not os.path.isfile(config_path):
    raise HFFormatError(f"--config={config_path}: no such file")
  existing_weights(out, overwrite)  # before minutes of loading, not after
  # A run's checkpoint carries the resolved config it trained with (overrides included).
  config = ml_collections.ConfigDict(saved) if saved else load_config_file(config_path)
  cfg = ModelConfig.from_config(config)
  # A LoRA run's adapters are merged into its base here: the export is the plain model.
  model, _ = load_plain_model(checkpoint, config, _host_mesh(cfg))
  return save_model(model, plain_run_config(config), out, dtype=dtype,
                    max_file_bytes=max_file_bytes, rope_spelling=rope_spelling,
                    overwrite=overwrite)


