"""Tests for jaxtrain.train.metrics: parameter/FLOP counts, peak lookup, MFU and the metric
writers."""

import glob
import json
import math
import os
import types

import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain.models import cost
from jaxtrain.models.config import architecture_of
from jaxtrain.train import metrics


def _model(**fields):
  """The Architecture of the default config's model with `fields` changed."""
  c = config_lib.default_config()
  for key, value in fields.items():
    c.model[key] = value
  return architecture_of(c)


LLAMA_8B = dict(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                mlp_dim=14336, vocab_size=128256, tie_embeddings=False)
LLAMA_70B = dict(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                 mlp_dim=28672, vocab_size=128256, tie_embeddings=False)
LLAMA_405B = dict(num_layers=126, d_model=16384, num_heads=128, num_kv_heads=8, head_dim=128,
                  mlp_dim=53248, vocab_size=128256, tie_embeddings=False)
LLAMA_1B = dict(num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                mlp_dim=8192, vocab_size=128256, tie_embeddings=True)
TINY = dict(num_layers=2, d_model=16, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32,
            vocab_size=100, tie_embeddings=False)


def test_llama_8b_param_count_exact():
  assert metrics.count_params(_model(**LLAMA_8B)) == 8_030_261_248


@pytest.mark.parametrize("fields,expected", [
    (LLAMA_8B, 8.03e9), (LLAMA_70B, 70.55e9), (LLAMA_405B, 405.85e9), (LLAMA_1B, 1.236e9)])
def test_llama_param_counts(fields, expected):
  assert metrics.count_params(_model(**fields)) == pytest.approx(expected, rel=1e-3)


def test_tied_embeddings_remove_one_vocab_matrix():
  untied = metrics.count_params(_model(**TINY))
  tied = metrics.count_params(_model(**{**TINY, "tie_embeddings": True}))
  assert untied - tied == 100 * 16
  # The head matmul happens once either way, so FLOPs do not depend on tying.
  assert metrics.flops_per_token(_model(**TINY), 32) == metrics.flops_per_token(
      _model(**{**TINY, "tie_embeddings": True}), 32)


def test_tiny_param_count_by_hand():
  # embed 100*16; per layer q 16*32, k,v 16*16 each, o 32*16, mlp 3*16*32, norms 2*16; final 16.
  per_layer = 512 + 2 * 256 + 512 + 1536 + 32
  assert metrics.count_params(_model(**TINY)) == 1600 + 2 * per_layer + 16 + 1600


def test_flops_per_token_by_hand():
  seq_len = 32
  matmul = 2 * (512 + 2 * 256 + 512 + 1536) + 16 * 100  # layers + lm head; no embed, no norms
  attention = 3 * 2 * (4 * seq_len * 4 * 8) * 0.5  # fwd+bwd x L x (QK^T + AV) x causal half
  assert attention == 6 * 2 * seq_len * 4 * 8
  assert cost.matmul_params(_model(**TINY)) == matmul
  assert metrics.flops_per_token(_model(**TINY), seq_len) == 6 * matmul + attention
  assert metrics.flops_per_step(_model(**TINY), seq_len, 8) == (
      (6 * matmul + attention) * seq_len * 8)


def test_flops_per_token_8b_close_to_6n():
  model = _model(**LLAMA_8B)
  fpt = metrics.flops_per_token(model, 8192)
  # Dense part is 6 * (params - embedding - norms); attention adds 6*L*T*H*E.
  dense = 6 * (8_030_261_248 - 128256 * 4096 - (2 * 32 + 1) * 4096)
  assert fpt == dense + 6 * 32 * 8192 * 32 * 128


def _device(kind, platform="gpu"):
  return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize("kind,expected", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("nvidia a100-pcie-40gb", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU v6e", 918e12),
])
def test_peak_table_lookup(kind, expected):
  platform = "tpu" if "TPU" in kind else "gpu"
  peak, source = metrics.peak_flops_per_device(_device(kind, platform))
  assert peak == expected
  assert kind in source


def test_unknown_accelerator_has_no_peak():
  peak, source = metrics.peak_flops_per_device(_device("Mystery Accelerator 9000"))
  assert peak is None
  assert "unknown device kind" in source
  assert metrics.mfu(1000.0, 1e9, peak) is None


def test_cpu_peak_is_measured_and_split_over_devices():
  import jax
  host = metrics.measure_cpu_matmul_peak()
  assert host > 0 and math.isfinite(host)
  peak, source = metrics.peak_flops_per_device(_device("cpu", "cpu"))
  assert peak == pytest.approx(host / len(jax.local_devices(backend="cpu")))
  assert "measured" in source
  total, _ = metrics.peak_flops_for_devices(jax.local_devices(backend="cpu"))
  assert total == pytest.approx(host)


def test_mfu():
  assert metrics.mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)


def test_format_table_aligns_columns():
  text = metrics.format_table([("devices", "8 x cpu"), ("parameters", "1.24B")], title="run")
  lines = text.splitlines()
  assert lines[0] == "run"
  assert set(lines[1]) == {"-"}
  assert lines[2].index("8 x cpu") == lines[3].index("1.24B")


def _read_jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]  # json.loads rejects nothing we must not write


def test_metrics_writer_jsonl_tensorboard_and_console(tmp_path, capsys):
  import jax.numpy as jnp
  with metrics.MetricsWriter(str(tmp_path), tensorboard=True, total_steps=1000) as writer:
    writer.write_train(10, {"loss": jnp.float32(2.5), "learning_rate": np.float64(3e-4),
                            "grad_norm": np.float32(0.87), "tokens_per_sec": 41234.0,
                            "mfu": 0.123, "tokens": np.int64(81920)})
    writer.write_train(120, {"loss": float("nan"), "learning_rate": 3e-4,
                             "grad_norm": np.float32(np.inf), "tokens_per_sec": 41234.0,
                             "mfu": None})
    writer.write_eval(200, jnp.asarray(2.25), eval_tokens=4096)
  out = capsys.readouterr().out.splitlines()

  path = tmp_path / "metrics.jsonl"
  with open(path, encoding="utf-8") as f:
    raw = f.read()
  assert "NaN" not in raw and "Infinity" not in raw
  records = _read_jsonl(path)
  assert records[0] == {"step": 10, "loss": 2.5, "learning_rate": pytest.approx(3e-4),
                        "grad_norm": pytest.approx(0.87), "tokens_per_sec": 41234.0,
                        "mfu": 0.123, "tokens": 81920}
  assert isinstance(records[0]["tokens"], int)
  assert records[1]["loss"] is None and records[1]["grad_norm"] is None
  assert records[2] == {"step": 200, "eval_loss": 2.25, "eval_tokens": 4096}

  assert glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*"))

  first, second = out[0], out[1]
  assert "step   10/1000" in first
  assert "loss 2.5000" in first
  assert "lr 3.00e-04" in first
  assert "gnorm 0.87" in first
  assert "41.2k tok/s" in first
  assert "MFU 12.3%" in first
  assert "ETA" not in first  # No rate yet: the first interval includes compilation.
  assert "step  120/1000" in second and "loss nan" in second and "MFU n/a" in second
  assert "ETA" in second
  assert "eval" in out[2] and "2.2500" in out[2]


def test_metrics_writer_appends_and_survives_without_close(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False, total_steps=10)
  writer.write_train(1, {"loss": 1.0})
  # Flushed on every write: readable before close, as after a crash.
  assert _read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]
  writer.close()
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False, total_steps=10) as writer:
    writer.write_eval(2, 0.5)
  assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 2
  assert not os.path.exists(tmp_path / "tensorboard")


def test_tensorboard_scalars_readable(tmp_path):
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  with metrics.MetricsWriter(str(tmp_path), total_steps=5) as writer:
    writer.write_train(1, {"loss": 3.0, "learning_rate": 1e-3})
    writer.write_eval(1, 2.0)
  tags = set()
  for path in glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*")):
    tags |= _event_tags(path, event_pb2)
  assert {"train/loss", "train/learning_rate", "eval/loss"} <= tags


def _event_tags(path, event_pb2):
  # TFRecord framing: uint64 length, uint32 crc, payload, uint32 crc.
  tags = set()
  with open(path, "rb") as f:
    data = f.read()
  offset = 0
  while offset + 12 <= len(data):
    length = int.from_bytes(data[offset:offset + 8], "little")
    payload = data[offset + 12:offset + 12 + length]
    offset += 12 + length + 4
    event = event_pb2.Event.FromString(payload)
    tags |= {v.tag for v in event.summary.value}
  return tags
