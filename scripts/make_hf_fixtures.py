"""Regenerates tests/fixtures/hf_llama_*: tiny random transformers Llama models and their logits.

The tests (tests/test_hf_interop.py) need neither torch nor transformers: these fixtures carry
what transformers computed. To regenerate them, in a virtual environment of its own (the
project's own .venv needs no torch):

    python3 -m venv /tmp/parity && /tmp/parity/bin/pip install -e ".[parity]"
    /tmp/parity/bin/python scripts/make_hf_fixtures.py

(CPU wheels: add --extra-index-url https://download.pytorch.org/whl/cpu to the pip install.)
Then run tests/test_hf_interop.py and commit tests/fixtures/. Rerun it when jaxtrain's export
(jaxtrain/interop/hf_config.py) changes what it writes: the export_config.*.json it keeps are
the config files transformers was checked to load.

Each directory holds what `save_pretrained` wrote (config.json, safetensors), fixed
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
  hf_llama_mha_default_rope:   MHA, untied head, default RoPE (no scaling), 48-token inputs.
  hf_llama_tied_gqa_default_rope: GQA (4/2), tied embeddings, default RoPE, 48-token inputs.
  hf_llama_gqa8_head_dim_llama3:  GQA 8/2 with head_dim 8 (8 x 8 = 64 attention width over a
                        hidden size of 32), llama3 RoPE (factor 8, theta 5e5) with 48-token inputs
                        past original_max_position_embeddings=16, sharded with an index. Also the
                        round trip: jaxtrain imports it and exports it (sharded, in each rope
                        spelling); transformers loads each export and must compute the source's
                        logits (within 1e-4: the error is in fixture_info.json's "round_trip"),
                        and the config.json it loaded is kept as export_config.SPELLING.json,
                        which the tests require jaxtrain's export to write again.
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


# The cases of the former live tests, as fixtures: MHA with default RoPE, GQA 8/2 with an
# explicit head_dim and llama3 RoPE over 48 tokens, GQA with tied embeddings.
LLAMA3_LONG = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500000.0}
MORE_CASES = {
    "hf_llama_mha_default_rope": (
        dict(num_attention_heads=4, num_key_value_heads=4),
        "MHA, untied head, default RoPE (no scaling), 48 tokens"),
    "hf_llama_gqa8_head_dim_llama3": (
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
             rope_parameters=LLAMA3_LONG),
        "GQA 8/2, head_dim 8 (attention width 64 over hidden 32), llama3 RoPE factor 8 theta 5e5 "
        "past original_max_position_embeddings=16 (48 tokens), sharded safetensors with index; "
        "round trip through jaxtrain's export in both rope spellings"),
    "hf_llama_tied_gqa_default_rope": (
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "GQA 4/2, tied embeddings, default RoPE, 48 tokens"),
}
ROUND_TRIP = "hf_llama_gqa8_head_dim_llama3"
LOGIT_TOL = 1e-4


def round_trip(name: str, ids: np.ndarray, want_logits: np.ndarray) -> dict:
  """jaxtrain imports fixture `name` and exports it in each rope spelling (sharded, as the test
  does); transformers loads each export and computes the source's logits; the config.json it
  loaded is kept beside the fixture. Returns what fixture_info.json records of it."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from jaxtrain.interop import hf, hf_config  # pylint: disable=import-outside-toplevel
  out = os.path.join(ROOT, name)
  model, config = hf.load_model(out)
  info = {}
  for spelling in hf_config.ROPE_SPELLINGS:
    with tempfile.TemporaryDirectory() as tmp:
      hf.save_model(model, config, tmp, max_file_bytes=40_000, rope_spelling=spelling)
      assert os.path.isfile(os.path.join(tmp, "model.safetensors.index.json"))
      reloaded = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
      logits, _ = logits_and_loss(reloaded, ids)
      err = float(np.abs(logits - want_logits).max())
      assert err <= LOGIT_TOL, f"round trip ({spelling}): max abs logit error {err:.3e}"
      rope = dict(reloaded.config.rope_parameters)
      assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 16
      shutil.copyfile(os.path.join(tmp, "config.json"),
                      os.path.join(out, f"export_config.{spelling}.json"))
    info[spelling] = {"max_abs_logit_error": err, "rope_parameters": rope}
    print(f"{name}: round trip ({spelling}): max abs logit error {err:.3e}")
  return info


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

  long_ids = np.random.default_rng(1).integers(0, VOCAB, (2, 48))  # 48 > original 16
  for name, (config, covers) in MORE_CASES.items():
    model = random_model(3, **{**common, **config})
    sharded = name == ROUND_TRIP
    write_case(name, model, long_ids, {"seed": 3, "covers": covers},
               max_shard_size="30KB" if sharded else None)
    if sharded:
      logits, _ = logits_and_loss(model, long_ids)
      path = os.path.join(ROOT, name, "fixture_info.json")
      with open(path, encoding="utf-8") as f:
        info = json.load(f)
      info["round_trip"] = round_trip(name, long_ids, logits)
      with open(path, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)


if __name__ == "__main__":
  main()
