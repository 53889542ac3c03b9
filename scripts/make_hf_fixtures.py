"""Regenerates tests/fixtures/hf_llama_*: tiny random transformers Llama models and their logits.

    pip install -e ".[parity]" && python scripts/make_hf_fixtures.py

The fixtures let CI (which installs no torch) check import parity against numbers transformers
computed: each directory holds what `save_pretrained` wrote (config.json, safetensors), fixed
`input_ids.npy`, transformers' float32 `logits.npy` and mean next-token `loss.npy`, and
`fixture_info.json` (versions, seed, what the case covers). Weights are drawn at std 0.1 and the
norm weights around 1 with spread 0.3, so that a wrong transpose or RoPE layout moves the logits
by far more than the 1e-4 tolerance.

  hf_llama_gqa_llama3:  GQA (4 query heads, 2 kv heads), llama3 RoPE scaling with
                        original_max_position_embeddings=16 and 40-token inputs, untied head,
                        sharded into several safetensors files with an index, a tiny
                        tokenizer.json; config in the transformers >= 5 spelling (rope_parameters).
  hf_llama_tied_legacy: MHA, tied embeddings, llama3 scaling written in the old spelling
                        (top-level rope_theta, rope_scaling with "type", torch_dtype); the logits
                        come from transformers reloading that rewritten config.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import tokenizers
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
VOCAB = 128
SEQ_LEN = 40


def random_model(seed: int, **config) -> LlamaForCausalLM:
  """A LlamaForCausalLM with weights ~ N(0, 0.1) and norm weights ~ 1 + N(0, 0.3)."""
  torch.manual_seed(seed)
  model = LlamaForCausalLM(LlamaConfig(**config)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.1)
  return model


def logits_and_loss(model: LlamaForCausalLM, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def write_case(name: str, model: LlamaForCausalLM, ids: np.ndarray, info: dict, *,
               max_shard_size: str | None = None, legacy_config: bool = False,
               tokenizer: tokenizers.Tokenizer | None = None) -> None:
  out = os.path.join(ROOT, name)
  shutil.rmtree(out, ignore_errors=True)
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(out, safe_serialization=True, **kwargs)
  os.remove(os.path.join(out, "generation_config.json"))  # not ours to test; keeps it small
  logits, loss = logits_and_loss(model, ids)
  if legacy_config:
    path = os.path.join(out, "config.json")
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")  # the oldest spelling of the key
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype")
    with open(path, "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2)
    # What transformers itself makes of the old spelling must be what the model computes.
    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
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
  with open(os.path.join(out, "fixture_info.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)
  size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
  print(f"{name}: {sorted(os.listdir(out))}, {size / 1024:.0f} KiB, loss {loss:.4f}")


def main():
  argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
  torch.set_default_dtype(torch.float32)
  common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                max_position_embeddings=64, rms_norm_eps=1e-5)
  llama3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16)
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ_LEN))

  gqa = random_model(1, num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters={**llama3, "rope_theta": 10000.0}, **common)
  write_case("hf_llama_gqa_llama3", gqa, ids,
             {"seed": 1, "covers": "GQA, llama3 RoPE past original_max_position_embeddings, "
                                   "untied head, sharded safetensors with index, tokenizer.json"},
             max_shard_size="40KB", tokenizer=tiny_tokenizer())

  tied = random_model(2, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                      rope_parameters={**llama3, "rope_theta": 500000.0}, **common)
  write_case("hf_llama_tied_legacy", tied, ids,
             {"seed": 2, "covers": "MHA, tied embeddings, legacy rope_theta + rope_scaling "
                                   "spelling, single safetensors file"},
             legacy_config=True)


if __name__ == "__main__":
  main()
