"""Every bad config is refused before compiling, with one line naming key, value and fix."""

import os

import pytest

from jaxtrain.config import default_config, load_config_file
from jaxtrain.validation.checks import resolve_mesh_shape, validate
from tests.helpers import REPO, assert_one_line_config_error, run_main, small_config


def _set(config, key, value):
  node = config
  *parents, last = key.split(".")
  for p in parents:
    node = node[p]
  node[last] = value


BAD = [
    # (overrides, devices, words the message must contain)
    ({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 3}, 8, ["mesh.data*mesh.stage*mesh.fsdp*mesh.expert*mesh.context*mesh.tensor",
                                                             "12", "8 devices"]),
    ({"mesh.tensor": 3}, 8, ["mesh.tensor=3", "mesh.fsdp=-1", "does not divide the 8"]),
    ({"mesh.data": -1, "mesh.fsdp": -1}, 8, ["only one mesh axis may be -1"]),
    ({"mesh.tensor": 0}, 8, ["mesh.tensor=0", "positive"]),
    ({"mesh.fsdp": 1, "mesh.tensor": 8, "model.num_heads": 8, "model.num_kv_heads": 2}, 8,
     ["mesh.tensor=8", "model.num_kv_heads=2"]),
    ({"mesh.fsdp": 1, "mesh.tensor": 8, "model.num_heads": 4, "model.num_kv_heads": 4}, 8,
     ["mesh.tensor=8", "model.num_heads=4"]),
    ({"model.num_heads": 8, "model.num_kv_heads": 3}, 1, ["model.num_kv_heads=3",
                                                          "model.num_heads=8"]),
    ({"train.global_batch_size": 12, "mesh.fsdp": 8}, 8, ["train.global_batch_size=12",
                                                          "multiple of 8"]),
    ({"train.global_batch_size": 8, "mesh.fsdp": 8, "train.grad_accum_steps": 2}, 8,
     ["train.global_batch_size=8", "train.grad_accum_steps", "multiple of 16"]),
    ({"train.seq_len": 512}, 1, ["train.seq_len=512", "model.max_position_embeddings=256"]),
    ({"model.d_model": 0}, 1, ["model.d_model=0", "positive"]),
    ({"train.steps": -5}, 1, ["train.steps=-5", "positive"]),
    ({"train.global_batch_size": 0}, 1, ["train.global_batch_size=0", "positive"]),
    ({"model.remat_policy": "everything"}, 1, ["model.remat_policy='everything'",
                                                "unknown remat policy", "minimal"]),
    ({"attention.impl": "flash"}, 1, ["attention.impl='flash'", "unknown attention", "xla"]),
    ({"attention.impl": "cudnn"}, 1, ["attention.impl='cudnn'", "GPU"]),
    ({"model.dtype": "fp8"}, 1, ["model.dtype='fp8'", "bfloat16"]),
    ({"model.rope_scaling.type": "longrope"}, 1, ["model.rope_scaling.type='longrope'",
                                                  "llama3", "yarn"]),
    ({"optim.weight_decay": -0.1}, 1, ["optim.weight_decay=-0.1", ">= 0"]),
]


@pytest.mark.parametrize("overrides,devices,words", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_config_names_key_value_and_fix(overrides, devices, words):
  config = small_config()
  config.mesh.fsdp = -1
  for key, value in overrides.items():
    _set(config, key, value)
  assert_one_line_config_error(config, devices, words)


def test_good_configs_validate_and_fill_the_free_axis():
  config = small_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, -1, 2
  shape = validate(config, 8)
  assert (shape.data, shape.fsdp, shape.tensor) == (2, 2, 2)
  assert resolve_mesh_shape(config, 8).batch_shards == 4


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_3b", "llama8b", "llama70b",
                                  "llama405b"])
def test_shipped_configs_validate(name):
  config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  devices = 1 if name == "tiny" else 8
  if name != "tiny":
    config.attention.impl = "xla"
  validate(config, devices, "cpu")
  assert default_config().keys() == config.keys()


def test_cli_bad_mesh_exits_2_with_one_line(tmp_path):
  """Through the real process: the suite's one config error that exits `python -m
  jaxtrain.main` with code 2 (the other CLI errors run in the test process)."""
  proc = run_main("--config=configs/tiny.py", "--config.mesh.tensor=3", f"--workdir={tmp_path}",
                  devices=8, timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, proc.stderr
  assert "mesh.tensor" in lines[0] and "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_llama8b_config_is_llama_3_1_8b():
  m = load_config_file(os.path.join(REPO, "configs", "llama8b.py")).model
  assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size) == (
      32, 4096, 32, 8, 14336, 128256)
  assert m.rope_theta == 500000.0 and m.rope_scaling.type == "llama3"
  assert (m.rope_scaling.factor, m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor,
          m.rope_scaling.original_max_position_embeddings) == (8.0, 1.0, 4.0, 8192)
