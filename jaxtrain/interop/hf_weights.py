"""Hugging Face tensors <-> jaxtrain parameters: the name/layout rules of every family,
and slice-wise reading of safetensors (the streaming writer is in safetensors_writer.py).

The rules are generated from the family's Features switches (models/features.py), never from a
table per family: the Llama rules, plus the q/k/v biases with `qkv_bias`, the per-head q/k norms
with `qk_norm`, and with `sandwich_norms` Gemma's four norms per layer (transformers'
post_attention_layernorm then normalizes the attention's output, and pre_feedforward_layernorm
is the norm before the MLP). Norm weights are copied as stored: a (1 + w) norm keeps its w.

Layouts are written in the shape-letter legend (V vocab, D model, H query heads, K kv heads,
E head dim, F mlp, X experts, M an expert's hidden size, and 1 for a reward model's one score).
A Hugging Face layout lists the tensor's dims separated by commas, each a run of letters merged
row-major: q_proj.weight is "HE,D", i.e. [H*E, D] with row h*E + e. Our layout
is the letters of our parameter's dims in order ("DHE" for wq_DHE). Converting is a reshape and a
transpose and nothing else: our rotary embedding rotates pairs (i, i + E/2) exactly as
transformers' `rotate_half` does, so q/k rows need no permutation (the parity tests check it).

An MoE layer's experts are one tensor per expert and projection in the checkpoint
(`...experts.{j}.gate_proj.weight`, "M,D") and one stacked parameter here (`w_gate_XDF`): a
rule with `{j}` in its name maps expert j to row j of our leading X dim.

Import never holds a whole tensor it does not need: `read_block` reads only the rows and columns
one device's shard covers, through safetensors' lazy `get_slice`, one layer at a time. Export
writes each file's header first (every shape is known up front) and then streams tensors into it
one at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os

import numpy as np

from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.models import registry
from jaxtrain.models.features import ExpertNames, Features


@dataclasses.dataclass(frozen=True)
class TensorRule:
  """One Hugging Face tensor and the parameter it becomes."""
  hf_name: str  # "{i}" stands for the layer index
  ours: tuple[str, ...]  # parameter path (inside a block for per-layer tensors)
  hf_layout: str  # e.g. "HE,D"
  our_layout: str  # e.g. "DHE"
  # Latent attention: the letter of our layout whose last P entries the checkpoint stores in
  # the interleaved RoPE order (pairs (2i, 2i + 1)); ours are rotate-half's (i, i + P/2).
  rope_letter: str = ""

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf_name

  @property
  def per_expert(self) -> bool:
    """One tensor per expert ({j}); our parameter has a leading X dim before `our_layout`."""
    return "{j}" in self.hf_name


SCORE_NAME = "score.weight"
# Outside the layers, every family. Linear weights are [out, in] in transformers, [in, out] here.
TOP_RULES = (
    TensorRule("model.embed_tokens.weight", ("embed_VD",), "V,D", "VD"),
    TensorRule("model.norm.weight", ("final_norm", "scale"), "D", "D"),
    TensorRule("lm_head.weight", ("head_DV",), "V,D", "DV"),  # absent when tied
    # A reward model's score head in place of lm_head (*ForSequenceClassification, num_labels 1;
    # the size letter "1" is its one output).
    TensorRule(SCORE_NAME, ("score_D1",), "1,D", "D1"),
)


def latent_attention_rules(q_lora: bool) -> list[TensorRule]:
  """Multi-head latent attention's tensors (models/mla.py), DeepSeek-V3's names: the query
  bottleneck (or one query projection without `q_lora`), the latent with the RoPE key, its
  norm, the keys' and values' up-projection, the output."""
  attn = "model.layers.{i}.self_attn."
  if q_lora:
    rules = [TensorRule(attn + "q_a_proj.weight", ("attn", "wq_a_DQ"), "Q,D", "DQ"),
             TensorRule(attn + "q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), "Q", "Q"),
             TensorRule(attn + "q_b_proj.weight", ("attn", "wq_b_QHE"), "HE,Q", "QHE", "E")]
  else:
    rules = [TensorRule(attn + "q_proj.weight", ("attn", "wq_DHE"), "HE,D", "DHE", "E")]
  return rules + [
      TensorRule(attn + "kv_a_proj_with_mqa.weight", ("attn", "wkv_a_DA"), "A,D", "DA", "A"),
      TensorRule(attn + "kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), "R", "R"),
      TensorRule(attn + "kv_b_proj.weight", ("attn", "wkv_b_RHB"), "HB,R", "RHB"),
      TensorRule(attn + "o_proj.weight", ("attn", "wo_HUD"), "D,HU", "HUD"),
  ]


def layer_rules(features: Features, experts: ExpertNames | None = None,
                latent: bool | None = None) -> tuple[TensorRule, ...]:
  """One layer's tensors for a family's switches (q, k, v, o first, in this order); `experts`:
  an MoE layer's, named as the family's checkpoint names them; `latent`: latent attention's
  instead of q, k, v, o (True: with the query bottleneck, False: without)."""
  attn, layer = "model.layers.{i}.self_attn.", "model.layers.{i}."
  if latent is None:
    rules = [
        TensorRule(attn + "q_proj.weight", ("attn", "wq_DHE"), "HE,D", "DHE"),
        TensorRule(attn + "k_proj.weight", ("attn", "wk_DKE"), "KE,D", "DKE"),
        TensorRule(attn + "v_proj.weight", ("attn", "wv_DKE"), "KE,D", "DKE"),
        TensorRule(attn + "o_proj.weight", ("attn", "wo_HED"), "D,HE", "HED"),
    ]
  else:
    rules = latent_attention_rules(latent)
  if features.qkv_bias:
    rules += [TensorRule(attn + "q_proj.bias", ("attn", "bq_HE"), "HE", "HE"),
              TensorRule(attn + "k_proj.bias", ("attn", "bk_KE"), "KE", "KE"),
              TensorRule(attn + "v_proj.bias", ("attn", "bv_KE"), "KE", "KE")]
  if features.qk_norm:
    rules += [TensorRule(attn + "q_norm.weight", ("attn", "q_norm", "scale"), "E", "E"),
              TensorRule(attn + "k_norm.weight", ("attn", "k_norm", "scale"), "E", "E")]
  if experts is None:
    rules += [
        TensorRule(layer + "mlp.gate_proj.weight", ("mlp", "w_gate_DF"), "F,D", "DF"),
        TensorRule(layer + "mlp.up_proj.weight", ("mlp", "w_up_DF"), "F,D", "DF"),
        TensorRule(layer + "mlp.down_proj.weight", ("mlp", "w_down_FD"), "D,F", "FD"),
    ]
  else:
    block = f"{layer}{experts.block}."
    each = block + "experts.{j}."
    rules += [
        TensorRule(f"{block}{experts.router}.weight", ("mlp", "router_DX"), "X,D", "DX"),
        TensorRule(f"{each}{experts.gate}.weight", ("mlp", "w_gate_XDF"), "M,D", "DM"),
        TensorRule(f"{each}{experts.up}.weight", ("mlp", "w_up_XDF"), "M,D", "DM"),
        TensorRule(f"{each}{experts.down}.weight", ("mlp", "w_down_XFD"), "D,M", "MD"),
    ]
    if experts.router_bias:
      rules.append(TensorRule(f"{block}{experts.router}.{experts.router_bias}",
                              ("mlp", "router_bias_X"), "X", "X"))
    if experts.shared:
      shared = f"{block}{experts.shared}."
      rules += [
          TensorRule(shared + "gate_proj.weight", ("mlp", "shared", "w_gate_DF"), "S,D", "DS"),
          TensorRule(shared + "up_proj.weight", ("mlp", "shared", "w_up_DF"), "S,D", "DS"),
          TensorRule(shared + "down_proj.weight", ("mlp", "shared", "w_down_FD"), "D,S", "SD"),
      ]
  rules.append(TensorRule(layer + "input_layernorm.weight", ("attn_norm", "scale"), "D", "D"))
  if features.sandwich_norms:
    rules += [
        TensorRule(layer + "post_attention_layernorm.weight", ("post_attn_norm", "scale"), "D",
                   "D"),
        TensorRule(layer + "pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), "D", "D"),
        TensorRule(layer + "post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), "D",
                   "D"),
    ]
  else:
    rules.append(TensorRule(layer + "post_attention_layernorm.weight", ("mlp_norm", "scale"),
                            "D", "D"))
  return tuple(rules)


# Llama's (no switch on).
LAYER_RULES = layer_rules(Features())


@dataclasses.dataclass(frozen=True)
class Naming:
  """Where a checkpoint keeps the decoder's tensors: the prefix standing for "model.", the output
  head's name, and the prefixes of other towers (a multimodal checkpoint's), which are skipped."""
  body: str
  head: str = "lm_head.weight"
  others: tuple[str, ...] = ()

  def stored(self, name: str) -> str:
    """The name in the file of a rule's tensor name (a *ForSequenceClassification's score.weight,
    outside the decoder, as it is)."""
    if name == "lm_head.weight":
      return self.head
    return self.body + name.removeprefix("model.") if name.startswith("model.") else name


# Tensors of a multimodal checkpoint outside its language model (Gemma 3's SigLIP tower and its
# projector), under either naming.
MULTIMODAL_OTHERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
NAMINGS = (
    Naming("model."),  # *ForCausalLM
    Naming(""),  # a bare *Model: no "model." prefix, no head
    # Gemma3ForConditionalGeneration as save_pretrained writes it (and the hub's checkpoints).
    Naming("language_model.model.", "language_model.lm_head.weight", MULTIMODAL_OTHERS),
    # ... and as its modules are named since transformers 4.52.
    Naming("model.language_model.", "lm_head.weight", MULTIMODAL_OTHERS),
)

# Buffers some older exports carry; recomputed from the config, never read.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def sizes_of(cfg) -> dict[str, int]:
  """Shape-letter sizes of a ModelConfig."""
  a = cfg.arch
  p = a.qk_rope_head_dim
  return {"V": a.vocab_size, "D": a.d_model, "C": 2 * a.d_model, "H": a.num_heads,
          "K": a.num_kv_heads, "1": 1,  # a reward model's one score (score.weight [1, D])
          "E": a.head_dim, "F": a.mlp_dim, "X": a.num_experts, "M": a.expert_dim,
          "S": a.num_shared_experts * a.expert_dim,
          # Latent attention (models/mla.py).
          "Q": a.q_lora_rank, "R": a.kv_lora_rank, "P": p, "U": a.v_head_dim,
          "A": a.kv_lora_rank + p, "B": a.head_dim - p + a.v_head_dim}


def _rope_order(size: int, rope: int) -> np.ndarray:
  """Index map of a dim whose last `rope` entries are RoPE dims: ours[j] = checkpoint's[order[j]]
  (the interleaved pairs' first members, then their second members)."""
  start = size - rope
  return np.concatenate([np.arange(start), start + np.arange(0, rope, 2),
                         start + np.arange(1, rope, 2)])


def hf_shape(rule: TensorRule, sizes: dict[str, int]) -> tuple[int, ...]:
  return tuple(math.prod(sizes[c] for c in group) for group in rule.hf_layout.split(","))


def our_shape(rule: TensorRule, sizes: dict[str, int]) -> tuple[int, ...]:
  return tuple(sizes[c] for c in rule.our_layout)


def tensor_name(rule: TensorRule, layer: int | None = None, expert: int | None = None) -> str:
  return rule.hf_name.format(i=layer, j=expert)


def tensor_names(rule: TensorRule, layer: int | None, num_experts: int) -> list[str]:
  """The checkpoint's names of a rule's tensors in `layer` (every expert's, for an expert rule)."""
  if rule.per_expert:
    return [tensor_name(rule, layer, j) for j in range(num_experts)]
  return [tensor_name(rule, layer)]


def top_rules(cfg) -> tuple[TensorRule, ...]:
  """The tensors outside the layers: the output head (none when the embeddings are tied), or a
  reward model's score head in its place."""
  score = cfg.arch.score_head
  return tuple(r for r in TOP_RULES
               if not (r.ours == ("head_DV",) and (score or cfg.arch.tie_embeddings))
               and not (r.ours == ("score_D1",) and not score))


def _block_rules(cfg, moe: bool) -> tuple[TensorRule, ...]:
  a = cfg.arch
  return layer_rules(a.features, registry.get(a.family).hf_experts if moe else None,
                     bool(a.q_lora_rank) if a.kv_lora_rank else None)


def rules_of_layer(cfg, layer: int) -> tuple[TensorRule, ...]:
  """Layer `layer`'s tensors: the dense layer's, or an MoE layer's as its family names them."""
  return _block_rules(cfg, cfg.arch.moe_layers()[layer])


def prediction_module_rules(cfg) -> tuple[TensorRule, ...]:
  """One multi-token-prediction module's tensors (models/mtp.py) as DeepSeek-V3's checkpoints
  store module k: layer num_hidden_layers + k, holding a decoder layer's tensors (an MoE
  layer's when the model has experts) beside enorm, hnorm, eh_proj and shared_head.norm (our
  post_norm). Our paths are inside the module (Decoder.mtp[k])."""
  layer = "model.layers.{i}."
  block = tuple(dataclasses.replace(r, ours=("block",) + r.ours)
                for r in _block_rules(cfg, bool(cfg.arch.num_experts)))
  return (TensorRule(layer + "enorm.weight", ("enorm", "scale"), "D", "D"),
          TensorRule(layer + "hnorm.weight", ("hnorm", "scale"), "D", "D"),
          # [D, 2D] in the checkpoint: the embedding's half of the input first.
          TensorRule(layer + "eh_proj.weight", ("eh_proj_CD",), "D,C", "CD"),
          *block,
          TensorRule(layer + "shared_head.norm.weight", ("post_norm", "scale"), "D", "D"))


def prediction_module_copies(cfg) -> tuple[TensorRule, ...]:
  """The shared embedding and output head, which DeepSeek-V3's checkpoints store again in every
  prediction layer (inference engines that draft tokens with it read them there): written on
  export, shape-checked and never read on import. Our paths are the model's top-level ones."""
  layer = "model.layers.{i}."
  head = (TensorRule(layer + "shared_head.head.weight", ("embed_VD",), "V,D", "VD")
          if cfg.arch.tie_embeddings else
          TensorRule(layer + "shared_head.head.weight", ("head_DV",), "V,D", "DV"))
  return (TensorRule(layer + "embed_tokens.weight", ("embed_VD",), "V,D", "VD"), head)


def stored_prediction_modules(names, cfg, declared: int) -> int:
  """How many of the `declared` prediction layers (config.json num_nextn_predict_layers) the
  checkpoint holds, in order: checkpoints re-saved by transformers, whose model has none, keep
  the declaration but not the layer."""
  names = set(names)
  naming = naming_of(names)
  count = 0
  while count < declared and naming.stored(
      f"model.layers.{cfg.arch.num_layers + count}.eh_proj.weight") in names:
    count += 1
  return count


def rules_for(cfg) -> tuple[TensorRule, ...]:
  """Every rule of the model: the top ones, then each distinct layer kind's."""
  rules = list(top_rules(cfg))
  for layer in range(cfg.arch.num_layers):
    rules += [r for r in rules_of_layer(cfg, layer) if r not in rules]
  if cfg.arch.mtp_depth:
    rules += prediction_module_rules(cfg)
  return tuple(rules)


def read_block(tensor_slice, rule: TensorRule, sizes: dict[str, int],
               our_slices: dict[str, slice]) -> np.ndarray:
  """The block of our parameter selected by `our_slices` (letter -> slice with step 1), in our
  layout, read from a lazy Hugging Face tensor (`safe_open(...).get_slice(name)`).

  For a merged HF dim such as "HE", the outer letter's range selects a contiguous run of rows
  (whole inner extents); the inner letters are then cut in memory. Head dim, the only inner
  letter, is never sharded, so in practice exactly the needed rows are read.
  """
  groups = rule.hf_layout.split(",")
  read, inner_cuts = [], []
  for group in groups:
    outer = our_slices[group[0]]
    inner = math.prod(sizes[c] for c in group[1:])
    read.append(slice(outer.start * inner, outer.stop * inner))
    inner_cuts += [slice(None)] + [our_slices[c] for c in group[1:]]
  block = np.asarray(tensor_slice[tuple(read)])
  split = [our_slices[group[0]].stop - our_slices[group[0]].start if j == 0 else sizes[c]
           for group in groups for j, c in enumerate(group)]
  block = block.reshape(split)[tuple(inner_cuts)]
  letters = "".join(groups)
  block = block.transpose([letters.index(c) for c in rule.our_layout])
  if rule.rope_letter:
    # Never sharded (head_dim and latent dims are whole on every device): the full dim is here.
    axis = rule.our_layout.index(rule.rope_letter)
    assert block.shape[axis] == sizes[rule.rope_letter], (rule.hf_name, block.shape)
    block = np.take(block, _rope_order(sizes[rule.rope_letter], sizes["P"]), axis=axis)
  return block


def to_hf_layout(x: np.ndarray, rule: TensorRule, sizes: dict[str, int]) -> np.ndarray:
  """Our whole (per-layer) parameter in the Hugging Face tensor's layout."""
  letters = rule.hf_layout.replace(",", "")
  if rule.rope_letter:
    order = _rope_order(sizes[rule.rope_letter], sizes["P"])
    x = np.take(x, np.argsort(order), axis=rule.our_layout.index(rule.rope_letter))
  return x.transpose([rule.our_layout.index(c) for c in letters]).reshape(hf_shape(rule, sizes))


class SafetensorsReader(contextlib.AbstractContextManager):
  """Lazy access to a Hugging Face directory's safetensors, single-file or sharded with an index.

  Files are opened (memory-mapped) once and kept open; nothing is read until a slice is asked for.
  Pickle weights (`.bin`, `.pt`, ...) are refused: unpickling can run arbitrary code.
  """

  def __init__(self, directory: str):
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel

    self.directory = directory
    index_path = os.path.join(directory, INDEX_FILE)
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(index_path):
      try:
        with open(index_path, encoding="utf-8") as f:
          weight_map = json.load(f)["weight_map"]
      except (OSError, ValueError, KeyError, TypeError) as e:
        raise HFFormatError(f"{index_path}: cannot read its weight_map "
                            f"({type(e).__name__}: {e})") from e
    elif os.path.isfile(single):
      weight_map = None
    else:
      others = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
      if len(others) == 1:
        single, weight_map = others[0], None
      else:
        pickles = sorted(os.path.basename(p) for pat in PICKLE_PATTERNS
                         for p in glob.glob(os.path.join(directory, pat)))
        if pickles:
          raise HFFormatError(f"{directory}: weights are pickle files ({', '.join(pickles[:3])}); "
                              f"convert to safetensors first; pickle files can run code, so "
                              f"jaxtrain does not load them")
        what = (f"{len(others)} .safetensors files but no {INDEX_FILE}" if others
                else "no model.safetensors")
        raise HFFormatError(f"{directory}: {what}; expected {SINGLE_FILE} or sharded "
                            f"model-*-of-*.safetensors with {INDEX_FILE}")
    self._stack = contextlib.ExitStack()
    self._files = {}

    def open_file(path):
      try:
        return self._stack.enter_context(safe_open(path, framework="numpy"))
      except Exception as e:  # safetensors raises its own error types for a bad header
        self._stack.close()
        raise HFFormatError(f"{path}: not a readable safetensors file "
                            f"({type(e).__name__}: {e})") from e

    if weight_map is None:
      handle = self._files[single] = open_file(single)
      self._where = {name: single for name in handle.keys()}
    else:
      self._where = {}
      for name, file in weight_map.items():
        path = os.path.join(directory, file)
        if path not in self._files:
          if not os.path.isfile(path):
            self._stack.close()
            raise HFFormatError(f"{index_path}: names {file} for {name}, which is missing")
          self._files[path] = open_file(path)
        self._where[name] = path

  def __exit__(self, *exc):
    self._stack.close()

  def names(self) -> list[str]:
    return list(self._where)

  def get_slice(self, name: str):
    return self._files[self._where[name]].get_slice(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.get_slice(name).get_shape())


def naming_of(names) -> Naming:
  """The naming whose embedding table the checkpoint holds (else the *ForCausalLM one, which
  the missing-tensor message then names)."""
  names = set(names)
  for naming in NAMINGS:
    if naming.stored("model.embed_tokens.weight") in names:
      return naming
  return NAMINGS[0]


def check_tensors(reader: SafetensorsReader, cfg, declared_modules: int = 0) -> Naming:
  """Checks names and shapes against the model before anything is read; returns where the
  checkpoint keeps them (Naming: "model." names, a bare *Model's, a multimodal checkpoint's).

  `declared_modules`: the multi-token-prediction layers config.json declares
  (num_nextn_predict_layers), stored after the decoder's layers. The model's `mtp_depth`
  first of them are read; the rest are left out."""
  names = set(reader.names())
  naming = naming_of(names)
  sizes = sizes_of(cfg)
  a = cfg.arch
  if a.mtp_depth > declared_modules:
    raise HFFormatError(f"{reader.directory}: model.mtp_depth={a.mtp_depth}, but the checkpoint "
                        f"declares {declared_modules} multi-token-prediction layer(s) (config.json "
                        f"num_nextn_predict_layers); import with mtp_depth <= {declared_modules}")
  expected = {naming.stored(tensor_name(rule)): hf_shape(rule, sizes) for rule in top_rules(cfg)}
  for layer in range(a.num_layers):
    for rule in rules_of_layer(cfg, layer):
      for name in tensor_names(rule, layer, a.num_experts):
        expected[naming.stored(name)] = hf_shape(rule, sizes)
  copies = {}
  for k in range(a.mtp_depth):
    for rule in prediction_module_rules(cfg):
      for name in tensor_names(rule, a.num_layers + k, a.num_experts):
        expected[naming.stored(name)] = hf_shape(rule, sizes)
    copies.update({naming.stored(tensor_name(rule, a.num_layers + k)): hf_shape(rule, sizes)
                   for rule in prediction_module_copies(cfg)})
  missing = sorted(set(expected) - names)
  if missing:
    hint = ""
    if missing == [naming.head] and SCORE_NAME in names:
      hint = (f" (the file holds {SCORE_NAME}: a *ForSequenceClassification's score head; "
              f"config.json architectures should name one)")
    elif missing == [naming.head]:
      hint = " (config.json says tie_word_embeddings=false; the file has no output head)"
    elif missing == [SCORE_NAME]:
      hint = (" (config.json architectures names a *ForSequenceClassification; the file has no "
              "score head)")
    raise HFFormatError(f"{reader.directory}: tensors missing from the safetensors: "
                        f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}{hint}")
  tolerated = set(copies) | ({naming.head} if a.tie_embeddings else set())
  skipped = tuple(naming.stored(f"model.layers.{a.num_layers + k}.")
                  for k in range(a.mtp_depth, declared_modules))
  unexpected = sorted(n for n in names - set(expected) - tolerated
                      if not n.endswith(IGNORED_SUFFIXES) and not n.startswith(naming.others)
                      and not (skipped and n.startswith(skipped)))
  if unexpected:
    what = ("architectures (a score head is a *ForSequenceClassification's)"
            if SCORE_NAME in unexpected else "model_type, biases, layer count")
    raise HFFormatError(f"{reader.directory}: tensors this {a.family} config has no place "
                        f"for: {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}"
                        f"; check config.json ({what})")
  for name, shape in list(expected.items()) + [(n, s) for n, s in copies.items() if n in names]:
    got = reader.shape(name)
    if got != shape:
      raise HFFormatError(f"{reader.directory}: tensor {name} has shape {list(got)}, config.json "
                          f"implies {list(shape)}")
  return naming
