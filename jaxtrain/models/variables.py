"""Model state that is not a trained parameter, and the filter of what a model's weights are."""

from flax import nnx


class RouterBias(nnx.Variable):
  """An MoE layer's per-expert correction bias (DeepSeek-V3's auxiliary-loss-free balancing):
  model state that is not an nnx.Param, so neither gradients nor the optimizer touch it; the
  train step moves it by the experts' load."""


class Head(nnx.Param):
  """A head a fine-tuning objective puts on the trunk (a reward model's score, PPO's value): a
  parameter like any other under full fine-tuning; under LoRA it trains beside the adapters
  (peft.trainable_filter), since a head new to the model has no base weights to adapt, and a
  reward model's own head is retrained with the trunk's adapters (PEFT's modules_to_save)."""


# The decoder's attribute names of its heads.
HEAD_NAMES = ("score_D1", "value_D1")


# The variables of a plain model's checkpoint and of its Hugging Face tensors: the parameters
# and the router biases.
WEIGHTS = nnx.Any(nnx.Param, RouterBias)
