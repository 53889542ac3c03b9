"""Regenerates tests/fixtures/hf_*: tiny random transformers models and the logits they compute.

Llama, Qwen2, Qwen3, Mistral and Gemma 3 (text-only and multimodal).

The tests (tests/test_hf_interop.py, tests/test_hf_families.py) need neither torch nor transformers: these fixtures carry
what transformers computed. To regenerate them, in a virtual environment of its own (the
project's own .venv needs no torch):

    python3 -m venv /tmp/parity && /tmp/parity/bin/pip install -e ".[parity]"
    /tmp/parity/bin/python scripts/make_hf_fixtures.py                 # every case
    /tmp/parity/bin/python scripts/make_hf_fixtures.py --only hf_gemma3  # cases named hf_gemma3*
    /tmp/parity/bin/python scripts/make_hf_fixtures.py --check_exports   # transformers loads
                                                   # jaxtrain's export of every family fixture

(The logits of another CPU or torch build may differ in the last bits (~1e-6): regenerate only
the cases that changed, with --only.)
(CPU wheels: add --extra-index-url https://download.pytorch.org/whl/cpu to the pip install.)
Then run tests/test_hf_interop.py and commit tests/fixtures/. Rerun it when jaxtrain's export
(jaxtrain/interop/hf_config.py) changes what it writes: the export_config.*.json it keeps are
the config files transformers was checked to load.

Each directory holds what `save_pretrained` wrote (config.json, safetensors), fixed
`input_ids.npy`, transformers' float32 `logits.npy` and mean next-token `loss.npy`, and
`fixture_info.json` (versions, seed, what the case covers). Weights (biases included) are drawn at
std 0.1 and the norm weights around 1 with spread 0.3 (Gemma 3, whose norms compute x * (1 + w):
around 0), so that a wrong transpose or RoPE layout moves the logits by far more than the 1e-4
tolerance. The cases other than Llama run transformers' eager attention, check that each directory
loads back (AutoModelForCausalLM, eager) into exactly the stored logits, and record in
fixture_info.json's "wiring_sensitivity" how far a deliberate wiring change (a bias dropped, a norm
without its +1, a window ignored, ...) moves the logits: what a parity test at 1e-4 can see.

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

All the following: 2 rows of 40 tokens (vocab 128), float32, eager attention, hidden size 32.

  hf_qwen3_tied:        Qwen3ForCausalLM, GQA 4/2, explicit head_dim 16 (attention width 64 over
                        hidden 32), random q_norm/k_norm (per head, before RoPE), tied embeddings,
                        transformers >= 5 spelling (rope_parameters).
  hf_qwen3_untied:      the same family untied, rope_theta 1e6, config.json rewritten to the old
                        spelling (top-level rope_theta, rope_scaling null, no layer_types,
                        torch_dtype); logits from transformers reloading that rewritten directory.
  hf_qwen2_untied:      Qwen2ForCausalLM (q/k/v biases, random), GQA 4/2, head_dim 8, rope_theta
                        1e6, untied.
  hf_qwen2_tied:        the same with tied embeddings, rope_theta 1e4.
  hf_mistral_window:    MistralForCausalLM, sliding_window 16 < 40 tokens (fixture_info.json records
                        how far the logits are from the same model without a window), GQA 4/2,
                        explicit head_dim 16, rope_theta 1e6, untied.
  hf_mistral_tied:      MistralForCausalLM, sliding_window null, tied embeddings, head_dim 8.
  hf_gemma3_text:       Gemma3ForCausalLM (gemma3_text), GQA 4/2, head_dim 16, 6 layers with
                        layer_types sliding x2, full, sliding x2, full; sliding_window 8;
                        query_pre_attn_scalar 24 (not head_dim); RoPE per layer type (full:
                        linear factor 8, theta 1e6; sliding: default, theta 1e4); all norm weights
                        around 0 (x * (1 + w)); gelu_pytorch_tanh; no softcapping; tied.
  hf_gemma3_text_legacy: the same kind of model untied, with the default layer pattern (5 sliding,
                        then full), config.json rewritten to the transformers 4.5x spelling
                        (rope_theta, rope_local_base_freq, rope_scaling linear 8,
                        sliding_window_pattern 6, no layer_types, torch_dtype, cache_implementation
                        hybrid); logits from transformers reloading that directory, whose
                        layer_types and rope_parameters fixture_info.json records.
  hf_gemma3_multimodal: Gemma3ForConditionalGeneration (gemma3) with a text_config like
                        hf_gemma3_text's and a tiny SigLIP vision tower, tensors named as
                        save_pretrained writes them (fixture_info.json: the text prefix); the
                        logits of text-only inputs (ids below the image tokens 125-127), which must
                        equal those of a Gemma3ForCausalLM holding the same text weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
from typing import Callable

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from transformers import (AutoModelForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.activations import ACT2FN

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


LLAMA_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)


def ids_40() -> np.ndarray:
  return np.random.default_rng(0).integers(0, VOCAB, (2, SEQ_LEN))


def llama_gqa_llama3():
  gqa = random_model(1, num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters={**LLAMA3, "rope_theta": 10000.0}, **LLAMA_COMMON)
  write_case("hf_llama_gqa_llama3", gqa, ids_40(),
             {"seed": 1, "covers": "GQA, llama3 RoPE past original_max_position_embeddings, "
                                   "untied head, sharded safetensors with index, tokenizer.json"},
             max_shard_size="40KB", tokenizer=tiny_tokenizer())


def llama_tied_legacy():
  tied = random_model(2, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                      rope_parameters={**LLAMA3, "rope_theta": 500000.0}, **LLAMA_COMMON)
  write_case("hf_llama_tied_legacy", tied, ids_40(),
             {"seed": 2, "covers": "MHA, tied embeddings, legacy rope_theta + rope_scaling "
                                   "spelling, single safetensors file"},
             legacy_config=True)


def llama_more_case(name: str):
  config, covers = MORE_CASES[name]
  long_ids = np.random.default_rng(1).integers(0, VOCAB, (2, 48))  # 48 > original 16
  model = random_model(3, **{**LLAMA_COMMON, **config})
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


# ---- Qwen2, Qwen3, Mistral, Gemma 3: eager attention, checked reloads, wiring sensitivity ----

# A deliberate wiring change must move the logits by at least this (a parity test at LOGIT_TOL
# sees it with a wide margin).
MUST_MOVE = 100 * LOGIT_TOL
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64,
              rms_norm_eps=1e-6, attn_implementation="eager")


def logit_change(model, ids: np.ndarray, logits: np.ndarray, change: Callable) -> float:
  """Max abs difference between `logits` and those of a copy of `model` that `change` altered."""
  changed = copy.deepcopy(model)
  with torch.no_grad():
    change(changed)
  return float(np.abs(logits_and_loss(changed, ids)[0] - logits).max())


def sensitivity(model, ids: np.ndarray, changes: dict[str, Callable],
                informative: dict[str, Callable] | None = None) -> dict:
  """{description: max abs logit change} for each change; those in `changes` must exceed
  MUST_MOVE, those in `informative` are recorded only."""
  logits, _ = logits_and_loss(model, ids)
  out = {}
  for what, change in changes.items():
    out[what] = logit_change(model, ids, logits, change)
    assert out[what] > MUST_MOVE, f"{what}: logits move by only {out[what]:.3e}"
  for what, change in (informative or {}).items():
    out[what + " (informative)"] = logit_change(model, ids, logits, change)
  return out


def attns(model):
  return [layer.self_attn for layer in model.model.layers]


def rope_theta_read_as(theta: float, wrong: float) -> Callable:
  """The change: a single-RoPE model's inverse frequencies for base `wrong` instead of `theta`."""
  def change(m):
    rot = m.model.rotary_emb
    rot.inv_freq.copy_(rot.inv_freq.double().pow(math.log(wrong) / math.log(theta)).float())
  return change


def qwen_changes(theta: float) -> dict[str, Callable]:
  wrong = 1e6 if theta != 1e6 else 1e4
  return {f"rope_theta read as {wrong:g} instead of {theta:g}": rope_theta_read_as(theta, wrong)}


def qwen3_case(name: str, seed: int, tied: bool, theta: float, legacy: bool):
  config = Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": theta}, **COMMON)
  model = random_hf_model(seed, Qwen3ForCausalLM, config)

  def no_qk_norm_weights(m):
    for a in attns(m):
      a.q_norm.weight.fill_(1.0)
      a.k_norm.weight.fill_(1.0)

  def qk_norm_skipped(m):
    for a in attns(m):
      a.q_norm.weight.fill_(1.0)
      a.k_norm.weight.fill_(1.0)
      a.q_norm.forward = a.k_norm.forward = lambda x: x

  changes = {"q_norm/k_norm weights ignored (all 1)": no_qk_norm_weights,
             "q_norm/k_norm skipped": qk_norm_skipped, **qwen_changes(theta)}
  info = {"seed": seed, "family": "qwen3",
          "covers": (f"Qwen3ForCausalLM, GQA 4/2, explicit head_dim 16 over hidden 32 (attention "
                     f"width 64), random q_norm/k_norm (RMSNorm over head_dim, before RoPE), "
                     f"{'tied' if tied else 'untied'} embeddings, rope_theta {theta:g}, "
                     + ("config.json rewritten to the old spelling (top-level rope_theta, "
                        "rope_scaling null, no layer_types, torch_dtype); logits from "
                        "transformers reloading it" if legacy else
                        "config in the transformers >= 5 spelling (rope_parameters)")),
          "config_spelling": "legacy" if legacy else "rope_parameters",
          "wiring_sensitivity": sensitivity(model, ids_40(), changes)}
  write_case(name, model, ids_40(), info, verify=True,
             rewrite_config=qwen3_legacy_spelling if legacy else None)


def qwen3_legacy_spelling(config: dict) -> dict:
  """Qwen3's config.json as transformers 4.5x wrote it (e.g. Qwen/Qwen3-0.6B): top-level
  rope_theta, rope_scaling null, no layer_types, torch_dtype."""
  rope = config.pop("rope_parameters")
  assert rope["rope_type"] == "default", rope
  config["rope_theta"] = rope["rope_theta"]
  config["rope_scaling"] = None
  assert set(config.pop("layer_types")) == {"full_attention"}
  config["torch_dtype"] = config.pop("dtype")
  return config


def qwen2_case(name: str, seed: int, tied: bool, theta: float):
  config = Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": theta}, **COMMON)
  model = random_hf_model(seed, Qwen2ForCausalLM, config)

  def no_bias(proj):
    def change(m):
      for a in attns(m):
        getattr(a, proj).bias.zero_()
    return change

  changes = {f"{p} bias dropped": no_bias(p) for p in ("q_proj", "k_proj", "v_proj")}
  changes.update(qwen_changes(theta))
  info = {"seed": seed, "family": "qwen2",
          "covers": (f"Qwen2ForCausalLM, q/k/v projection biases (random, std 0.1; o_proj has "
                     f"none), GQA 4/2, head_dim 8, rope_theta {theta:g}, "
                     f"{'tied' if tied else 'untied'} embeddings"),
          "wiring_sensitivity": sensitivity(model, ids_40(), changes)}
  write_case(name, model, ids_40(), info, verify=True)


def mistral_case(name: str, seed: int, tied: bool, window: int | None, head_dim: int | None,
                 theta: float):
  config = MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, tie_word_embeddings=tied, sliding_window=window,
                         rope_parameters={"rope_type": "default", "rope_theta": theta}, **COMMON)
  model = random_hf_model(seed, MistralForCausalLM, config)
  changes = dict(qwen_changes(theta))
  info = {"seed": seed, "family": "mistral"}
  if window is not None:
    def no_window(m):
      m.config.sliding_window = None
    ids = ids_40()
    logits, _ = logits_and_loss(model, ids)
    info["max_abs_logit_diff_vs_no_window"] = logit_change(model, ids, logits, no_window)
    assert info["max_abs_logit_diff_vs_no_window"] > MUST_MOVE
    changes["sliding window ignored"] = no_window

    def window_one_wider(m):
      m.config.sliding_window = window + 1
    changes[f"window {window + 1} instead of {window} (off by one)"] = window_one_wider
  info["covers"] = (
      f"MistralForCausalLM, sliding_window {window}"
      + (f" (< {SEQ_LEN} tokens: the window matters)" if window else "")
      + f", GQA 4/2, head_dim {head_dim or 32 // 4}"
      + (" (explicit, attention width 64 over hidden 32)" if head_dim else "")
      + f", rope_theta {theta:g}, {'tied' if tied else 'untied'} embeddings")
  info["wiring_sensitivity"] = sensitivity(model, ids_40(), changes)
  write_case(name, model, ids_40(), info, verify=True)


# Gemma 3 text: RoPE per layer type as transformers 5 writes it.
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
GEMMA3_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                   query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                   final_logit_softcapping=None, attn_logit_softcapping=None,
                   max_position_embeddings=64, rms_norm_eps=1e-6)
PATTERN_3 = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma3_text_config(tied: bool, layer_types: list[str] | None) -> Gemma3TextConfig:
  return Gemma3TextConfig(**GEMMA3_TEXT, tie_word_embeddings=tied, layer_types=layer_types,
                          rope_parameters=copy.deepcopy(GEMMA3_ROPE),
                          attn_implementation="eager")


def gemma3_changes(text_model_of: Callable) -> tuple[dict, dict]:
  """Wiring changes of a Gemma 3 text model, `text_model_of(model)` its Gemma3TextModel."""
  def norms_without_one(m):
    for mod in text_model_of(m).modules():
      if type(mod).__name__ == "Gemma3RMSNorm":
        mod.weight.sub_(1.0)  # x * (1 + (w - 1)) = x * w

  def unscaled_embedding(m):
    text_model_of(m).embed_tokens.embed_scale.fill_(1.0)

  def head_dim_scale(m):
    for layer in text_model_of(m).layers:
      layer.self_attn.scaling = layer.self_attn.head_dim ** -0.5

  def no_window(m):
    text_model_of(m).config.sliding_window = 1000

  def window_one_wider(m):
    text_model_of(m).config.sliding_window += 1

  def all_sliding(m):
    config = text_model_of(m).config
    config.layer_types = ["sliding_attention"] * len(config.layer_types)

  def ropes_swapped(m):
    rot = text_model_of(m).rotary_emb
    full, local = rot.full_attention_inv_freq.clone(), rot.sliding_attention_inv_freq.clone()
    rot.full_attention_inv_freq.copy_(local)
    rot.sliding_attention_inv_freq.copy_(full)

  def linear_factor_ignored(m):
    text_model_of(m).rotary_emb.full_attention_inv_freq.mul_(8.0)

  def no_qk_norm(m):
    for layer in text_model_of(m).layers:
      layer.self_attn.q_norm.forward = layer.self_attn.k_norm.forward = lambda x: x

  def no_sandwich_norms(m):
    for layer in text_model_of(m).layers:
      layer.post_attention_layernorm.forward = lambda x: x
      layer.post_feedforward_layernorm.forward = lambda x: x

  def exact_gelu(m):
    for layer in text_model_of(m).layers:
      layer.mlp.act_fn = ACT2FN["gelu"]

  changes = {"norms x * w instead of x * (1 + w)": norms_without_one,
             "embedding not scaled by sqrt(hidden_size)": unscaled_embedding,
             "softmax scale head_dim**-0.5 instead of query_pre_attn_scalar**-0.5": head_dim_scale,
             "sliding window ignored": no_window,
             "sliding window one wider": window_one_wider,
             "every layer sliding_attention": all_sliding,
             "RoPE of the two layer types swapped": ropes_swapped,
             "linear RoPE factor 8 of full_attention layers ignored": linear_factor_ignored,
             "q_norm/k_norm skipped": no_qk_norm,
             "post_attention/post_feedforward norms skipped": no_sandwich_norms}
  informative = {"exact gelu instead of gelu_pytorch_tanh": exact_gelu}
  return changes, informative


def gemma3_legacy_spelling(config: dict) -> dict:
  """Gemma 3's text config.json as transformers 4.5x wrote it (e.g. google/gemma-3-1b-it, with
  the 4b's linear rope_scaling): top-level rope_theta and rope_local_base_freq, rope_scaling,
  sliding_window_pattern instead of layer_types, torch_dtype, cache_implementation."""
  rope = config.pop("rope_parameters")
  assert rope == GEMMA3_ROPE, rope
  config["rope_theta"] = rope["full_attention"]["rope_theta"]
  config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
  config["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
  layer_types = config.pop("layer_types")
  assert layer_types == ["sliding_attention"] * 5 + ["full_attention"], layer_types
  config.pop("_sliding_window_pattern")
  config["sliding_window_pattern"] = 6
  config.pop("use_bidirectional_attention")
  config["cache_implementation"] = "hybrid"
  config["torch_dtype"] = config.pop("dtype")
  return config


GEMMA3_TEXT_COVERS = (
    "GQA 4/2, head_dim 16 over hidden 32, 6 layers, sliding_window 8 (< 40 tokens), "
    "query_pre_attn_scalar 24 (softmax scale 24**-0.5, not head_dim**-0.5), RoPE per layer type "
    "(full_attention: linear factor 8, theta 1e6; sliding_attention: default, theta 1e4), every "
    "norm weight ~ N(0, 0.3) (x * (1 + w)), q_norm/k_norm, sandwich norms, embeddings scaled by "
    "sqrt(32), gelu_pytorch_tanh, no softcapping")


def gemma3_text_case(name: str, seed: int, legacy: bool):
  config = gemma3_text_config(tied=not legacy, layer_types=None if legacy else PATTERN_3)
  model = random_hf_model(seed, Gemma3ForCausalLM, config, norm_center=0.0)
  changes, informative = gemma3_changes(lambda m: m.model)
  if legacy:
    covers = ("Gemma3ForCausalLM (gemma3_text), untied, layer_types from sliding_window_pattern 6 "
              "(layers 0-4 sliding, 5 full), " + GEMMA3_TEXT_COVERS + "; config.json rewritten "
              "to the transformers 4.5x spelling (rope_theta, rope_local_base_freq, rope_scaling "
              "{rope_type linear, factor 8}, sliding_window_pattern 6, no layer_types, "
              "torch_dtype, cache_implementation hybrid); logits from transformers reloading it")
  else:
    covers = ("Gemma3ForCausalLM (gemma3_text), tied, layer_types sliding x2, full, sliding x2, "
              "full (config.json also carries transformers' _sliding_window_pattern 6, which "
              "layer_types overrides), " + GEMMA3_TEXT_COVERS)
  info = {"seed": seed, "family": "gemma3_text",
          "config_spelling": "legacy (transformers 4.5x)" if legacy else "rope_parameters",
          "covers": covers,
          "wiring_sensitivity": sensitivity(model, ids_40(), changes, informative)}
  info = write_case(name, model, ids_40(), info, verify=True,
                    rewrite_config=gemma3_legacy_spelling if legacy else None)
  if legacy:
    reload = info["reload"]
    assert reload["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert reload["rope_parameters"] == GEMMA3_ROPE, reload["rope_parameters"]


# Gemma 3 multimodal: image tokens at the top of the vocabulary, never among the inputs.
BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
SIGLIP_TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, image_size=8, patch_size=4, vision_use_head=False)


def gemma3_multimodal_case(name: str, seed: int):
  text = gemma3_text_config(tied=True, layer_types=PATTERN_3).to_dict()
  config = Gemma3Config(text_config=text, vision_config=SIGLIP_TINY, mm_tokens_per_image=4,
                        boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
                        tie_word_embeddings=True, attn_implementation="eager")
  model = random_hf_model(seed, Gemma3ForConditionalGeneration, config, norm_center=0.0)
  ids = np.random.default_rng(2).integers(0, BOI, (2, SEQ_LEN))
  assert ids.max() < BOI
  logits, _ = logits_and_loss(model, ids)
  # The text-only logits are those of a Gemma3ForCausalLM holding the same text weights.
  text_lm = Gemma3ForCausalLM(model.config.text_config).eval()
  with torch.no_grad():
    text_lm.model.load_state_dict(model.model.language_model.state_dict())
    text_lm.lm_head.weight.copy_(model.lm_head.weight)
  text_only_err = float(np.abs(logits_and_loss(text_lm, ids)[0] - logits).max())
  assert text_only_err <= 1e-6, text_only_err
  changes, informative = gemma3_changes(lambda m: m.model.language_model)
  info = {"seed": seed, "family": "gemma3 (multimodal)",
          "covers": ("Gemma3ForConditionalGeneration (gemma3): text_config like hf_gemma3_text's "
                     "(tied, 6 layers, sliding x2 full x2), a tiny SigLIP vision tower (hidden 16, "
                     "1 layer, 2 heads, image 8, patch 4, no head) and projector "
                     "(mm_tokens_per_image 4); text-only inputs below boi/eoi/image token ids "
                     f"{BOI}/{EOI}/{IMAGE}; tensors named as save_pretrained writes them"),
          "text_only_vs_gemma3_for_causal_lm_max_abs_diff": text_only_err,
          "wiring_sensitivity": sensitivity(model, ids, changes, informative)}
  out = os.path.join(ROOT, name)
  info = write_case(name, model, ids, info, verify=True)
  names = saved_tensor_names(out)
  prefixes = sorted({n[:n.index("embed_tokens.weight")] for n in names
                     if n.endswith("embed_tokens.weight")})
  assert len(prefixes) == 1, prefixes
  info["text_tensor_prefix"] = prefixes[0]  # before embed_tokens.weight, layers.N., norm.weight
  info["lm_head_saved"] = any("lm_head" in n for n in names)
  info["non_text_tensor_prefixes"] = sorted({n.split(".")[0] + "." for n in names
                                             if not n.startswith(prefixes[0])})
  with open(os.path.join(out, "fixture_info.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)


CASES: dict[str, Callable[[], None]] = {
    "hf_llama_gqa_llama3": llama_gqa_llama3,
    "hf_llama_tied_legacy": llama_tied_legacy,
    **{name: (lambda name=name: llama_more_case(name)) for name in MORE_CASES},
    "hf_qwen3_tied": lambda: qwen3_case("hf_qwen3_tied", 11, tied=True, theta=1e4, legacy=False),
    "hf_qwen3_untied": lambda: qwen3_case("hf_qwen3_untied", 12, tied=False, theta=1e6,
                                          legacy=True),
    "hf_qwen2_untied": lambda: qwen2_case("hf_qwen2_untied", 13, tied=False, theta=1e6),
    "hf_qwen2_tied": lambda: qwen2_case("hf_qwen2_tied", 14, tied=True, theta=1e4),
    "hf_mistral_window": lambda: mistral_case("hf_mistral_window", 15, tied=False, window=16,
                                              head_dim=16, theta=1e6),
    "hf_mistral_tied": lambda: mistral_case("hf_mistral_tied", 16, tied=True, window=None,
                                            head_dim=None, theta=1e4),
    "hf_gemma3_text": lambda: gemma3_text_case("hf_gemma3_text", 17, legacy=False),
    "hf_gemma3_text_legacy": lambda: gemma3_text_case("hf_gemma3_text_legacy", 18, legacy=True),
    "hf_gemma3_multimodal": lambda: gemma3_multimodal_case("hf_gemma3_multimodal", 19),
}


def check_export(name: str) -> dict:
  """jaxtrain imports fixture `name` and exports it in each rope spelling; transformers loads
  each export with AutoModelForCausalLM and must compute the fixture's logits within LOGIT_TOL.
  The errors and the class transformers chose go into fixture_info.json's "export_check"."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from jaxtrain.interop import hf, hf_config  # pylint: disable=import-outside-toplevel
  out = os.path.join(ROOT, name)
  ids, want = np.load(os.path.join(out, "input_ids.npy")), np.load(os.path.join(out, "logits.npy"))
  model, config = hf.load_model(out)
  checked = {}
  for spelling in hf_config.ROPE_SPELLINGS:
    with tempfile.TemporaryDirectory() as tmp:
      hf.save_model(model, config, tmp, rope_spelling=spelling)
      loaded = transformers.AutoModelForCausalLM.from_pretrained(
          tmp, dtype=torch.float32, attn_implementation="eager").eval()
      logits, _ = logits_and_loss(loaded, ids)
    err = float(np.abs(logits - want).max())
    assert err <= LOGIT_TOL, f"{name}: export ({spelling}) max abs logit error {err:.3e}"
    checked[spelling] = {"class": type(loaded).__name__, "max_abs_logit_error": err}
    print(f"{name}: transformers loads the export ({spelling}, {type(loaded).__name__}): "
          f"max abs logit error {err:.3e}")
  path = os.path.join(out, "fixture_info.json")
  with open(path, encoding="utf-8") as f:
    info = json.load(f)
  info["export_check"] = checked
  with open(path, "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)
  return checked


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", action="append", metavar="PREFIX",
                      help="generate only the cases whose name starts with PREFIX (repeatable; "
                           "default: every case). Cases: " + ", ".join(CASES))
  parser.add_argument("--check_exports", action="store_true",
                      help="instead of generating: export each chosen non-Llama fixture with "
                           "jaxtrain and check that transformers loads it and computes its "
                           "logits (recorded in fixture_info.json)")
  args = parser.parse_args()
  names = [n for n in CASES if not args.only or any(n.startswith(p) for p in args.only)]
  if not names:
    parser.error(f"no case starts with {args.only}; cases: {', '.join(CASES)}")
  torch.set_default_dtype(torch.float32)
  for name in names:
    if not args.check_exports:
      CASES[name]()
    elif not name.startswith("hf_llama"):  # the Llama export is checked by round_trip
      check_export(name)


if __name__ == "__main__":
  main()
