"""Reading and writing Hugging Face model directories for every family: the sharded model from
config.json + *.safetensors and back (`load_model`, `save_model`, the public names of
`jaxtrain.interop.hf`, whose docstring shows their use), and the pieces the CLI's commands
(hf_commands.py) share: existing weights, tokenizer files, the divisibility check.

Import goes straight into the sharded model: the abstract model gives every parameter's shape
and sharding, and each device's shard is read from the safetensors on its own (only the rows
and columns it covers, layer by layer), sent to its device and dropped before the next is read,
so host memory holds one shard at a time, never a whole checkpoint. Export gathers one tensor
of one layer at a time and streams it into the file. The tensor names and layouts (rules
generated from the family's switches) are in hf_weights.py, the config.json mapping in
hf_config.py.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.interop import hf_config, hf_export_config, hf_weights, safetensors_writer
from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.models import registry
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.decoder import Decoder
from jaxtrain.models.sharding import abstract_model
from jaxtrain.models.variables import WEIGHTS
from jaxtrain.parallel.mesh import make_mesh

DEFAULT_MAX_FILE_BYTES = 5 * 10**9  # what transformers' save_pretrained uses (5GB)
# Tokenizer files that travel with the weights (all optional beside tokenizer.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def default_mesh() -> Mesh:
  """One device: what `load_model` uses when no mesh is given."""
  return make_mesh(devices=jax.devices()[:1])


def _key_path(path) -> tuple:
  """Tree path of a parameter leaf as plain keys, without the Variable's trailing `.value`."""
  return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path
               if not isinstance(k, jax.tree_util.GetAttrKey))


STACKS = ("layers", "dense_layers")


def _stack_span(cfg: ModelConfig, stack: str) -> tuple[int, int]:
  """The layers [first, end) a stacked module holds (models/decoder.py): `dense_layers` the
  dense prefix of an MoE model, `layers` the rest (every layer when there is no prefix)."""
  moe, num_layers = cfg.arch.moe_layers(), cfg.arch.num_layers
  first_moe = moe.index(True) if any(moe) else 0
  return (0, first_moe) if stack == "dense_layers" else (first_moe, num_layers)


def _locate(cfg: ModelConfig, keys: tuple) -> tuple[hf_weights.TensorRule, int | None, bool]:
  """(rule, layer index (the first of a stack) or None, stacked) for a parameter path of our
  model. Multi-token-prediction module k (Decoder.mtp[k]) is stored as layer num_layers + k."""
  if keys[0] == "mtp":
    rules = {r.ours: r for r in hf_weights.prediction_module_rules(cfg)}
    return rules[keys[2:]], cfg.arch.num_layers + int(keys[1]), False
  if keys[0] not in STACKS:
    return {r.ours: r for r in hf_weights.top_rules(cfg)}[keys], None, False
  layer, ours, stacked = _stack_span(cfg, keys[0])[0], keys[1:], True
  if not cfg.runtime.scan_layers:
    layer, ours, stacked = int(keys[1]), keys[2:], False
  return {r.ours: r for r in hf_weights.rules_of_layer(cfg, layer)}[ours], layer, stacked


def _place(shape, sharding, dtype, read) -> jax.Array:
  """A jax.Array from `read(index)` -> the host block of one shard.

  The same contract as jax.make_array_from_callback, with bounded host memory: that function
  reads every local shard of a parameter before transferring any (all of a stacked parameter
  on one host: 75 GB for a 70B model's float32 gate projections) and reads a partly replicated
  block once per device that holds it. Here each distinct block is read once, sent to its device
  and released before the next is read; devices holding the same block copy it on device.
  """
  placed, shards = {}, []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key in placed:
      shards.append(jax.device_put(placed[key], device))
      continue
    block = np.asarray(read(index), dtype=dtype)
    assert block.shape == sharding.shard_shape(shape), (block.shape, index)
    placed[key] = jax.device_put(block, device).block_until_ready()
    shards.append(placed[key])
  return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _fill_params(abstract_params, cfg: ModelConfig, reader: hf_weights.SafetensorsReader,
                 naming: hf_weights.Naming):
  """Real arrays for the abstract params, every shard read from the safetensors on its own."""
  sizes = hf_weights.sizes_of(cfg)

  def make(path, leaf):
    rule, layer, stacked = _locate(cfg, _key_path(path))

    def tensor(i, j=None):
      return reader.get_slice(naming.stored(hf_weights.tensor_name(rule, i, j)))

    def slices(index, shape):
      out = {}
      for letter, s, n in zip(rule.our_layout, index, shape):
        start, stop, step = s.indices(n)
        assert step == 1, f"{rule.hf_name}: strided shard index {s}"
        out[letter] = slice(start, stop)
      return out

    def layer_block(i, index, shape):
      """Layer i's block (index and shape without a layers axis); an expert rule reads its
      experts' tensors one by one."""
      if not rule.per_expert:
        return hf_weights.read_block(tensor(i), rule, sizes, slices(index, shape))
      cuts = slices(index[1:], shape[1:])
      return np.stack([hf_weights.read_block(tensor(i, j), rule, sizes, cuts)
                       for j in range(*index[0].indices(shape[0])[:2])])

    def read(index):
      if stacked:  # leading layers axis: one HF tensor per layer, each cut the same way
        start, stop, _ = index[0].indices(leaf.shape[0])
        # Filled in place: the shard plus one layer's block, never a list of blocks to stack.
        block = np.empty(leaf.sharding.shard_shape(leaf.shape), dtype)
        for j, i in enumerate(range(start, stop)):
          block[j] = layer_block(layer + i, index[1:], leaf.shape[1:])
        return block
      return layer_block(layer, index, leaf.shape)

    dtype = np.dtype(leaf.dtype)
    return _place(leaf.shape, leaf.sharding, dtype, read)

  return jax.tree.map_with_path(make, abstract_params)


def check_divisible(abstract_params, mesh: Mesh) -> None:
  """A clear error for a mesh that cannot split a parameter evenly (JAX's names no config key)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
    for dim, (size, axes) in enumerate(zip(leaf.shape, leaf.sharding.spec)):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      parts = int(np.prod([mesh.shape[a] for a in axes]))
      if size % parts:
        name = "/".join(str(k) for k in _key_path(path))
        raise HFFormatError(f"mesh {dict(mesh.shape)}: {'*'.join(axes)}={parts} does not divide "
                            f"dim {dim} (size {size}) of {name}; choose mesh axis sizes that "
                            f"divide the model's dims")


def load_model(path: str, *, mesh: Mesh | None = None, dtype: str | None = None,
               mtp_depth: int | None = None) -> tuple[Decoder, ml_collections.ConfigDict]:
  """(model, config) from a Hugging Face directory of any supported family.

  Args:
    path: directory with config.json and model.safetensors (or model-*-of-*.safetensors with
      model.safetensors.index.json); a tokenizer.json beside them becomes `data.tokenizer`.
    mesh: a (data, fsdp, tensor) mesh to shard the parameters over (default: one device).
    dtype: parameter dtype, "float32" (the default: master weights for training) or
      "bfloat16"/"float16"; the checkpoint's own dtype is converted on the fly.
    mtp_depth: DeepSeek-V3's multi-token-prediction layers to keep (`model.mtp_depth`): by
      default every one the checkpoint holds; 0 leaves them out.

  Returns:
    The sharded model, whose call returns float32 logits [B, T, V], and the full jaxtrain
    config (default_config() with model.* from config.json) to train it with.

    A reward model's checkpoint (config.json `architectures` a *ForSequenceClassification, one
    label: id2label, else num_labels) imports with its score head: `score.weight` [1, D] becomes
    `score_D1` [D, 1], config.model.score_head is True (with train.objective="reward" and
    data.format="preference"), and the model's call returns float32 scores [B, T]; a sequence's
    reward is its last real token's (`jaxtrain.objectives.reward.loss.sequence_rewards`), which is
    what transformers' *ForSequenceClassification pools on right-padded rows whose last real token
    is not its pad_token_id. Other label counts are refused.

  Raises:
    HFFormatError (a ConfigError): missing or pickle weights, unsupported config fields (a
      classifier with num_labels != 1 among them), tensors missing or of the wrong shape; the
      message names the field or tensor.
  """
  path = os.path.abspath(path)
  config = hf_config.to_jaxtrain_config(hf_config.read_hf_config(path), path,
                                        dtype or "float32")
  config.model.mtp_depth = prediction_modules(path, config, mtp_depth)
  return load_weights(path, config, mesh=mesh), config


def prediction_modules(path: str, config, wanted: int | None = None) -> int:
  """`model.mtp_depth` for an import of `path`: the multi-token-prediction layers it holds (0
  for a family without them), or `wanted` of them; more than it holds is an HFFormatError."""
  cfg = ModelConfig.from_config(config)
  if cfg.arch.score_head:  # transformers' *ForSequenceClassification has none
    if wanted:
      raise HFFormatError(f"mtp_depth={wanted}: a *ForSequenceClassification checkpoint has no "
                          f"multi-token-prediction layers")
    return 0
  if not registry.get(cfg.arch.family).multi_token_prediction:
    if wanted:
      raise HFFormatError(f"mtp_depth={wanted}: {cfg.arch.family} checkpoints have no "
                          f"multi-token-prediction layers")
    return 0
  declared = _declared_prediction_modules(path)
  with hf_weights.SafetensorsReader(path) as reader:
    stored = hf_weights.stored_prediction_modules(reader.names(), cfg, declared)
  if wanted is None:
    return stored
  if not 0 <= wanted <= stored:
    raise HFFormatError(f"mtp_depth={wanted}: {path} holds {stored} multi-token-prediction "
                        f"layer(s) (config.json declares {declared}); choose 0 to {stored}")
  return wanted


def _declared_prediction_modules(path: str) -> int:
  return int(hf_config.read_hf_config(path).get("num_nextn_predict_layers") or 0)


def load_weights(path: str, config, *, mesh: Mesh | None = None) -> Decoder:
  """The model `config` describes, with its weights from a Hugging Face directory.

  For a config that differs from `load_model`'s only in how the model runs (scan_layers,
  remat_policy, dtypes, attention.impl) or keeps fewer multi-token-prediction layers
  (model.mtp_depth): every tensor's name and shape is checked against it.
  """
  cfg = ModelConfig.from_config(config)
  mesh = default_mesh() if mesh is None else mesh
  graphdef, abstract_params, _ = abstract_model(cfg, mesh)
  check_divisible(abstract_params, mesh)
  # DeepSeek-V3's checkpoints hold their multi-token-prediction layers after the decoder's
  # (`model.layers.{num_hidden_layers + k}`): the first model.mtp_depth are read.
  with hf_weights.SafetensorsReader(os.path.abspath(path)) as reader:
    naming = hf_weights.check_tensors(reader, cfg, _declared_prediction_modules(path))
    params = _fill_params(abstract_params, cfg, reader, naming)
  return nnx.merge(graphdef, params)


@jax.jit
def _take_layer(x, i):
  # The layer index is traced, so one compilation serves every layer of a stacked tensor.
  return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _to_host(x: jax.Array) -> np.ndarray:
  """The whole array on this host; a collective across processes when it spans several."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _pending_tensors(params: dict, cfg: ModelConfig,
                     dtype: str) -> list[safetensors_writer.PendingTensor]:
  """Every Hugging Face tensor in transformers' order, each produced only when written."""
  sizes = hf_weights.sizes_of(cfg)
  top = {r.hf_name: r for r in hf_weights.top_rules(cfg)}

  def lookup(keys):
    node = params
    for k in keys:
      node = node[k]
    return node

  def layer_param(rule, layer):
    if not cfg.runtime.scan_layers:
      return lookup(("layers", layer) + rule.ours)
    stack = "dense_layers" if layer < _stack_span(cfg, "dense_layers")[1] else "layers"
    return _take_layer(lookup((stack,) + rule.ours), layer - _stack_span(cfg, stack)[0])

  def pending(rule, layer=None, expert=None, path=None):
    """`path`: where our parameter is, when not at rule.ours (top level) or in layer `layer`."""
    def produce():
      if path is not None:
        x = lookup(path)
      elif layer is None:
        x = lookup(rule.ours)
      else:
        x = layer_param(rule, layer)
      if expert is not None:
        x = _take_layer(x, expert)
      return hf_weights.to_hf_layout(_to_host(x), rule, sizes)
    return safetensors_writer.PendingTensor(hf_weights.tensor_name(rule, layer, expert),
                                    hf_weights.hf_shape(rule, sizes), dtype, produce)

  def each_expert(rule):
    return range(cfg.arch.num_experts) if rule.per_expert else [None]

  out = [pending(top["model.embed_tokens.weight"])]
  for i in range(cfg.arch.num_layers):
    for rule in hf_weights.rules_of_layer(cfg, i):
      out += [pending(rule, i, j) for j in each_expert(rule)]
  # Multi-token-prediction module k as DeepSeek-V3's checkpoints store it: layer L + k, with
  # copies of the embedding and the output head.
  for k in range(cfg.arch.mtp_depth):
    i = cfg.arch.num_layers + k
    for rule in hf_weights.prediction_module_rules(cfg):
      out += [pending(rule, i, j, ("mtp", k) + rule.ours) for j in each_expert(rule)]
    out += [pending(rule, i, path=rule.ours) for rule in hf_weights.prediction_module_copies(cfg)]
  out.append(pending(top["model.norm.weight"]))
  for head in ("lm_head.weight", hf_weights.SCORE_NAME):  # at most one of them
    if head in top:
      out.append(pending(top[head]))
  return out


def _tokenizer_files(config) -> tuple[list[str], Any]:
  """(files to ship with the weights, the loaded tokenizer) for config.data.tokenizer."""

  spec = str(config.data.tokenizer or "byte")
  tok = load_tokenizer(spec)
  path = getattr(tok, "path", None)
  if path is None:
    return [], tok
  if path.endswith(".model"):  # SentencePiece: transformers' Llama tokenizer reads this name
    return [path], tok
  directory = os.path.dirname(path)
  extras = [os.path.join(directory, n) for n in TOKENIZER_FILES[1:]
            if os.path.isfile(os.path.join(directory, n))]
  return [path] + extras, tok


def existing_weights(path: str, overwrite: bool) -> list[str]:
  """Weights and config.json already in `path`; an error unless they may be replaced."""
  existing = sorted(n for n in (os.listdir(path) if os.path.isdir(path) else [])
                    if n.endswith(".safetensors") or n in ("config.json", hf_weights.INDEX_FILE))
  if existing and not overwrite:
    raise HFFormatError(f"{path}: already holds {', '.join(existing[:3])}; choose an empty "
                        f"directory, or replace them with --overwrite (overwrite=True)")
  return existing


def _prepare_dir(path: str, overwrite: bool) -> None:
  existing = existing_weights(path, overwrite)
  os.makedirs(path, exist_ok=True)
  for name in existing:  # stale shards of another model must not stay behind an index
    os.remove(os.path.join(path, name))


def save_model(model: Decoder, config, path: str, *, dtype: str | None = None,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
               rope_spelling: str = "rope_parameters", overwrite: bool = False) -> list[str]:
  """Writes a directory transformers loads as the family's *ForCausalLM (LlamaForCausalLM,
  Qwen3ForCausalLM, ..., Gemma3ForCausalLM); returns the files written. A reward model (a score
  head) is written as the family's *ForSequenceClassification: `score.weight` [1, D], one label,
  and pad_token_id the tokenizer's pad token (other than its EOS), else its BOS
  (hf_export_config.score_pad_id: transformers pools the rightmost token that is not the pad).

  Args:
    model: a (sharded) jaxtrain Decoder; gathered one tensor of one layer at a time.
    config: its jaxtrain config (model.* describe it; data.tokenizer, when it names a
      tokenizer file, is copied beside the weights, with tokenizer_config.json and friends).
    path: output directory; refused when it already holds weights, unless `overwrite`.
    dtype: dtype of the written tensors (default: the parameters' dtype).
    max_file_bytes: above this the weights are split into model-0000i-of-0000N.safetensors
      files with model.safetensors.index.json, as transformers does.
    rope_spelling: "rope_parameters" (transformers >= 5) or "rope_scaling" (rope_theta and
      rope_scaling at the top level, for readers older than transformers 5).
  """
  cfg = ModelConfig.from_config(config)
  params = nnx.to_pure_dict(nnx.state(model, WEIGHTS))
  _, abstract_params, _ = abstract_model(cfg, default_mesh())
  want = {_key_path(p): a.shape for p, a in jax.tree_util.tree_leaves_with_path(abstract_params)}
  got = {_key_path(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
  if want != got:
    diff = sorted(set(want.items()) ^ set(got.items()), key=str)[:3]
    raise HFFormatError(f"save_model: the model's parameters do not match config.model "
                        f"(e.g. {diff}); pass the config the model was built with")
  dtype = dtype or str(np.dtype(params["embed_VD"].dtype))
  tok_files, tok = _tokenizer_files(config)
  # Ids the model cannot embed (the byte tokenizer's 256/257 beside a small vocab) are left out.
  bos, eos, pad = (i if i is not None and i < cfg.arch.vocab_size else None
                   for i in (tok.bos_id, tok.eos_id, getattr(tok, "pad_id", None)))
  hf = hf_export_config.from_jaxtrain_config(config, dtype=dtype, bos_id=bos, eos_id=eos,
                                             pad_id=pad, rope_spelling=rope_spelling)
  writer = jax.process_index() == 0
  if writer:
    _prepare_dir(path, overwrite)
  files = safetensors_writer.plan_files(_pending_tensors(params, cfg, dtype), max_file_bytes)
  names = safetensors_writer.file_names(len(files))
  for group, name in zip(files, names):
    safetensors_writer.write_safetensors(os.path.join(path, name), group, write=writer)
  written = list(names)
  if writer:
    if len(files) > 1:
      safetensors_writer.write_index(path, files, names)
      written.append(hf_weights.INDEX_FILE)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
      json.dump(hf, f, indent=2)
    written.append("config.json")
    for src in tok_files:
      name = "tokenizer.model" if src.endswith(".model") else os.path.basename(src)
      shutil.copyfile(src, os.path.join(path, name))
      written.append(name)
  return written

