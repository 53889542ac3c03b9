"""What every case of scripts/make_hf_fixtures.py shares: random transformers models with weights
large enough that a wiring error shows, their logits, and writing a case's directory (with the
reload that checks it).

"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
VOCAB = 128
SEQ_LEN = 40


def random_hf_model(seed: int, model_cls, config, norm_center: float = 1.0):
  """A `model_cls(config)` with weights and biases ~ N(0, 0.1) and norm weights ~ norm_center +
  N(0, 0.3) (those of a SigLIP vision tower, plain LayerNorms, around 1 whatever norm_center)."""
  torch.manual_seed(seed)
  model = model_cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if re.search(r"norm\d*\.weight$", name):
        center = 1.0 if "vision_tower" in name else norm_center
        p.copy_(center + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.1)
  return model


def random_model(seed: int, **config) -> LlamaForCausalLM:
  """A LlamaForCausalLM with weights ~ N(0, 0.1) and norm weights ~ 1 + N(0, 0.3)."""
  return random_hf_model(seed, LlamaForCausalLM, LlamaConfig(**config))


def logits_and_loss(model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  with torch.no_grad():
    out = model(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids, dtype=torch.long))
  return out.logits.float().numpy(), np.float32(out.loss.item())


def tiny_tokenizer() -> tokenizers.Tokenizer:
  """A word-level tokenizer over VOCAB ids: <s>, </s>, <unk>, then "w3" ... "w127"."""
  vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
  vocab.update({f"w{i}": i for i in range(3, VOCAB)})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<s>", "</s>"])
  return tok


def llama_legacy_spelling(config: dict) -> dict:
  """Llama's config.json as transformers < 5 wrote it: top-level rope_theta, rope_scaling with the
  oldest key "type", torch_dtype."""
  rope = config.pop("rope_parameters")
  config["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")  # the oldest spelling of the key
  config["rope_scaling"] = rope
  config["torch_dtype"] = config.pop("dtype")
  return config


def is_eager(model) -> bool:
  return model.config._attn_implementation == "eager"  # pylint: disable=protected-access


def reload_kwargs(model) -> dict:
  return {"attn_implementation": "eager"} if is_eager(model) else {}


def saved_tensor_names(out: str) -> list[str]:
  names = []
  for n in sorted(os.listdir(out)):
    if n.endswith(".safetensors"):
      with safetensors.safe_open(os.path.join(out, n), "pt") as f:
        names.extend(f.keys())
  return sorted(names)


def verify_reload(out: str, model, ids: np.ndarray, logits: np.ndarray) -> dict:
  """AutoModelForCausalLM loads `out` back (eager attention) into exactly `logits`, with the text
  config's layer_types and rope_parameters as built. Returns what fixture_info.json records."""
  reloaded = AutoModelForCausalLM.from_pretrained(out, **reload_kwargs(model)).eval()
  got, _ = logits_and_loss(reloaded, ids)
  assert np.array_equal(got, logits), f"{out}: reloaded logits off by {np.abs(got - logits).max()}"
  want, text = model.config.get_text_config(), reloaded.config.get_text_config()
  for key in ("layer_types", "rope_parameters", "sliding_window", "head_dim",
              "tie_word_embeddings"):
    assert getattr(text, key, None) == getattr(want, key, None), (
        f"{out}: transformers reloads {key}={getattr(text, key, None)!r}, "
        f"built with {getattr(want, key, None)!r}")
  names = saved_tensor_names(out)
  layer0 = [n for n in names if re.search(r"(^|\.)layers\.0\.", n)
            and "vision_tower" not in n]
  return {"class": type(reloaded).__name__, "logits_exact": True,
          "layer_types": getattr(text, "layer_types", None),
          "rope_parameters": getattr(text, "rope_parameters", None),
          "sliding_window": getattr(text, "sliding_window", None),
          "tensors_outside_layers": [n for n in names if ".layers." not in n
                                     and "vision_tower" not in n],
          "layer0_tensors": layer0}


def write_case(name: str, model, ids: np.ndarray, info: dict, *,
               max_shard_size: str | None = None, legacy_config: bool = False,
               rewrite_config: Callable[[dict], dict] | None = None, verify: bool = False,
               tokenizer: tokenizers.Tokenizer | None = None) -> dict:
  """Saves `model` as fixture `name`. legacy_config: rewrite config.json to Llama's legacy
  spelling, or with `rewrite_config`; the logits must stay those of transformers reloading it.
  verify: check the directory loads back (verify_reload) and record it as info["reload"]."""
  out = os.path.join(ROOT, name)
  shutil.rmtree(out, ignore_errors=True)
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(out, safe_serialization=True, **kwargs)
  os.remove(os.path.join(out, "generation_config.json"))  # not ours to test; keeps it small
  logits, loss = logits_and_loss(model, ids)
  if legacy_config and rewrite_config is None:
    rewrite_config = llama_legacy_spelling
  if rewrite_config is not None:
    path = os.path.join(out, "config.json")
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
    config = rewrite_config(config)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2)
    # What transformers itself makes of the old spelling must be what the model computes.
    reloaded = type(model).from_pretrained(out, **reload_kwargs(model)).eval()
    logits_reloaded, _ = logits_and_loss(reloaded, ids)
    assert np.array_equal(logits, logits_reloaded), "transformers reads the legacy config otherwise"
  if tokenizer is not None:
    tokenizer.save(os.path.join(out, "tokenizer.json"))
  np.save(os.path.join(out, "input_ids.npy"), ids.astype(np.int32))
  np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
  np.save(os.path.join(out, "loss.npy"), loss)
  info = {**info, "transformers": transformers.__version__, "torch": torch.__version__,
          "input_shape": list(ids.shape), "logits_abs_max": float(np.abs(logits).max()),
          "loss": float(loss)}
  if verify:
    info["reload"] = verify_reload(out, model, ids, logits)
  with open(os.path.join(out, "fixture_info.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)
  size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
  print(f"{name}: {sorted(os.listdir(out))}, {size / 1024:.0f} KiB, loss {loss:.4f}")
  return info


# The cases of the former live tests, as fixtures: MHA with default RoPE, GQA 8/2 with an
# explicit head_dim and llama3 RoPE over 48 tokens, GQA with tied embeddings.
LOGIT_TOL = 1e-4


def ids_40() -> np.ndarray:
  return np.random.default_rng(0).integers(0, VOCAB, (2, SEQ_LEN))
