"""Hugging Face interop of the model families beyond Llama: Qwen3, Qwen2, Mistral, Gemma 3, and
the Mixtures of Experts Mixtral and Qwen3-MoE (one tensor per expert and projection).

No torch here: tests/fixtures/hf_{qwen3,qwen2,mistral,gemma3}_* hold tiny models saved by
transformers 5 with the float32 logits it computed, and in fixture_info.json's "reload" how
transformers itself read the config (layer types, RoPE per layer type, window). Import must
reproduce the logits (max abs error <= 1e-4 at float32, highest matmul precision) and read the
config as transformers did; export must write the family's config.json (the fields transformers
wrote for it, the same math) and bitwise the same tensors, and import back into the same logits.
Refusals are one line naming the field and what is supported.
"""

import json
import os
import re

import jax
import numpy as np
import pytest

from jaxtrain.config import default_config
from jaxtrain.interop import hf, hf_io, hf_config, hf_export_config
from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.models import registry
from jaxtrain.validation import checks as config_checks
from tests.helpers import mesh_of, safetensors_tensors
from tests.hf_helpers import FIXTURES, max_logit_error as _max_error

CASES = ("hf_qwen3_tied", "hf_qwen3_untied", "hf_qwen2_untied", "hf_qwen2_tied",
         "hf_mistral_window", "hf_mistral_tied", "hf_gemma3_text", "hf_gemma3_text_legacy",
         "hf_gemma3_multimodal", "hf_mixtral", "hf_qwen3_moe_dense_first",
         "hf_qwen3_moe_every_other", "hf_deepseek_v3", "hf_deepseek_v3_yarn",
         "hf_deepseek_v3_mtp",
         # YaRN with mscale 1.0 != mscale_all_dim 0.707 (40 positions over 16 original ones):
         # the rotated query and key scaled by their ratio, which hf_deepseek_v3_yarn's equal
         # mscales cancel (fixture_info.json: what a wrong ratio or scale moves).
         "hf_deepseek_v3_yarn_mscales")
GEMMA3_TEXT = os.path.join(FIXTURES, "hf_gemma3_text")
MULTIMODAL = os.path.join(FIXTURES, "hf_gemma3_multimodal")
# Written by save_pretrained but not read by the model (or only by other readers).
NOT_EXPORTED = {"transformers_version", "_sliding_window_pattern"}
OUR_TYPE = {"full_attention": "full", "sliding_attention": "sliding"}


def _path(name):
  return os.path.join(FIXTURES, name)




@pytest.fixture(scope="module")
def imported():
  """Each fixture imported once for the module: name -> (model, config)."""
  cache = {}

  def get(name):
    if name not in cache:
      cache[name] = hf.load_model(_path(name))
    return cache[name]
  return get


def _assert_exported_bitwise(path, exported_dir):
  """The export holds exactly the source's decoder tensors, bitwise, under the *ForCausalLM
  names (a multimodal source's language model without its prefix, its vision parts dropped)."""
  original = {re.sub(r"^language_model\.", "", k): v for k, v in safetensors_tensors(path).items()
              if not k.startswith(("vision_tower.", "multi_modal_projector."))}
  exported = safetensors_tensors(exported_dir)
  assert sorted(exported) == sorted(original)
  for key, x in original.items():
    np.testing.assert_array_equal(exported[key], x, err_msg=key)


def _info(path):
  with open(os.path.join(path, "fixture_info.json"), encoding="utf-8") as f:
    return json.load(f)


# --------------------------------------------------------------------------------------------
# Import: transformers' logits, and the config read as transformers read it
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_import_matches_transformers_logits(imported, name):
  path = _path(name)
  model, config = imported(name)
  _max_error(model, path, name)
  m = config.model
  hf_json = hf_config.read_hf_config(path)
  assert registry.get(m.family) is registry.for_hf_model_type(hf_json["model_type"])
  text = hf_json.get("text_config", hf_json)
  # Latent attention's query/key head: its no-RoPE and RoPE parts (head_dim is the latter).
  head_dim = (text["qk_nope_head_dim"] + text["qk_rope_head_dim"] if "kv_lora_rank" in text
              else text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
  assert (m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.num_layers) == (
      text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"],
      head_dim, text["num_hidden_layers"])
  # The window, layer types and RoPE as transformers resolved them on reloading the directory.
  reload = _info(path)["reload"]
  window = reload["sliding_window"]
  types = reload["layer_types"] or ["sliding_attention" if window else "full_attention"] * \
      m.num_layers
  sliding = [t == "sliding_attention" and window is not None for t in types]
  assert m.sliding_window == (window if any(sliding) else 0)
  want_types = "" if len(set(sliding)) == 1 else ",".join(
      OUR_TYPE[t] for t in types)
  assert m.layer_types == want_types
  rope = reload["rope_parameters"]
  full = rope.get("full_attention", rope)
  assert m.rope_theta == full["rope_theta"]
  assert m.rope_scaling.type == {"default": "none"}.get(full["rope_type"], full["rope_type"])
  if full["rope_type"] == "linear":
    assert m.rope_scaling.factor == full["factor"]
  if "sliding_attention" in rope:
    assert m.local_rope_theta == rope["sliding_attention"]["rope_theta"]
    assert m.query_pre_attn_scalar == text["query_pre_attn_scalar"]
  else:
    assert m.local_rope_theta == 0 and m.query_pre_attn_scalar == 0
  assert m.tie_embeddings == hf_json.get("tie_word_embeddings", text.get("tie_word_embeddings"))
  config_checks.validate(config, 1, "cpu")  # trainable as is


def test_multimodal_tensors_under_the_newer_module_names_import_too(tmp_path, imported):
  """Gemma3ForConditionalGeneration's modules have been model.language_model.* since
  transformers 4.52: a checkpoint saved under those names imports the same."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  renamed = {re.sub(r"^language_model\.model\.", "model.language_model.", k)
                .replace("vision_tower.", "model.vision_tower.", 1)
             if not k.startswith("multi_modal_projector.") else "model." + k: v
             for k, v in safetensors_tensors(MULTIMODAL).items()}
  assert "model.language_model.embed_tokens.weight" in renamed
  save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  (tmp_path / "config.json").write_text(json.dumps(hf_config.read_hf_config(MULTIMODAL)))
  model, _ = hf.load_model(str(tmp_path))
  _max_error(model, MULTIMODAL, "multimodal, model.language_model.* names")


def test_unknown_tensors_beside_a_multimodal_language_model_are_refused(tmp_path):
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  tensors = safetensors_tensors(MULTIMODAL)
  tensors["audio_tower.proj.weight"] = np.zeros((2, 2), np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  (tmp_path / "config.json").write_text(json.dumps(hf_config.read_hf_config(MULTIMODAL)))
  with pytest.raises(HFFormatError, match=r"tensors this gemma3 config has no place for: "
                                          r"audio_tower.proj.weight"):
    hf.load_model(str(tmp_path))


# --------------------------------------------------------------------------------------------
# Export: what transformers loads for the family, and back
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_export_writes_the_family_config_and_tensors_and_reimports(tmp_path, imported, name):
  path = _path(name)
  model, config = imported(name)
  family = registry.get(config.model.family)
  hf.save_model(model, config, str(tmp_path))
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["model_type"] == family.hf_model_types[0]
  assert written["architectures"] == [family.hf_architecture]
  source = hf_config.read_hf_config(path)
  # The same math as the source's config.json (a multimodal source: its text part).
  assert hf_config.model_overrides(written) == hf_config.model_overrides(source)
  text = source.get("text_config", source)
  if "rope_parameters" in text:  # saved by transformers 5: the fields it writes, no others
    want = set(text) - NOT_EXPORTED | {"architectures", "dtype", "head_dim"}
    if "num_local_experts" in text:  # the expert count under both spellings (4 and 5)
      want |= {family.hf_experts.num_experts_key, "num_local_experts"}
    assert set(written) == want, (set(written) ^ want)
    for key in ("sliding_window", "layer_types", "use_sliding_window", "query_pre_attn_scalar",
                "rope_parameters", "hidden_act", "hidden_activation", "head_dim",
                "attn_logit_softcapping", "final_logit_softcapping", "attention_bias",
                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "mlp_only_layers", "decoder_sparse_step", "router_aux_loss_coef"):
      if key == "head_dim" and text.get(key, 0) is None:  # null: hidden_size / heads
        assert written[key] == text["hidden_size"] // text["num_attention_heads"]
      elif key in text:
        assert written[key] == text[key], key
  # Bitwise the source's decoder tensors, under the *ForCausalLM names.
  _assert_exported_bitwise(path, tmp_path)
  again, _ = hf.load_model(str(tmp_path))
  _max_error(again, path, f"{name} exported and imported again")


@pytest.mark.parametrize("name", ["hf_qwen2_untied", "hf_gemma3_multimodal"])
def test_sharded_import_and_export_on_8_devices(tmp_path, name):
  """Biases and per-head norms cut by heads, read shard by shard, gathered back bitwise."""
  path = _path(name)
  mesh = mesh_of((2, 2, 2))
  model, config = hf.load_model(path, mesh=mesh)
  with jax.set_mesh(mesh):
    _max_error(model, path, f"{name} on (2,2,2)")
  hf.save_model(model, config, str(tmp_path))
  _assert_exported_bitwise(path, tmp_path)


def test_unrolled_layers_of_both_types_import(tmp_path):
  """scan_layers=False: each Gemma 3 layer knows its own type and RoPE."""
  config = hf_config.to_jaxtrain_config(hf_config.read_hf_config(GEMMA3_TEXT), GEMMA3_TEXT)
  config.model.scan_layers = False
  model = hf_io.load_weights(GEMMA3_TEXT, config)
  _max_error(model, GEMMA3_TEXT, "gemma3 unrolled layers")
  hf.save_model(model, config, str(tmp_path))
  original, exported = safetensors_tensors(GEMMA3_TEXT), safetensors_tensors(tmp_path)
  assert sorted(exported) == sorted(original)
  for key, x in original.items():
    np.testing.assert_array_equal(exported[key], x, err_msg=key)


def test_yarn_rope_reads_and_writes_back():
  """A YaRN config.json (transformers' field names, defaults for what it leaves out) becomes
  model.rope_scaling's yarn fields, and export writes the same entry back."""
  source = hf_config.read_hf_config(_path("hf_qwen3_untied"))
  source["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                               "original_max_position_embeddings": 16, "beta_fast": 8.0}
  overrides = hf_config.model_overrides(source)
  assert {k: v for k, v in overrides.items() if k.startswith("model.rope_scaling")} == {
      "model.rope_scaling.type": "yarn", "model.rope_scaling.factor": 4.0,
      "model.rope_scaling.original_max_position_embeddings": 16,
      "model.rope_scaling.beta_fast": 8.0, "model.rope_scaling.beta_slow": 1.0,
      "model.rope_scaling.mscale": 0.0, "model.rope_scaling.mscale_all_dim": 0.0}
  config = default_config()
  hf_config.apply_overrides(config, overrides)
  written = hf_export_config.from_jaxtrain_config(config, dtype="float32")
  assert hf_config.model_overrides(written) == overrides


@pytest.mark.parametrize("name", ["hf_gemma3_text", "hf_qwen3_tied"])
def test_export_in_the_older_spelling_means_the_same(tmp_path, imported, name):
  model, config = imported(name)
  hf.save_model(model, config, str(tmp_path), rope_spelling="rope_scaling")
  written = json.loads((tmp_path / "config.json").read_text())
  assert "rope_parameters" not in written and "torch_dtype" in written
  assert hf_config.model_overrides(written) == hf_config.model_overrides(
      hf_config.read_hf_config(_path(name)))
  if name == "hf_gemma3_text":
    assert written["rope_local_base_freq"] == 10000.0
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert written["sliding_window_pattern"] == 3  # sliding, sliding, full, twice


def test_export_refuses_what_the_family_config_cannot_say(imported):
  _, config = imported("hf_mistral_window")
  config = config.copy_and_resolve_references()
  config.model.layer_types = "sliding,full"
  with pytest.raises(HFFormatError, match=r"^model.layer_types='sliding,full': "
                                          r"MistralForCausalLM applies sliding_window to every "
                                          r"layer"):
    hf_export_config.from_jaxtrain_config(config, dtype="float32")
  config.model.family = "llama"
  config.model.layer_types = ""
  with pytest.raises(HFFormatError, match=r"^model.sliding_window=16: LlamaForCausalLM has no "
                                          r"sliding window"):
    hf_export_config.from_jaxtrain_config(config, dtype="float32")
  config.model.sliding_window = 0
  config.model.query_pre_attn_scalar = 24.0
  with pytest.raises(HFFormatError, match=r"^model.query_pre_attn_scalar=24.0: LlamaForCausalLM "
                                          r"has no query_pre_attn_scalar"):
    hf_export_config.from_jaxtrain_config(config, dtype="float32")


def test_cli_import_of_a_gemma3_checkpoint_prints_its_family(tmp_path, capsys):
  weights = tmp_path / "weights"
  assert hf.main(["import", f"--hf_dir={MULTIMODAL}", f"--out={weights}"]) == 0
  printed = capsys.readouterr().out
  assert "--config.model.family=gemma3" in printed
  assert "--config.model.layer_types=sliding,sliding,full,sliding,sliding,full" in printed
  assert "--config.model.query_pre_attn_scalar=24.0" in printed
  assert '"""jaxtrain config for the gemma3 weights' in (weights / "config.py").read_text()


# --------------------------------------------------------------------------------------------
# Config mapping without weights
# --------------------------------------------------------------------------------------------


def _gemma3_text_json():
  return hf_config.read_hf_config(GEMMA3_TEXT)


def test_gemma3_older_spelling_maps_to_the_same_config():
  new = _gemma3_text_json()
  old = {k: v for k, v in new.items()
         if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern", "dtype")}
  old.update(rope_theta=1e6, rope_local_base_freq=1e4, torch_dtype="float32",
             rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=3)
  assert hf_config.model_overrides(old) == hf_config.model_overrides(new)
  # No pattern: Gemma3TextConfig's 6 (five sliding, then full).
  del old["sliding_window_pattern"]
  assert hf_config.model_overrides(old)["model.layer_types"] == ",".join(
      ["sliding"] * 5 + ["full"])


def test_sparse_gemma3_text_config_takes_gemma3_text_config_defaults():
  """The text_config of a published multimodal Gemma 3 names only a few fields."""
  hf_json = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                             "model_type": "gemma3_text", "num_hidden_layers": 34,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "torch_dtype": "bfloat16", "vision_config": {"model_type": "siglip_vision_model"}}
  got = hf_config.model_overrides(hf_json)
  assert got["model.family"] == "gemma3"
  assert (got["model.vocab_size"], got["model.num_heads"], got["model.num_kv_heads"],
          got["model.head_dim"]) == (262_208, 8, 4, 256)
  assert got["model.query_pre_attn_scalar"] == 256 and got["model.tie_embeddings"] is True
  assert (got["model.rope_theta"], got["model.local_rope_theta"]) == (1e6, 1e4)
  assert (got["model.rope_scaling.type"], got["model.rope_scaling.factor"]) == ("linear", 8.0)
  assert got["model.sliding_window"] == 1024
  assert got["model.layer_types"].split(",") == (["sliding"] * 5 + ["full"]) * 5 + ["sliding"] * 4
  assert hf_config.hf_dtype(hf_json) == "bfloat16"


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_sliding_window_from_max_window_layers_or_layer_types(model_type):
  base = {"model_type": model_type, "vocab_size": 128, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 16, "max_window_layers": 1}
  assert hf_config.model_overrides(base)["model.sliding_window"] == 0  # use_sliding_window off
  on = hf_config.model_overrides(dict(base, use_sliding_window=True))
  assert (on["model.sliding_window"], on["model.layer_types"]) == (16, "full,sliding,sliding,"
                                                                      "sliding")
  listed = hf_config.model_overrides(dict(base, use_sliding_window=True, layer_types=[
      "sliding_attention", "full_attention", "sliding_attention", "full_attention"]))
  assert listed["model.layer_types"] == "sliding,full,sliding,full"
  every = hf_config.model_overrides(dict(base, use_sliding_window=True, max_window_layers=0))
  assert (every["model.sliding_window"], every["model.layer_types"]) == (16, "")
  # ... and export says it again, for transformers 5 (layer_types) and older readers.
  config = hf_config.to_jaxtrain_config(dict(base, use_sliding_window=True), FIXTURES)
  written = hf_export_config.from_jaxtrain_config(config, dtype="float32")
  assert (written["use_sliding_window"], written["sliding_window"],
          written["max_window_layers"]) == (True, 16, 1)
  assert written["layer_types"] == ["full_attention"] + ["sliding_attention"] * 3
  assert hf_config.model_overrides(written) == on


def test_mistral_window_default_and_null():
  base = {"model_type": "mistral", "vocab_size": 128, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 16}
  got = hf_config.model_overrides(base)
  assert got["model.sliding_window"] == 4096 and got["model.num_kv_heads"] == 8  # MistralConfig's
  assert hf_config.model_overrides(dict(base, num_key_value_heads=None))["model.num_kv_heads"] == 16
  assert hf_config.model_overrides(dict(base, sliding_window=None))["model.sliding_window"] == 0


# --------------------------------------------------------------------------------------------
# Refusals: one line naming the field and what is supported
# --------------------------------------------------------------------------------------------

SUPPORTED_TYPES = ("llama, qwen3, qwen2, mistral, gemma3_text, gemma3, mixtral, qwen3_moe, "
                   "deepseek_v3")


@pytest.mark.parametrize("source,change,message", [
    ("hf_gemma3_text", {"attn_logit_softcapping": 50.0},
     "config.json attn_logit_softcapping=50.0: unsupported; jaxtrain implements no logit "
     "softcapping (null)"),
    ("hf_gemma3_text", {"final_logit_softcapping": 30.0},
     "config.json final_logit_softcapping=30.0: unsupported; jaxtrain implements no logit "
     "softcapping (null)"),
    ("hf_qwen3_tied", {"final_logit_softcapping": 30.0},
     "config.json final_logit_softcapping=30.0: unsupported; jaxtrain implements no logit "
     "softcapping (null)"),
    ("hf_qwen2_tied", {"rope_parameters": {"rope_type": "longrope", "factor": 4.0,
                                           "rope_theta": 1e6}},
     "config.json rope_parameters.rope_type='longrope': unsupported; jaxtrain implements "
     "'default', 'llama3', 'linear', 'yarn' RoPE"),
    ("hf_gemma3_text", {"rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "config.json rope_parameters.full_attention.rope_type='dynamic': unsupported; jaxtrain "
     "implements 'default', 'llama3', 'linear', 'yarn' RoPE"),
    ("hf_gemma3_text", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "config.json rope_parameters.sliding_attention.rope_type='linear': unsupported; "
     "jaxtrain's sliding layers use plain RoPE ('default')"),
    ("hf_mistral_tied", {"model_type": "gemma2"},
     f"config.json model_type='gemma2': unsupported; jaxtrain imports model_type "
     f"{SUPPORTED_TYPES}"),
    ("hf_gemma3_text", {"use_bidirectional_attention": True},
     "config.json use_bidirectional_attention=True: unsupported; jaxtrain's attention is "
     "causal (false)"),
    ("hf_gemma3_text", {"hidden_activation": "gelu"},
     "config.json hidden_activation='gelu': unsupported; jaxtrain's gemma3 MLP is GeGLU "
     "('gelu_pytorch_tanh')"),
    ("hf_qwen2_untied", {"hidden_act": "gelu"},
     "config.json hidden_act='gelu': unsupported; jaxtrain's qwen2 MLP is SwiGLU ('silu')"),
    ("hf_qwen3_tied", {"attention_bias": True},
     "config.json attention_bias=True: unsupported; jaxtrain's qwen3 attention has no bias "
     "(false)"),
    ("hf_mistral_window", {"partial_rotary_factor": 0.5},
     "config.json partial_rotary_factor=0.5: unsupported; jaxtrain rotates the whole head dim "
     "(1.0)"),
    ("hf_gemma3_text", {"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]},
     "config.json layer_types[5]='chunked_attention': unsupported; jaxtrain implements "
     "'full_attention', 'sliding_attention'"),
    ("hf_qwen3_tied", {"quantization_config": {"quant_method": "fp8"}},
     "config.json quantization_config (quant_method 'fp8'): unsupported; jaxtrain imports "
     "unquantized float32, bfloat16, float16 weights"),
    ("hf_gemma3_multimodal", {"text_config": {"model_type": "gemma2"}},
     "config.json text_config.model_type='gemma2': unsupported; a gemma3 checkpoint's text "
     "model is 'gemma3_text'"),
    ("hf_mixtral", {"scoring_func": "sigmoid"},
     "config.json scoring_func='sigmoid': unsupported routing; jaxtrain's mixtral router is a "
     "softmax over the experts then the top k (scoring_func='softmax')"),
    ("hf_qwen3_moe_dense_first", {"shared_expert_intermediate_size": 64},
     "config.json shared_expert_intermediate_size=64: unsupported routing; jaxtrain's "
     "qwen3_moe router is a softmax over the experts then the top k "
     "(shared_expert_intermediate_size=0)"),
    ("hf_mixtral", {"router_jitter_noise": 0.1},
     "config.json router_jitter_noise=0.1: unsupported routing; jaxtrain's mixtral router is a "
     "softmax over the experts then the top k (router_jitter_noise=0.0)"),
    ("hf_qwen3_moe_every_other", {"num_experts_per_tok": 9},
     "config.json num_experts_per_tok=9: must be between 1 and the 8 experts"),
], ids=["attn_softcapping", "final_softcapping", "final_softcapping_qwen3", "rope_longrope",
        "rope_dynamic_per_type", "sliding_rope_linear", "model_type", "bidirectional",
        "gemma_activation", "qwen_activation", "qwen3_attention_bias", "partial_rotary",
        "layer_type", "quantized", "multimodal_text_type", "moe_sigmoid_scores",
        "moe_shared_experts", "moe_jitter", "moe_top_k"])
def test_unsupported_fields_are_refused_in_one_line(tmp_path, capsys, source, change, message):
  hf_json = dict(hf_config.read_hf_config(_path(source)), **change)
  with pytest.raises(HFFormatError) as raised:
    hf_config.model_overrides(hf_json)
  assert str(raised.value) == message
  # The command line: the same line on stderr, exit code 2, before any weight is read.
  (tmp_path / "config.json").write_text(json.dumps(hf_json))
  assert hf.main(["import", f"--hf_dir={tmp_path}", f"--out={tmp_path}/out"]) == 2
  assert capsys.readouterr().err == f"error: {message}\n"
