"""Hugging Face interop: import/export parity with transformers' Llama, config mapping, refusals.

No torch here: tests/fixtures/hf_llama_* hold tiny models saved by transformers and the float32
logits and loss it computed (scripts/make_hf_fixtures.py regenerates them, in a virtual
environment with the [parity] extra); import must reproduce them on one device and on 8-device
meshes, export must write the same tensors, and the config.json that transformers was checked to
load back into the same logits (hf_llama_gqa8_head_dim_llama3's export_config.*.json).

Parity bar: max abs logit error <= 1e-4 in float32 with the highest matmul precision.
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config as config_lib
from jaxtrain.checkpointing.weights import load_params
from jaxtrain.interop import hf, hf_io, hf_config, hf_weights
from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from jaxtrain.objectives.forward import loss_sum_fn
from jaxtrain.validation import checks as config_checks
from tests.helpers import mesh_of, safetensors_tensors

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
GQA = os.path.join(FIXTURES, "hf_llama_gqa_llama3")
TIED = os.path.join(FIXTURES, "hf_llama_tied_legacy")
MHA_DEFAULT_ROPE = os.path.join(FIXTURES, "hf_llama_mha_default_rope")
TIED_GQA_DEFAULT_ROPE = os.path.join(FIXTURES, "hf_llama_tied_gqa_default_rope")
# 8 query heads of head_dim 8 over hidden size 32, llama3 RoPE; with transformers' check of
# jaxtrain's export (the round trip).
WIDE_HEADS = os.path.join(FIXTURES, "hf_llama_gqa8_head_dim_llama3")
# Each fixture's RoPE as the import must map it: (type, original_max_position_embeddings).
FIXTURE_ROPE = {GQA: ("llama3", 16), TIED: ("llama3", 16), MHA_DEFAULT_ROPE: ("none", None),
                TIED_GQA_DEFAULT_ROPE: ("none", None), WIDE_HEADS: ("llama3", 16)}
LOGIT_TOL = 1e-4
LOSS_TOL = 1e-5


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(graphdef, params, ids_BT, with_loss=True):
  """(float32 logits [B, T, V] of `ids_BT` from `model(ids)`, and the mean next-token loss
  through the trainer's chunked cross-entropy, or NaN without `with_loss`)."""
  logits_BTV = nnx.merge(graphdef, params)(ids_BT)
  if not with_loss:
    return logits_BTV, jnp.float32(jnp.nan)
  b, t = ids_BT.shape
  batch = {"inputs": ids_BT[:, :-1], "targets": ids_BT[:, 1:],
           "loss_mask": jnp.ones((b, t - 1), jnp.float32),
           "segment_ids": jnp.ones((b, t - 1), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))}
  total, count, _ = loss_sum_fn(params, graphdef, batch, 16)
  return logits_BTV, total / count


def _run_params(graphdef, params, ids, with_loss=True):
  with jax.default_matmul_precision("highest"):
    logits, loss = _forward(graphdef, params, jnp.asarray(ids), with_loss)
  return np.asarray(logits), float(loss)


def _run(model, ids, with_loss=True):
  """(float32 logits, mean loss) of an imported model, at the highest matmul precision."""
  return _run_params(*nnx.split(model), ids, with_loss)


def _fixture(path):
  return (np.load(os.path.join(path, "input_ids.npy")), np.load(os.path.join(path, "logits.npy")),
          float(np.load(os.path.join(path, "loss.npy"))))


def _assert_parity(model, path, what, with_loss=True):
  ids, want_logits, want_loss = _fixture(path)
  logits, loss = _run(model, ids, with_loss)
  assert logits.dtype == np.float32 and logits.shape == want_logits.shape
  err = float(np.abs(logits - want_logits).max())
  assert err <= LOGIT_TOL, f"{what}: max abs logit error {err:.3e} > {LOGIT_TOL}"
  if not with_loss:
    return err, None
  assert abs(loss - want_loss) <= LOSS_TOL, (f"{what}: loss {loss:.6f} vs transformers "
                                             f"{want_loss:.6f} (error {abs(loss - want_loss):.2e})")
  return err, abs(loss - want_loss)


# --------------------------------------------------------------------------------------------
# Fixture parity (no torch)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [GQA, TIED, MHA_DEFAULT_ROPE, TIED_GQA_DEFAULT_ROPE, WIDE_HEADS],
                         ids=["gqa_llama3_sharded", "tied_legacy", "mha_default_rope",
                              "tied_gqa_default_rope", "gqa8_head_dim_llama3_sharded"])
def test_fixture_import_matches_transformers_logits_and_loss(path):
  model, config = hf.load_model(path)
  _assert_parity(model, path, os.path.basename(path))
  hf_json = hf_config.read_hf_config(path)
  m = config.model
  assert (m.d_model, m.num_heads, m.num_kv_heads, m.head_dim) == (
      hf_json["hidden_size"], hf_json["num_attention_heads"], hf_json["num_key_value_heads"],
      hf_json["head_dim"])
  assert m.tie_embeddings == hf_json["tie_word_embeddings"]
  rope_type, original = FIXTURE_ROPE[path]
  assert m.rope_scaling.type == rope_type
  if original is not None:
    assert m.rope_scaling.original_max_position_embeddings == original
  assert config.train.seq_len <= m.max_position_embeddings
  config_checks.validate(config, 1, "cpu")  # trainable as is


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1), {"context": 2, "fsdp": 2, "tensor": 2}])
def test_sharded_import_onto_8_devices_gives_the_same_logits(shape):
  mesh = mesh_of(shape)
  model, config = hf.load_model(GQA, mesh=mesh)
  _, _, shardings = abstract_model(ModelConfig.from_config(config), mesh)
  params = nnx.state(model, nnx.Param)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert got.sharding == want
  with jax.set_mesh(mesh):  # under a context axis: the split sequence, logits back in order
    _assert_parity(model, GQA, f"mesh {shape}", with_loss=False)


def test_import_reads_each_shard_once_and_only_its_slice(monkeypatch):
  """On (2,2,2) every device reads only its (fsdp, tensor) block of a projection, and the two
  devices along `data` holding the same block share one read."""
  reads = []
  get_slice = hf_weights.SafetensorsReader.get_slice

  class Recorder:
    def __init__(self, name, inner):
      self.name, self.inner = name, inner

    def get_shape(self):
      return self.inner.get_shape()

    def __getitem__(self, index):
      block = self.inner[index]
      reads.append((self.name, block.shape))
      return block

  monkeypatch.setattr(hf_weights.SafetensorsReader, "get_slice",
                      lambda self, name: Recorder(name, get_slice(self, name)))
  hf.load_model(GQA, mesh=mesh_of((2, 2, 2)))
  q_reads = [shape for name, shape in reads if name == "model.layers.0.self_attn.q_proj.weight"]
  # q_proj [H*E, D] = [32, 32]: heads split over tensor=2, model dim over fsdp=2.
  assert q_reads == [(16, 16)] * 4, q_reads
  embed_reads = [shape for name, shape in reads if name == "model.embed_tokens.weight"]
  assert embed_reads == [(64, 16)] * 4, embed_reads  # [V, D] = [128, 32]: vocab/2, model/2


def test_config_json_in_both_rope_spellings_maps_to_the_same_config():
  new = hf_config.read_hf_config(GQA)
  legacy = dict(new)
  rope = dict(legacy.pop("rope_parameters"))
  legacy["rope_theta"] = rope.pop("rope_theta")
  legacy["rope_scaling"] = rope
  oldest = dict(legacy, rope_scaling={("type" if k == "rope_type" else k): v
                                      for k, v in rope.items()})
  want = hf_config.model_overrides(new)
  assert hf_config.model_overrides(legacy) == want
  assert hf_config.model_overrides(oldest) == want
  assert want["model.rope_scaling.type"] == "llama3"
  assert want["model.rope_scaling.factor"] == 4.0


def test_optional_fields_take_transformers_defaults():
  sparse = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 8}
  got = hf_config.model_overrides(sparse)
  assert got["model.num_kv_heads"] == 8 and got["model.head_dim"] == 8
  assert got["model.rope_theta"] == 10000.0 and got["model.rope_scaling.type"] == "none"
  assert got["model.norm_eps"] == 1e-6 and got["model.max_position_embeddings"] == 2048
  assert got["model.tie_embeddings"] is False
  # llama3 without original_max_position_embeddings: transformers uses max_position_embeddings.
  scaled = dict(sparse, max_position_embeddings=512, rope_parameters={
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
  got = hf_config.model_overrides(scaled)
  assert got["model.rope_scaling.original_max_position_embeddings"] == 512


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "falcon", r"model_type='falcon': unsupported; jaxtrain imports model_type "
                             r"llama, qwen3, qwen2, mistral, gemma3_text, gemma3, mixtral, qwen3_moe, "
                             r"deepseek_v3$"),
    ("hidden_act", "gelu", r"hidden_act='gelu': unsupported"),
    ("attention_bias", True, r"attention_bias=True: unsupported"),
    ("mlp_bias", True, r"mlp_bias=True: unsupported"),
    ("rope_parameters", {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4},
     r"rope_parameters.rope_type='longrope': unsupported"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                         "attention_factor": 1.2}, r"rope_parameters.attention_factor=1.2"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, r"rope_scaling.rope_type='dynamic'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
     r"rope_parameters.low_freq_factor: missing"),
    ("dtype", "float8_e4m3fn", r"dtype='float8_e4m3fn': unsupported"),
    ("num_key_value_heads", 3, r"num_key_value_heads=3: does not divide"),
])
def test_unsupported_config_fields_are_refused_by_name(tmp_path, field, value, message):
  hf_json = hf_config.read_hf_config(GQA)
  if field == "rope_scaling":
    hf_json.pop("rope_parameters")
  hf_json[field] = value
  (tmp_path / "config.json").write_text(json.dumps(hf_json))
  with pytest.raises(HFFormatError, match=message):
    hf.load_model(str(tmp_path))


def test_bad_directories_and_meshes_are_named(tmp_path):
  with pytest.raises(HFFormatError, match="has no config.json"):
    hf.load_model(str(tmp_path))
  hf_json = hf_config.read_hf_config(GQA)
  (tmp_path / "config.json").write_text(json.dumps(dict(hf_json, rope_scaling={
      "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16})))
  with pytest.raises(HFFormatError, match="rope_scaling=.* and rope_parameters=.*disagree"):
    hf.load_model(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(hf_json))
  with pytest.raises(HFFormatError, match="no model.safetensors"):
    hf.load_model(str(tmp_path))
  shutil.copy(os.path.join(GQA, "model.safetensors.index.json"), tmp_path)
  with pytest.raises(HFFormatError, match=r"names model-0000\d-of-00003.safetensors for .*, "
                                          r"which is missing"):
    hf.load_model(str(tmp_path))
  for name in os.listdir(GQA):
    if name.endswith(".safetensors"):
      shutil.copy(os.path.join(GQA, name), tmp_path)
  (tmp_path / "model-00002-of-00003.safetensors").write_bytes(b"\x10\x00\x00\x00" * 4)
  with pytest.raises(HFFormatError, match="model-00002-of-00003.safetensors: not a readable"):
    hf.load_model(str(tmp_path))
  with pytest.raises(HFFormatError, match=r"tensor=8 does not divide dim 2 \(size 2\) of "
                                          r"layers/attn/wk_DKE"):
    hf.load_model(GQA, mesh=mesh_of((1, 1, 8)))


def test_pickle_weights_are_refused(tmp_path):
  shutil.copy(os.path.join(TIED, "config.json"), tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
  with pytest.raises(HFFormatError, match=r"pytorch_model.bin.*convert to safetensors first; "
                                          r"pickle files can run code"):
    hf.load_model(str(tmp_path))


def test_missing_and_misshapen_tensors_are_named(tmp_path):
  hf_json = hf_config.read_hf_config(TIED)
  shutil.copy(os.path.join(TIED, "model.safetensors"), tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(dict(hf_json, tie_word_embeddings=False)))
  with pytest.raises(HFFormatError, match=r"missing from the safetensors: lm_head.weight"):
    hf.load_model(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(dict(hf_json, intermediate_size=96)))
  with pytest.raises(HFFormatError, match=r"gate_proj.weight has shape \[64, 32\], config.json "
                                          r"implies \[96, 32\]"):
    hf.load_model(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(dict(hf_json, num_hidden_layers=1)))
  with pytest.raises(HFFormatError, match=r"no place for: model.layers.1"):
    hf.load_model(str(tmp_path))


def test_bare_llama_model_names_without_the_model_prefix_import(tmp_path):
  """LlamaModel exports (no "model." prefix, no lm_head) of a tied model load the same."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  save_file({k.removeprefix("model."): v for k, v in safetensors_tensors(TIED).items()},
            str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  shutil.copy(os.path.join(TIED, "config.json"), tmp_path)
  model, _ = hf.load_model(str(tmp_path))
  _assert_parity(model, TIED, "bare LlamaModel names")


@pytest.mark.parametrize("path,shape", [(GQA, (2, 2, 2)), (TIED, (1, 8, 1)),
                                        (GQA, {"context": 4, "fsdp": 2})],
                         ids=["gqa_from_8_devices", "tied", "gqa_from_context_4"])
def test_export_writes_the_same_tensors_and_reimports(tmp_path, path, shape):
  model, config = hf.load_model(path, mesh=mesh_of(shape))
  out = tmp_path / "hf"
  written = hf.save_model(model, config, str(out), max_file_bytes=50_000)
  assert "model.safetensors.index.json" in written and "config.json" in written
  original, exported = safetensors_tensors(path), safetensors_tensors(out)
  if config.model.tie_embeddings:
    assert "lm_head.weight" not in exported
  assert sorted(exported) == sorted(original)
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name], x, err_msg=name)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"]) == set(original)
  again, _ = hf.load_model(str(out))
  _assert_parity(again, path, "re-imported export", with_loss=False)
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    assert (out / "tokenizer.json").read_bytes() == open(os.path.join(path, "tokenizer.json"),
                                                         "rb").read()
  with pytest.raises(HFFormatError, match="already holds"):
    hf.save_model(model, config, str(out))


def test_unrolled_layers_import_and_export(tmp_path):
  config = hf_config.to_jaxtrain_config(hf_config.read_hf_config(GQA), GQA)
  config.model.scan_layers = False
  model = hf_io.load_weights(GQA, config, mesh=mesh_of((1, 2, 2)))
  assert "0" in {str(k) for k in nnx.state(model, nnx.Param)["layers"].keys()}
  _assert_parity(model, GQA, "unrolled layers", with_loss=False)
  hf.save_model(model, config, str(tmp_path))
  original, exported = safetensors_tensors(GQA), safetensors_tensors(tmp_path)
  assert sorted(exported) == sorted(original)
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name], x, err_msg=name)


@pytest.mark.parametrize("spelling", hf_config.ROPE_SPELLINGS)
def test_export_writes_what_transformers_loaded_back(tmp_path, spelling):
  """The round trip through transformers, carried by the fixture: scripts/make_hf_fixtures.py
  exported WIDE_HEADS in each rope spelling, loaded each export with transformers'
  from_pretrained and got the source's logits back (the error it measured is in
  fixture_info.json), keeping the config.json it loaded. Imported here onto (2,2,2) and exported
  sharded, jaxtrain writes that config.json again and bitwise the source's tensors, which are
  what transformers computed the fixture's logits from."""
  model, config = hf.load_model(WIDE_HEADS, mesh=mesh_of((2, 2, 2)))
  _assert_parity(model, WIDE_HEADS, "gqa8 head_dim 8 on (2,2,2)", with_loss=False)
  written = hf.save_model(model, config, str(tmp_path), max_file_bytes=40_000,
                          rope_spelling=spelling)
  assert "model.safetensors.index.json" in written
  with open(os.path.join(WIDE_HEADS, f"export_config.{spelling}.json"), encoding="utf-8") as f:
    loaded_by_transformers = json.load(f)
  assert json.loads((tmp_path / "config.json").read_text()) == loaded_by_transformers
  original, exported = safetensors_tensors(WIDE_HEADS), safetensors_tensors(tmp_path)
  assert sorted(exported) == sorted(original)
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name], x, err_msg=name)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"]) == set(original)
  with open(os.path.join(WIDE_HEADS, "fixture_info.json"), encoding="utf-8") as f:
    checked = json.load(f)["round_trip"][spelling]
  assert checked["max_abs_logit_error"] <= LOGIT_TOL, checked
  assert checked["rope_parameters"]["rope_type"] == "llama3"
  assert checked["rope_parameters"]["original_max_position_embeddings"] == 16


@pytest.mark.parametrize("spelling", hf_config.ROPE_SPELLINGS)
def test_exported_config_round_trips_in_both_spellings(tmp_path, spelling):
  model, config = hf.load_model(GQA)
  hf.save_model(model, config, str(tmp_path), rope_spelling=spelling, dtype="bfloat16")
  written = json.loads((tmp_path / "config.json").read_text())
  assert ("rope_parameters" in written) == (spelling == "rope_parameters")
  assert written.get("dtype", written.get("torch_dtype")) == "bfloat16"
  assert written["bos_token_id"] == 0 and written["eos_token_id"] == 1  # from tokenizer.json
  assert hf_config.model_overrides(written) == hf_config.model_overrides(
      hf_config.read_hf_config(GQA))
  assert {t.dtype for t in safetensors_tensors(tmp_path).values()} == {np.dtype("bfloat16")}
  # A bfloat16 checkpoint imports as float32 parameters holding exactly the bfloat16 values.
  again, _ = hf.load_model(str(tmp_path))
  for got, want in zip(jax.tree.leaves(nnx.state(again, nnx.Param)),
                       jax.tree.leaves(nnx.state(model, nnx.Param))):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))


def test_cli_import_writes_a_trainable_weights_directory_and_export_reverses_it(tmp_path,
                                                                                capsys):
  weights = tmp_path / "weights"
  assert hf.main(["import", f"--hf_dir={GQA}", f"--out={weights}", "--dtype=bfloat16"]) == 0
  printed = capsys.readouterr().out
  assert f"--config={weights}/config.py" in printed
  assert "--config.model.num_kv_heads=2" in printed
  assert {"params", "config.py", "jaxtrain_config.json", "tokenizer.json"} <= set(
      os.listdir(weights))
  config = config_lib.load_config_file(str(weights / "config.py"))
  assert config.checkpoint.init_from == str(weights)
  assert config.data.tokenizer == f"hf:{weights}/tokenizer.json"
  config_checks.validate(config, 1, "cpu")
  # What the trainer does with checkpoint.init_from: bfloat16 storage restores as float32.
  cfg = ModelConfig.from_config(config)
  graphdef, abstract_params, _ = abstract_model(cfg, hf_io.default_mesh())
  params, _ = load_params(config.checkpoint.init_from, abstract_params)
  ids, want, _ = _fixture(GQA)
  logits, _ = _run_params(graphdef, params, ids)
  err = float(np.abs(logits - want).max())
  assert 1e-4 < err < 0.1, f"bfloat16 storage: max abs logit error {err:.3e}"

  out = tmp_path / "hf"
  assert hf.main(["export", f"--checkpoint={weights}", f"--out={out}",
                  "--max_shard_size=60KB"]) == 0
  exported = safetensors_tensors(out)
  original = safetensors_tensors(GQA)
  for name, x in original.items():  # float32 of the bfloat16-rounded weights
    np.testing.assert_array_equal(exported[name], x.astype(jnp.bfloat16).astype(np.float32),
                                  err_msg=name)
  assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("argv,message", [
    (["import", "--hf_dir=/nonexistent/dir", "--out=OUT"], r"/nonexistent/dir: no such directory"),
    (["import", "--hf_dir=HF"], r"the following arguments are required: --out"),
    (["import", "--hf_dir=HF", "--out=OUT", "--dtype=int8"], r"invalid choice: 'int8'"),
    (["export", "--checkpoint=OUT", "--out=OUT2"], r"--config: required"),
    (["export", "--checkpoint=OUT", "--config=cfg.py", "--out=OUT2", "--max_shard_size=lots"],
     r"--max_shard_size='lots'"),
])
def test_cli_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
  argv = [a.replace("=HF", f"={TIED}").replace("=OUT", f"={tmp_path}/out")
          .replace("=cfg.py", f"={tmp_path}/cfg.py") for a in argv]
  (tmp_path / "cfg.py").write_text("from jaxtrain.config import default_config\n"
                                   "get_config = default_config\n")
  try:
    code = hf.main(argv)
  except SystemExit as e:  # argparse's own errors
    code = e.code
  err = capsys.readouterr().err
  assert code == 2
  assert len(err.strip().splitlines()) == 1, err
  assert __import__("re").search(message, err), err


@pytest.mark.slow  # a fresh interpreter importing jax: seconds
def test_cli_module_entry_point_exits_2_on_pickle_weights(tmp_path):
  shutil.copy(os.path.join(TIED, "config.json"), tmp_path)
  (tmp_path / "consolidated.00.pth").write_bytes(b"\x80\x04")
  proc = subprocess.run([sys.executable, "-m", "jaxtrain.interop.hf", "import",
                         f"--hf_dir={tmp_path}", f"--out={tmp_path}/out"],
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
  assert "convert to safetensors first" in proc.stderr


def test_read_block_selects_exactly_the_shard(tmp_path):
  """A [H*E, D] q_proj cut by heads and model dim lands as the matching block of wq_DHE."""
  rule = hf_weights.LAYER_RULES[0]
  sizes = {"H": 4, "E": 3, "D": 5}
  w_hf = np.arange(4 * 3 * 5, dtype=np.float32).reshape(12, 5)
  w_DHE = w_hf.T.reshape(5, 4, 3)
  cuts = {"D": slice(1, 4), "H": slice(2, 4), "E": slice(0, 3)}
  got = hf_weights.read_block(w_hf, rule, sizes, cuts)
  np.testing.assert_array_equal(got, w_DHE[1:4, 2:4, :])
  np.testing.assert_array_equal(hf_weights.to_hf_layout(w_DHE, rule, sizes), w_hf)
  o_rule = hf_weights.LAYER_RULES[3]
  w_o = np.arange(5 * 12, dtype=np.float32).reshape(5, 12)
  w_HED = w_o.T.reshape(4, 3, 5)
  np.testing.assert_array_equal(hf_weights.read_block(w_o, o_rule, sizes, cuts),
                                w_HED[2:4, :, 1:4])
