"""Hugging Face reward models: *ForSequenceClassification (num_labels 1) import and export.

No torch here: tests/fixtures/hf_llama_reward and hf_qwen3_reward hold tiny
LlamaForSequenceClassification / Qwen3ForSequenceClassification checkpoints saved by
transformers, its per-position scores (the score head on every final hidden state) and the
forward's pooled logits [B, 1] of a right-padded batch (scripts/make_hf_fixtures.py, whose
--check_exports also has transformers load jaxtrain's export of them).

Parity bar: max abs error <= 1e-4 in float32 with the highest matmul precision.
"""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config as config_lib
from jaxtrain.checkpointing.weights import load_params
from jaxtrain.interop import hf, hf_io, hf_config, hf_export_config
from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.models import registry
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from jaxtrain.objectives.reward import loss as reward
from jaxtrain.validation import checks as config_checks
from tests.helpers import safetensors_tensors

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LLAMA = os.path.join(FIXTURES, "hf_llama_reward")
QWEN3 = os.path.join(FIXTURES, "hf_qwen3_reward")
REWARD_FIXTURES = [LLAMA, QWEN3]
TOL = 1e-4


def _arrays(path):
  return {name: np.load(os.path.join(path, f"{name}.npy")) for name in
          ("input_ids", "scores", "padded_input_ids", "attention_mask", "pooled_logits")}


@functools.partial(jax.jit, static_argnums=0)
def _outputs(graphdef, params, ids_BT, padded_BT, mask_BT):
  """(scores [B, T] of ids_BT, sequence rewards [B'] of the right-padded batch)."""
  model = nnx.merge(graphdef, params)
  return model(ids_BT), reward.sequence_rewards(model, padded_BT, mask_BT)


def _run(graphdef, params, path):
  a = _arrays(path)
  with jax.default_matmul_precision("highest"):
    scores, rewards = _outputs(graphdef, params, jnp.asarray(a["input_ids"]),
                               jnp.asarray(a["padded_input_ids"]),
                               jnp.asarray(a["attention_mask"]))
  return np.asarray(scores), np.asarray(rewards)


@functools.lru_cache(maxsize=None)
def _imported(path):
  return hf.load_model(path)


@pytest.mark.parametrize("path", REWARD_FIXTURES, ids=os.path.basename)
def test_import_scores_every_position_as_transformers(path):
  model, config = _imported(path)
  assert config.model.score_head and config.train.objective == "reward"
  assert config.data.format == "preference"
  assert ModelConfig.from_config(config).arch.score_head
  assert model.score_D1.shape == (config.model.d_model, 1) and not hasattr(model, "head_DV")
  scores, _ = _run(*nnx.split(model), path)
  want = _arrays(path)["scores"]
  assert scores.dtype == np.float32 and scores.shape == want.shape
  err = float(np.abs(scores - want).max())
  print(f"{os.path.basename(path)}: max abs score error {err:.3e}")
  assert err <= TOL


@pytest.mark.parametrize("path", REWARD_FIXTURES, ids=os.path.basename)
def test_sequence_rewards_are_transformers_pooled_logits_on_right_padded_rows(path):
  a = _arrays(path)
  assert (a["attention_mask"] == 0).any()  # the batch is padded
  model, _ = _imported(path)
  _, rewards = _run(*nnx.split(model), path)
  want = a["pooled_logits"][:, 0]
  err = float(np.abs(rewards - want).max())
  print(f"{os.path.basename(path)}: max abs reward error {err:.3e}")
  assert err <= TOL
  # The pooled token is each row's last real one, not the last position.
  last = a["attention_mask"].sum(-1) - 1
  assert (last < a["attention_mask"].shape[1] - 1).any()


@pytest.mark.parametrize("path", REWARD_FIXTURES, ids=os.path.basename)
def test_export_writes_a_sequence_classifier_that_reimports_the_same(tmp_path, path):
  model, config = _imported(path)
  out = tmp_path / "hf"
  written = hf.save_model(model, config, str(out))
  assert "tokenizer.json" in written
  exported, original = safetensors_tensors(out), safetensors_tensors(path)
  assert sorted(exported) == sorted(original)
  assert "score.weight" in exported and "lm_head.weight" not in exported
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name], x, err_msg=name)
  source, hf_json = hf_config.read_hf_config(path), hf_config.read_hf_config(str(out))
  assert hf_json["architectures"] == source["architectures"]
  assert hf_json["num_labels"] == 1 and hf_json["id2label"] == {"0": "LABEL_0"}
  # The tiny tokenizer has no pad token: its BOS (<s>, 0), as in the fixture.
  assert hf_json["pad_token_id"] == source["pad_token_id"] == 0
  assert hf_json["tie_word_embeddings"] == source["tie_word_embeddings"]
  again, again_config = hf.load_model(str(out))
  assert again_config.model.to_dict() == config.model.to_dict()
  for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(again, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("fields,message", [
    ({"id2label": {"0": "NEG", "1": "POS"}}, r"config.json id2label \(2 labels\): unsupported"),
    ({"id2label": None, "num_labels": 3}, r"config.json num_labels=3: unsupported"),
    ({"id2label": None}, r"config.json num_labels \(absent, with no id2label: transformers' "
                         r"default 2\): unsupported"),
])
def test_classifiers_of_other_label_counts_are_refused_in_one_line(tmp_path, fields, message):
  hf_json = hf_config.read_hf_config(LLAMA)
  for key, value in fields.items():
    hf_json.pop("label2id", None)
    if value is None:
      hf_json.pop(key)
    else:
      hf_json[key] = value
  (tmp_path / "config.json").write_text(json.dumps(hf_json))
  with pytest.raises(HFFormatError, match=message) as e:
    hf.load_model(str(tmp_path))
  assert "\n" not in str(e.value) and "num_labels=1" in str(e.value)


def test_a_score_head_under_a_causal_lm_config_is_named(tmp_path):
  hf_json = hf_config.read_hf_config(LLAMA)
  shutil.copy(os.path.join(LLAMA, "model.safetensors"), tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(dict(hf_json,
                                                        architectures=["LlamaForCausalLM"])))
  with pytest.raises(HFFormatError, match=r"missing from the safetensors: lm_head.weight \(the "
                                          r"file holds score.weight"):
    hf.load_model(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(dict(
      hf_json, architectures=["LlamaForCausalLM"], tie_word_embeddings=True)))
  with pytest.raises(HFFormatError, match=r"no place for: score.weight; check config.json "
                                          r"\(architectures"):
    hf.load_model(str(tmp_path))


def test_export_names_each_familys_sequence_classifier_and_its_pad_token():
  want = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
          "qwen3": "Qwen3ForSequenceClassification",
          "mistral": "MistralForSequenceClassification",
          "gemma3": "Gemma3TextForSequenceClassification",  # model_type gemma3_text
          "mixtral": "MixtralForSequenceClassification",
          "qwen3_moe": "Qwen3MoeForSequenceClassification",
          "deepseek_v3": "DeepseekV3ForSequenceClassification"}
  assert {name: hf_export_config.sequence_classifier(registry.get(name))
          for name in registry.FAMILIES} == want
  # pad_token_id: the tokenizer's pad, unless it is EOS (responses end with EOS); else BOS.
  assert hf_export_config.score_pad_id(pad_id=3, bos_id=1, eos_id=2) == 3
  assert hf_export_config.score_pad_id(pad_id=2, bos_id=1, eos_id=2) == 1
  assert hf_export_config.score_pad_id(pad_id=None, bos_id=1, eos_id=2) == 1
  assert hf_export_config.score_pad_id(pad_id=None, bos_id=None, eos_id=2) is None


def test_a_language_models_export_is_unchanged_by_the_reward_fields():
  config = config_lib.default_config()
  hf_json = hf_export_config.from_jaxtrain_config(config, dtype="float32", bos_id=1, eos_id=2,
                                                  pad_id=3)
  assert hf_json["architectures"] == ["LlamaForCausalLM"] and hf_json["pad_token_id"] is None
  assert "num_labels" not in hf_json and "id2label" not in hf_json
  config.train.objective = "reward"  # implies the score head
  hf_json = hf_export_config.from_jaxtrain_config(config, dtype="float32", bos_id=1, eos_id=2,
                                                  pad_id=3)
  assert hf_json["architectures"] == ["LlamaForSequenceClassification"]
  assert hf_json["pad_token_id"] == 3 and hf_json["num_labels"] == 1


def test_cli_import_gives_a_reward_model_for_init_from_and_export_reverses_it(tmp_path, capsys):
  weights = tmp_path / "weights"
  assert hf.main(["import", f"--hf_dir={LLAMA}", f"--out={weights}"]) == 0
  printed = capsys.readouterr().out
  assert "--config.model.score_head=True" in printed
  assert "--config.train.objective=reward" in printed
  saved = json.loads((weights / "jaxtrain_config.json").read_text())["overrides"]
  assert saved["model.score_head"] is True and saved["train.objective"] == "reward"
  config = config_lib.load_config_file(str(weights / "config.py"))
  assert config.model.score_head and config.train.objective == "reward"
  assert config.data.format == "preference" and config.checkpoint.init_from == str(weights)
  config_checks.validate(config, 1, "cpu")
  # What the trainer does with checkpoint.init_from: the score head is read, not started anew.
  cfg = ModelConfig.from_config(config)
  graphdef, abstract_params, _ = abstract_model(cfg, hf_io.default_mesh())
  assert "score_D1" in abstract_params
  params, _ = load_params(config.checkpoint.init_from, abstract_params)
  assert np.abs(np.asarray(params["score_D1"])).max() > 0
  scores, rewards = _run(graphdef, params, LLAMA)
  a = _arrays(LLAMA)
  assert float(np.abs(scores - a["scores"]).max()) <= TOL
  assert float(np.abs(rewards - a["pooled_logits"][:, 0]).max()) <= TOL

  out = tmp_path / "hf"
  assert hf.main(["export", f"--checkpoint={weights}", f"--out={out}"]) == 0
  exported, original = safetensors_tensors(out), safetensors_tensors(LLAMA)
  assert sorted(exported) == sorted(original)
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name], x, err_msg=name)
  hf_json = hf_config.read_hf_config(str(out))
  assert hf_json["architectures"] == ["LlamaForSequenceClassification"]
  assert hf_json["pad_token_id"] == 0
