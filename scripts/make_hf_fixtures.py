"""Regenerates tests/fixtures/hf_*: tiny random transformers models and the logits they compute.

Llama, Qwen2, Qwen3, Mistral, Gemma 3 (text-only and multimodal), and the Mixtures of Experts
Mixtral and Qwen3-MoE.

The cases live in hf_fixture_tools.py (what they share), hf_family_fixtures.py and
hf_moe_fixtures.py (the non-Llama families); this file holds the Llama cases, the export checks
and the command line.
The tests (tests/test_hf_interop.py, tests/test_hf_families.py) need neither torch nor
transformers: these fixtures carry what transformers computed. To regenerate them, in a virtual environment of its own (the
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

Reward models (*ForSequenceClassification, num_labels=1: a score head `score.weight` [1, D] in
place of lm_head), eager attention, 40-token inputs, pad_token_id 0 (the tiny tokenizer's <s>,
which jaxtrain's export also writes: the BOS of a tokenizer without a pad token). Each directory
holds `input_ids.npy` [2, 40] and transformers' per-position scores `scores.npy` [2, 40] (the
score head on every position's final hidden state), a right-padded batch `padded_input_ids.npy`
with its `attention_mask.npy` [3, 40] (rows of 40, 29 and 13 real tokens, ids >= 3, padded with
0) and the *ForSequenceClassification forward's `pooled_logits.npy` [3, 1] on it (the score at
each row's rightmost non-pad token), and a tokenizer.json.

  hf_llama_reward:      LlamaForSequenceClassification, GQA 4/2, default RoPE, untied config.
  hf_qwen3_reward:      Qwen3ForSequenceClassification, GQA 4/2, head_dim 16, random
                        q_norm/k_norm, tie_word_embeddings true (no head either way).

`--check_exports` on them: jaxtrain imports each and exports it in both rope spellings;
AutoModelForSequenceClassification must load the export as the family's class and compute the
fixture's scores and pooled logits (fixture_info.json's "export_check").
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
from typing import Callable

import numpy as np
import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                          Qwen3Config, Qwen3ForSequenceClassification)

import hf_family_fixtures as families
import hf_moe_fixtures as moe
import hf_deepseek_fixtures as deepseek
from hf_fixture_tools import (LOGIT_TOL, ROOT, SEQ_LEN, VOCAB, ids_40, logits_and_loss,
                              random_hf_model, random_model, saved_tensor_names, tiny_tokenizer,
                              write_case)

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


# ---- Reward models: *ForSequenceClassification with one label ----------------------------------

REWARD_PAD = 0  # the tiny tokenizer's <s>: never a row's last real token
REWARD_LENGTHS = (SEQ_LEN, 29, 13)  # real tokens per row of the right-padded batch


def padded_batch() -> tuple[np.ndarray, np.ndarray]:
  """(input ids, attention mask) [3, 40]: rows of REWARD_LENGTHS real ids (>= 3, never the pad),
  right-padded with REWARD_PAD."""
  ids = np.random.default_rng(5).integers(3, VOCAB, (len(REWARD_LENGTHS), SEQ_LEN))
  mask = (np.arange(SEQ_LEN)[None] < np.asarray(REWARD_LENGTHS)[:, None]).astype(np.int32)
  return np.where(mask == 1, ids, REWARD_PAD).astype(np.int32), mask


def reward_outputs(model, ids: np.ndarray, padded: np.ndarray, mask: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
  """(per-position scores [B, T]: the score head on every final hidden state, the forward's
  pooled logits [B', 1] on the right-padded batch with its attention mask)."""
  with torch.no_grad():
    hidden = model.model(torch.tensor(ids, dtype=torch.long)).last_hidden_state
    scores = model.score(hidden)[..., 0].float().numpy()
    pooled = model(torch.tensor(padded, dtype=torch.long),
                   attention_mask=torch.tensor(mask, dtype=torch.long)).logits.float().numpy()
  return scores, pooled


def score_changes(model, ids, padded, mask) -> dict:
  """How far wiring changes move the scores and the pooled logits: a parity test at LOGIT_TOL
  must see each (asserted above 100 x LOGIT_TOL)."""
  scores, pooled = reward_outputs(model, ids, padded, mask)
  last = np.asarray(REWARD_LENGTHS) - 1
  # The pooled score at the last position (padding included) instead of the last real token.
  padded_scores, _ = reward_outputs(model, padded, padded, mask)
  out = {"pooled at the last position, not the last real token": float(
      np.abs(padded_scores[:, -1] - pooled[:, 0]).max())}
  assert np.allclose(padded_scores[np.arange(len(last)), last], pooled[:, 0], atol=1e-6)

  def changed(change):
    m = copy.deepcopy(model)
    with torch.no_grad():
      change(m)
    return float(np.abs(reward_outputs(m, ids, padded, mask)[0] - scores).max())

  out["final norm weights ignored (all 1)"] = changed(lambda m: m.model.norm.weight.fill_(1.0))
  out["score head read as the embedding's first row"] = changed(
      lambda m: m.score.weight.copy_(m.model.embed_tokens.weight[:1]))
  for what, value in out.items():
    assert value > 100 * LOGIT_TOL, f"{what}: moves the scores by only {value:.3e}"
  return out


def reward_case(name: str, seed: int, model_cls, config, covers: str):
  model = random_hf_model(seed, model_cls, config)
  ids, (padded, mask) = ids_40(), padded_batch()
  scores, pooled = reward_outputs(model, ids, padded, mask)
  out = os.path.join(ROOT, name)
  shutil.rmtree(out, ignore_errors=True)
  model.save_pretrained(out, safe_serialization=True)
  if os.path.exists(os.path.join(out, "generation_config.json")):
    os.remove(os.path.join(out, "generation_config.json"))
  tiny_tokenizer().save(os.path.join(out, "tokenizer.json"))
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
      out, attn_implementation="eager").eval()
  assert type(reloaded) is model_cls, type(reloaded)
  again = reward_outputs(reloaded, ids, padded, mask)
  assert np.array_equal(again[0], scores) and np.array_equal(again[1], pooled)
  for file, array in (("input_ids", ids), ("scores", scores), ("padded_input_ids", padded),
                      ("attention_mask", mask), ("pooled_logits", pooled)):
    dtype = np.float32 if file in ("scores", "pooled_logits") else np.int32
    np.save(os.path.join(out, f"{file}.npy"), array.astype(dtype))
  info = {"seed": seed, "covers": covers, "transformers": transformers.__version__,
          "torch": torch.__version__, "class": model_cls.__name__,
          "num_labels": reloaded.config.num_labels, "pad_token_id": reloaded.config.pad_token_id,
          "input_shape": list(ids.shape), "padded_lengths": list(REWARD_LENGTHS),
          "scores_abs_max": float(np.abs(scores).max()),
          "pooled_logits": pooled[:, 0].tolist(),
          "tensors_outside_layers": [n for n in saved_tensor_names(out) if ".layers." not in n],
          "wiring_sensitivity": score_changes(model, ids, padded, mask)}
  with open(os.path.join(out, "fixture_info.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)
  size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
  print(f"{name}: {sorted(os.listdir(out))}, {size / 1024:.0f} KiB, scores up to "
        f"{info['scores_abs_max']:.3f}, pooled {info['pooled_logits']}")


REWARD_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     num_labels=1, pad_token_id=REWARD_PAD, attn_implementation="eager")


def llama_reward():
  config = LlamaConfig(rms_norm_eps=1e-5, **REWARD_COMMON)
  reward_case("hf_llama_reward", 30, LlamaForSequenceClassification, config,
              "LlamaForSequenceClassification (num_labels 1), GQA 4/2, default RoPE: per-position "
              "scores and pooled logits of a right-padded batch")


def qwen3_reward():
  config = Qwen3Config(rms_norm_eps=1e-6, head_dim=16, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       **REWARD_COMMON)
  reward_case("hf_qwen3_reward", 31, Qwen3ForSequenceClassification, config,
              "Qwen3ForSequenceClassification (num_labels 1), GQA 4/2, head_dim 16, q/k norms, "
              "tie_word_embeddings true: per-position scores and pooled logits of a right-padded "
              "batch")


REWARD_CASES = {"hf_llama_reward": llama_reward, "hf_qwen3_reward": qwen3_reward}


def jaxtrain_scores(model, arrays: dict) -> tuple[np.ndarray, np.ndarray]:
  """jaxtrain's (per-position scores, sequence rewards of the right-padded batch), float32 at the
  highest matmul precision."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jaxtrain.objectives.reward import loss as reward  # pylint: disable=import-outside-toplevel
  with jax.default_matmul_precision("highest"):
    scores = model(jnp.asarray(arrays["input_ids"]))
    rewards = reward.sequence_rewards(model, jnp.asarray(arrays["padded_input_ids"]),
                                      jnp.asarray(arrays["attention_mask"]))
  return np.asarray(scores), np.asarray(rewards)


def check_reward_export(name: str) -> dict:
  """jaxtrain imports reward fixture `name` and exports it in each rope spelling; transformers
  loads each export with AutoModelForSequenceClassification (it must choose the fixture's class)
  and must compute the fixture's per-position scores and pooled logits within LOGIT_TOL."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from jaxtrain.interop import hf, hf_config  # pylint: disable=import-outside-toplevel
  out = os.path.join(ROOT, name)
  arrays = {f: np.load(os.path.join(out, f"{f}.npy")) for f in
            ("input_ids", "scores", "padded_input_ids", "attention_mask", "pooled_logits")}
  with open(os.path.join(out, "fixture_info.json"), encoding="utf-8") as f:
    info = json.load(f)
  model, config = hf.load_model(out)
  ours = jaxtrain_scores(model, arrays)
  checked = {}
  for spelling in hf_config.ROPE_SPELLINGS:
    with tempfile.TemporaryDirectory() as tmp:
      hf.save_model(model, config, tmp, rope_spelling=spelling)
      with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
        written = json.load(f)
      loaded = transformers.AutoModelForSequenceClassification.from_pretrained(
          tmp, dtype=torch.float32, attn_implementation="eager").eval()
      scores, pooled = reward_outputs(loaded, arrays["input_ids"], arrays["padded_input_ids"],
                                      arrays["attention_mask"])
    assert type(loaded).__name__ == info["class"], type(loaded)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == REWARD_PAD, (
        loaded.config.num_labels, loaded.config.pad_token_id)
    errors = {"max_abs_score_error": float(np.abs(scores - arrays["scores"]).max()),
              "max_abs_pooled_error": float(np.abs(pooled - arrays["pooled_logits"]).max()),
              # transformers on the export against jaxtrain's own scores and rewards
              "max_abs_score_error_vs_jaxtrain": float(np.abs(scores - ours[0]).max()),
              "max_abs_pooled_error_vs_jaxtrain": float(np.abs(pooled[:, 0] - ours[1]).max())}
    for what, err in errors.items():
      assert err <= LOGIT_TOL, f"{name}: export ({spelling}) {what} {err:.3e}"
    checked[spelling] = {"class": type(loaded).__name__, **errors,
                         "pad_token_id": written["pad_token_id"],
                         "id2label": written["id2label"]}
    print(f"{name}: transformers loads the export ({spelling}, {type(loaded).__name__}): max "
          f"abs score error {errors['max_abs_score_error']:.3e}, pooled "
          f"{errors['max_abs_pooled_error']:.3e} (against jaxtrain's: "
          f"{errors['max_abs_score_error_vs_jaxtrain']:.3e}, "
          f"{errors['max_abs_pooled_error_vs_jaxtrain']:.3e})")
  info["export_check"] = checked
  with open(os.path.join(out, "fixture_info.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)
  return checked


# ---- Qwen2, Qwen3, Mistral, Gemma 3: eager attention, checked reloads, wiring sensitivity ----

# A deliberate wiring change must move the logits by at least this (a parity test at LOGIT_TOL
# sees it with a wide margin).
CASES: dict[str, Callable[[], None]] = {
    "hf_llama_gqa_llama3": llama_gqa_llama3,
    "hf_llama_tied_legacy": llama_tied_legacy,
    **{name: (lambda name=name: llama_more_case(name)) for name in MORE_CASES},
    "hf_qwen3_tied": lambda: families.qwen3_case("hf_qwen3_tied", 11, tied=True, theta=1e4,
                                                 legacy=False),
    "hf_qwen3_untied": lambda: families.qwen3_case("hf_qwen3_untied", 12, tied=False, theta=1e6,
                                                   legacy=True),
    "hf_qwen2_untied": lambda: families.qwen2_case("hf_qwen2_untied", 13, tied=False, theta=1e6),
    "hf_qwen2_tied": lambda: families.qwen2_case("hf_qwen2_tied", 14, tied=True, theta=1e4),
    "hf_mistral_window": lambda: families.mistral_case("hf_mistral_window", 15, tied=False,
                                                       window=16, head_dim=16, theta=1e6),
    "hf_mistral_tied": lambda: families.mistral_case("hf_mistral_tied", 16, tied=True,
                                                     window=None, head_dim=None, theta=1e4),
    "hf_gemma3_text": lambda: families.gemma3_text_case("hf_gemma3_text", 17, legacy=False),
    "hf_gemma3_text_legacy": lambda: families.gemma3_text_case("hf_gemma3_text_legacy", 18,
                                                               legacy=True),
    "hf_gemma3_multimodal": lambda: families.gemma3_multimodal_case("hf_gemma3_multimodal", 19),
    "hf_mixtral": lambda: moe.mixtral_case("hf_mixtral", 20),
    "hf_qwen3_moe_dense_first": lambda: moe.qwen3_moe_case(
        "hf_qwen3_moe_dense_first", 21, norm_topk_prob=True, mlp_only_layers=[0], sparse_step=1,
        num_layers=3),
    "hf_qwen3_moe_every_other": lambda: moe.qwen3_moe_case(
        "hf_qwen3_moe_every_other", 22, norm_topk_prob=False, mlp_only_layers=[],
        sparse_step=2, num_layers=4),
    "hf_deepseek_v3": lambda: deepseek.deepseek_v3_case("hf_deepseek_v3", 23, yarn=False),
    "hf_deepseek_v3_yarn": lambda: deepseek.deepseek_v3_case("hf_deepseek_v3_yarn", 24,
                                                             yarn=True),
    "hf_deepseek_v3_mtp": lambda: deepseek.deepseek_v3_mtp_case("hf_deepseek_v3_mtp", 25),
    # YaRN with mscale != mscale_all_dim: the rotated query and key scaled by
    # mscale(4, 1.0) / mscale(4, 0.707), the softmax by mscale(4, 0.707)**2; 2 layers.
    "hf_deepseek_v3_yarn_mscales": lambda: deepseek.deepseek_v3_case(
        "hf_deepseek_v3_yarn_mscales", 26, yarn=True, mscale=1.0, mscale_all_dim=0.707,
        num_layers=2),
    **REWARD_CASES,
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
      mtp = (deepseek.exported_mtp_error(loaded, out, ids)
             if os.path.exists(os.path.join(out, "mtp_logits.npy")) else {})
    err = float(np.abs(logits - want).max())
    assert err <= LOGIT_TOL, f"{name}: export ({spelling}) max abs logit error {err:.3e}"
    checked[spelling] = {"class": type(loaded).__name__, "max_abs_logit_error": err, **mtp}
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
                      help="instead of generating: export each chosen non-Llama fixture (and "
                           "each reward fixture) with jaxtrain and check that transformers "
                           "loads it and computes its logits, or scores (recorded in "
                           "fixture_info.json)")
  args = parser.parse_args()
  names = [n for n in CASES if not args.only or any(n.startswith(p) for p in args.only)]
  if not names:
    parser.error(f"no case starts with {args.only}; cases: {', '.join(CASES)}")
  torch.set_default_dtype(torch.float32)
  for name in names:
    if not args.check_exports:
      CASES[name]()
    elif name in REWARD_CASES:
      check_reward_export(name)
    elif not name.startswith("hf_llama"):  # the Llama export is checked by round_trip
      check_export(name)


if __name__ == "__main__":
  main()
