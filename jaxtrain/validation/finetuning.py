"""Validation of the fine-tuning settings: train.objective with its own group (dpo.*, grpo.*,
ppo.*, reward.*: each objective checks its settings and data format) and lora.*, against the
model's own check of its adapters."""

from __future__ import annotations

from jaxtrain import objectives
from jaxtrain.config import LORA_TARGETS, OBJECTIVES, ConfigError
from jaxtrain.models.config import ModelConfig
from jaxtrain.peft.lora import check_config


def check_finetuning(config):
  """train.objective, dpo.* and lora.* keys."""
  objective = config.train.objective
  if objective not in OBJECTIVES:
    raise ConfigError(f"train.objective={objective!r}: choose one of {', '.join(OBJECTIVES)}")
  objectives.get(config).check(config)  # its own settings and data format
  lora = config.lora
  if lora.rank < 0:
    raise ConfigError(f"lora.rank={lora.rank}: must be >= 0 (0: full fine-tuning)")
  if lora.rank == 0 and lora.quantize_base != "none":
    # (The model config of a rank-0 run carries no LoRA fields, so the model's check below
    # cannot see this one.)
    raise ConfigError(f"lora.quantize_base={lora.quantize_base!r} with lora.rank=0: a "
                      f"quantized base is frozen, so only adapters could train; set lora.rank "
                      f"(e.g. 16) or lora.quantize_base='none'")
  if lora.rank > 0:
    # Only here are the targets still a string: names the model config would drop.
    unknown = [n.strip() for n in lora.targets.split(",")
               if n.strip() and n.strip() not in LORA_TARGETS]
    if unknown:
      raise ConfigError(f"lora.targets={lora.targets!r}: unknown "
                        f"{', '.join(map(repr, unknown))}; give a comma-separated subset of "
                        f"{','.join(LORA_TARGETS)}")
    if lora.alpha <= 0:
      raise ConfigError(f"lora.alpha={lora.alpha}: must be positive (the adapter scale is "
                        f"alpha / rank)")
    if not 0.0 <= lora.dropout < 1.0:
      raise ConfigError(f"lora.dropout={lora.dropout}: must be in [0, 1)")
  # The model's own check of its LoRA/QLoRA fields (rank, quantization, targets, group size
  # against the projections' input sizes), so a bad value stops here, before anything compiles.
  try:
    model_cfg = ModelConfig.from_config(config, platform="cpu")
    check_config(model_cfg.peft, model_cfg.arch)
  except ValueError as e:
    raise ConfigError(str(e)) from None
