"""DeepSeek-V3's multi-token-prediction layer through Hugging Face import and export: the hub's
layout (model.layers.{num_hidden_layers}.*, with copies of the embedding and head), transformers'
own MtpLayer logits (tests/fixtures/hf_deepseek_v3_mtp), keeping or dropping it."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config_file
from jaxtrain.interop import hf, hf_io, hf_config
from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from tests.helpers import safetensors_tensors
from tests.hf_helpers import FIXTURES, LOGIT_TOL, max_logit_error


MTP = os.path.join(FIXTURES, "hf_deepseek_v3_mtp")


@functools.partial(jax.jit, static_argnums=0)
def _prediction_logits(graphdef, params, ids_BT):
  """Depth 1's logits [B, T, V] (at t, for token t + 2; the last position reads past the row)."""
  model = nnx.merge(graphdef, params)
  _, states = model.hidden_states_with_predictions(ids_BT)
  return jnp.einsum("BTD,DV->BTV", states[0], model.head_weights(),
                    preferred_element_type=jnp.float32)


def _prediction_error(model, what):
  ids, want = (np.load(os.path.join(MTP, f)) for f in ("input_ids.npy", "mtp_logits.npy"))
  with jax.default_matmul_precision("highest"):
    got = np.asarray(_prediction_logits(*nnx.split(model), jnp.asarray(ids)))[:, :-1]
  err = float(np.abs(got - want).max())
  print(f"{what}: max abs prediction-layer logit error {err:.3e}")
  assert err <= LOGIT_TOL, f"{what}: max abs prediction-layer logit error {err:.3e}"


def test_a_deepseek_checkpoints_prediction_layer_imports_and_exports(tmp_path):
  """DeepSeek-V3's hub checkpoints store their multi-token-prediction layer after the decoder
  (model.layers.{num_hidden_layers}.*, with copies of the embedding and head): import keeps it
  (model.mtp_depth=1) with transformers' MtpLayer logits; export writes it back where it was,
  and the export imports again to the same logits; mtp_depth=0 leaves it out."""
  model, config = hf.load_model(MTP)
  assert config.model.mtp_depth == 1
  _prediction_error(model, "hf_deepseek_v3_mtp")
  hf.save_model(model, config, str(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
  again, again_config = hf.load_model(str(tmp_path))
  assert again_config.model.mtp_depth == 1
  _prediction_error(again, "hf_deepseek_v3_mtp exported and imported again")
  dropped, dropped_config = hf.load_model(MTP, mtp_depth=0)
  assert dropped_config.model.mtp_depth == 0 and not hasattr(dropped, "mtp")
  max_logit_error(dropped, MTP, "hf_deepseek_v3_mtp with its prediction layer left out")
  # transformers' save_pretrained keeps num_nextn_predict_layers=1 and writes no such layer.
  assert hf.load_model(os.path.join(FIXTURES, "hf_deepseek_v3"))[1].model.mtp_depth == 0
  with pytest.raises(HFFormatError, match=r"mtp_depth=2: .* holds 1 multi-token-prediction "
                                          r"layer\(s\) \(config.json declares 1\)"):
    hf.load_model(MTP, mtp_depth=2)
  with pytest.raises(HFFormatError, match=r"mtp_depth=1: llama checkpoints have no"):
    hf.load_model(os.path.join(FIXTURES, "hf_llama_gqa_llama3"), mtp_depth=1)


def test_a_prediction_layer_the_config_does_not_declare_is_refused(tmp_path):
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  save_file(safetensors_tensors(MTP), str(tmp_path / "model.safetensors"),
            metadata={"format": "pt"})
  config = hf_config.read_hf_config(MTP)
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
  with pytest.raises(HFFormatError, match=r"no place for: model.layers.3.eh_proj.weight, model.layers.3.embed_tokens"):
    hf.load_model(str(tmp_path))


def test_cli_import_keeps_or_drops_the_prediction_layer(tmp_path, capsys):
  assert hf.main(["import", f"--hf_dir={MTP}", f"--out={tmp_path / 'kept'}"]) == 0
  assert hf.main(["import", f"--hf_dir={MTP}", f"--out={tmp_path / 'dropped'}",
                  "--mtp_depth=0"]) == 0
  for name, depth in (("kept", 1), ("dropped", 0)):
    written = json.loads((tmp_path / name / "jaxtrain_config.json").read_text())
    assert written["overrides"]["model.mtp_depth"] == depth
    assert f"c.model.mtp_depth = {depth}" in (tmp_path / name / "config.py").read_text()
  assert "--config.model.mtp_depth=0" in capsys.readouterr().out
  # A run without the prediction module can start from the weights that keep it.
  from jaxtrain.checkpointing import (  # pylint: disable=import-outside-toplevel
      weights as checkpoint_weights)
  config = load_config_file(str(tmp_path / "kept" / "config.py"))
  for depth in (1, 0):
    config.model.mtp_depth = depth
    _, abstract, _ = abstract_model(ModelConfig.from_config(config), hf_io.default_mesh())
    params, _ = checkpoint_weights.load_params(str(tmp_path / "kept"), abstract)
    assert ("mtp" in params) == bool(depth)
