"""The optimizer's keys (optim.name, optim.muon.*) and what the max-logit tracking needs
(optim.log_max_logit, QK-clip) against the model, the objective and the mesh."""

from __future__ import annotations

from jaxtrain.config import MUON_ADJUST_LR, OPTIMIZERS, ConfigError
from jaxtrain.models import registry
from jaxtrain.parallel.mesh import MeshShape


def check_optimizer(config) -> None:
  """optim.name and optim.muon.* (before the mesh is known)."""
  o = config.optim
  if o.name not in OPTIMIZERS:
    raise ConfigError(f"optim.name={o.name!r}: unknown optimizer; choose one of "
                      f"{', '.join(OPTIMIZERS)}")
  if o.name != "muon":
    return
  if o.muon.ns_steps < 1:
    raise ConfigError(f"optim.muon.ns_steps={o.muon.ns_steps}: Newton-Schulz needs at least 1 "
                      f"iteration (5 is Muon's default)")
  if not 0 <= o.muon.momentum < 1:
    raise ConfigError(f"optim.muon.momentum={o.muon.momentum}: must be in [0, 1) (0.95 is "
                      f"Muon's default)")
  if o.muon.adjust_lr not in MUON_ADJUST_LR:
    raise ConfigError(f"optim.muon.adjust_lr={o.muon.adjust_lr!r}: choose one of "
                      f"{', '.join(MUON_ADJUST_LR)}")
  if config.lora.rank > 0:
    raise ConfigError(f"optim.name='muon' with lora.rank={config.lora.rank}: Muon trains full "
                      f"projection matrices; LoRA's adapters train with optim.name='adamw'")
  threshold = o.muon.get("qk_clip_threshold", 0.0)
  if threshold < 0:
    raise ConfigError(f"optim.muon.qk_clip_threshold={threshold}: must be >= 0 (0: off; Kimi K2 "
                      f"used 100)")


def check_max_logit(config, mesh: MeshShape) -> None:
  """QK-clip and optim.log_max_logit: the layers report their largest logits from the
  language-model objective's forward pass, one layer stack run in one pass (no pipeline stages)
  over a whole sequence (no context split); the clip needs projections that reach the logits."""
  o = config.optim
  threshold = o.muon.get("qk_clip_threshold", 0.0)
  if threshold > 0 and o.name != "muon":
    raise ConfigError(f"optim.muon.qk_clip_threshold={threshold} with optim.name={o.name!r}: "
                      f"QK-clip is MuonClip's (the optim.muon group); set optim.name='muon' or "
                      f"the threshold to 0")
  key = ("optim.muon.qk_clip_threshold" if threshold > 0 and o.name == "muon"
         else "optim.log_max_logit" if o.get("log_max_logit", False) else None)
  if key is None:
    return
  value = threshold if key.endswith("threshold") else True
  if config.train.objective != "lm":
    raise ConfigError(f"{key}={value}: the attention's largest logits are reported by the "
                      f"language-model objective only (pre-training, SFT); train.objective="
                      f"{config.train.objective!r} does not collect them")
  if mesh.context > 1:
    raise ConfigError(f"{key}={value}: not under context parallelism (mesh.context="
                      f"{mesh.context}); use mesh.context=1")
  if mesh.stage > 1:
    raise ConfigError(f"{key}={value}: not under pipeline stages (mesh.stage={mesh.stage}: the "
                      f"stages return no per-layer figures); use mesh.stage=1")
  if key.endswith("threshold") and registry.get(config.model.family).features.qk_norm:
    raise ConfigError(f"{key}={value}: model.family={config.model.family!r} norms each query and "
                      f"key head after its projection, which undoes QK-clip's scaling (and bounds "
                      f"the logits already); keep the threshold at 0 (optim.log_max_logit=True "
                      f"still reports them)")
