"""QK-clip (train/qk_clip.py) and the largest-logit tracking it reads (ops/max_logit.py): the
per-head maxima equal the masked scores' maxima; after a clip the same batch's maxima are the
threshold for the clipped heads and unchanged for the others, in grouped-query and latent
attention; a Muon run with the clip keeps its logged maximum near the threshold, one without
passes it; bad settings are refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config_file
from jaxtrain.models import attention_stats
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import init_params
from jaxtrain.ops import max_logit as max_logit_lib
from jaxtrain.ops.max_logit import max_logit_per_head
from jaxtrain.train.qk_clip import qk_clip
from tests.helpers import (assert_one_line_config_error, family_config, mesh_of, packed_batch,
                           run_tiny, small_config)


def _reference_max(q, k, pos, seg, scale, window):
  """Every score, masked as attention masks it, then the max per query head (numpy)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  group = q.shape[2] // k.shape[2]
  k = np.repeat(k, group, axis=2)
  scores = np.einsum("bthe,bshe->bhts", q, k) * scale
  seen = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  seen &= pos[:, None, :] <= pos[:, :, None]
  if window:
    seen &= pos[:, :, None] - pos[:, None, :] < window
  return np.where(seen[:, None], scores, -np.inf).max(axis=(0, 2, 3))


@pytest.mark.parametrize("window,chunk_scores", [(None, 1 << 20), (5, 64)])
def test_max_logit_per_head_equals_the_masked_scores_maximum(window, chunk_scores, monkeypatch):
  """Grouped-query heads (8 queries over 2 keys), two documents and padding per row, a window;
  chunk_scores 64: queries in chunks of 2 (the chunked path)."""
  monkeypatch.setattr(max_logit_lib, "_CHUNK_SCORES", chunk_scores)
  rng = np.random.default_rng(0)
  b, t, h, kv, e = 2, 32, 8, 2, 16
  q = rng.normal(size=(b, t, h, e)).astype(np.float32) * 2
  k = rng.normal(size=(b, t, kv, e)).astype(np.float32) * 2
  seg = np.array([[1] * 12 + [2] * 16 + [0] * 4, [3] * 20 + [4] * 12])
  pos = np.stack([np.concatenate([np.arange(12), np.arange(16), np.arange(4)]),
                  np.concatenate([np.arange(20), np.arange(12)])])
  got = max_logit_per_head(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(seg),
                           sm_scale=0.3, window=window)
  np.testing.assert_allclose(np.asarray(got), _reference_max(q, k, pos, seg, 0.3, window),
                             rtol=1e-5)


def _model_max_logits(graphdef, params, batch):
  """[L, H]: the model's attention maxima on `batch` (the forward the objective runs)."""
  model = nnx.merge(graphdef, params)
  with attention_stats.collect_max_logits() as passes:
    model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
  assert len(passes) == 1
  return passes[0]


@pytest.mark.parametrize("config_of", [
    lambda: small_config(),                               # Llama: grouped-query, 8 over 4 heads
    lambda: family_config("qwen2"),                       # q/k biases
    lambda: small_config(scan_layers=False),              # layers one by one
    lambda: load_config_file("configs/deepseek_tiny.py"),  # latent attention, a dense stack + MTP
], ids=["llama", "qwen2_biases", "unrolled", "deepseek_mla"])
def test_after_a_clip_the_clipped_heads_reach_the_threshold_and_the_rest_are_unchanged(config_of):
  """The threshold between the heads' maxima: after qk_clip the same batch gives exactly the
  threshold for every head above it, the same maxima for the others; values, outputs and
  (latent attention) the shared rotary key are untouched."""
  config = config_of()
  config.optim.log_max_logit = True
  config.train.seq_len = 32
  cfg = ModelConfig.from_config(config, platform="cpu")
  mesh = mesh_of({})
  with jax.set_mesh(mesh):
    graphdef, params = init_params(cfg, mesh, seed=0)
    # Sharper logits than the init's, so the heads' maxima spread out; biases (zero at init)
    # that move the logits, so a bias the clip missed shows.
    def sharpen(path, x):
      names = [getattr(k, "key", None) for k in path]
      if any(n in ("wq_DHE", "wk_DKE", "wq_b_QHE", "wkv_b_RHB") for n in names):
        return x * 8
      if any(n in ("bq_HE", "bk_KE") for n in names):
        return x + jax.random.normal(jax.random.key(len(names)), x.shape, x.dtype)
      return x
    params = jax.tree_util.tree_map_with_path(sharpen, params)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(
        4, 32, config.model.vocab_size, seed=1).items()}
    # (the multi-token modules' attention runs in the training forward only)
    forward = jax.jit(_mtp_max_logits if cfg.arch.mtp_depth else _model_max_logits,
                      static_argnums=0)
    before = np.asarray(forward(graphdef, params, batch))
    threshold = float(np.median(before))
    # Layer by layer (a clipped layer changes the inputs of the layers after it): only row l's
    # maxima handed to the clip, the other rows -inf (nothing to clip).
    for layer in range(before.shape[0]):
      only_LH = np.full_like(before, -np.inf)
      only_LH[layer] = before[layer]
      clipped = qk_clip(params, jnp.asarray(only_LH), threshold, cfg.arch.qk_rope_head_dim)
      after = np.asarray(forward(graphdef, clipped, batch))
      over = before[layer] > threshold
      np.testing.assert_allclose(after[layer][over], threshold, rtol=2e-5)
      np.testing.assert_allclose(after[layer][~over], before[layer][~over], rtol=2e-5)
      np.testing.assert_array_equal(after[:layer], before[:layer])
  assert (before > threshold).any() and (before < threshold).any()
  for path, old in jax.tree_util.tree_leaves_with_path(params):
    name = [getattr(k, "key", None) for k in path]
    if not any(n in ("wq_DHE", "wk_DKE", "bq_HE", "bk_KE", "wq_b_QHE", "wkv_b_RHB")
               for n in name):
      new = _leaf(clipped, path)
      assert np.array_equal(np.asarray(new), np.asarray(old)), jax.tree_util.keystr(path)


def _leaf(tree, path):
  return dict((jax.tree_util.keystr(p), v) for p, v in
              jax.tree_util.tree_leaves_with_path(tree))[jax.tree_util.keystr(path)]


def _mtp_max_logits(graphdef, params, batch):
  model = nnx.merge(graphdef, params)
  with attention_stats.collect_max_logits() as passes:
    model.hidden_states_with_predictions(batch["inputs"], batch["positions"],
                                         batch["segment_ids"])
  return passes[0]


_RUN = ["--config.optim.name=muon", "--config.optim.log_max_logit=True",
        "--config.train.steps=30", "--config.train.log_every=1", "--config.train.eval_every=30",
        "--config.optim.learning_rate=0.03", "--config.optim.warmup_steps=0"]


@pytest.mark.slow(seconds=20)
def test_a_muon_run_with_qk_clip_holds_its_max_logit_near_the_threshold(tmp_path):
  """tiny.py's small model, Muon at a high learning rate: unclipped, the logged max logit
  climbs past 1.5; with the threshold at 1.0 it stays within one step's growth of it once the
  clip begins (the logged figure is the step's forward, before that step's own clip: the update
  between two clips, at this high learning rate, adds up to ~15%)."""
  logits = lambda records: [r[max_logit_lib.MAX_LOGIT] for r in records if "loss" in r]
  _, free = run_tiny(tmp_path / "free", *_RUN)
  _, held = run_tiny(tmp_path / "held", *_RUN, "--config.optim.muon.qk_clip_threshold=1.0")
  free, held = logits(free), logits(held)
  assert len(free) == len(held) == 30
  assert max(free) > 1.5, free
  begins = next(i for i, v in enumerate(held) if v > 1.0)
  # The same run until the first clip (another program: rounding may differ in the last bits).
  np.testing.assert_allclose(held[:begins + 1], free[:begins + 1], rtol=1e-5)
  # (the first step after the clip holds most of one update's growth: 1.095 on jax 0.10.2,
  # 1.144 on jax 0.12; the unclipped run climbs to 1.61)
  assert max(held[begins + 1:]) < 1.2, held
  assert held[-1] < 0.75 * free[-1], (held, free)


@pytest.mark.parametrize("changes,words", [
    ({"optim.muon.qk_clip_threshold": -1.0}, "optim.muon.qk_clip_threshold=-1.0: must be >= 0"),
    ({"optim.name": "adamw", "optim.muon.qk_clip_threshold": 100.0},
     "QK-clip is MuonClip's"),
    ({"model.family": "qwen3", "optim.muon.qk_clip_threshold": 100.0},
     "undoes QK-clip's scaling"),
    ({"mesh.context": 2, "optim.muon.qk_clip_threshold": 100.0},
     "not under context parallelism (mesh.context=2)"),
    ({"mesh.stage": 2, "optim.log_max_logit": True},
     "optim.log_max_logit=True: not under pipeline stages (mesh.stage=2"),
    ({"train.objective": "dpo", "data.format": "preference", "optim.log_max_logit": True},
     "the language-model objective only"),
])
def test_bad_qk_clip_settings_are_refused_in_one_line(changes, words):
  config = small_config()
  config.optim.name, config.mesh.data = "muon", -1  # the rest of the 8 devices
  for key, value in changes.items():
    *groups, name = key.split(".")
    group = config
    for g in groups:
      group = group[g]
    setattr(group, name, value)
  assert_one_line_config_error(config, 8, [words])
