"""Model state that is not a trained parameter, and the filter of what a model's weights are."""

from flax import nnx


class RouterBias(nnx.Variable):
  """An MoE layer's per-expert correction bias (DeepSeek-V3's auxiliary-loss-free balancing):
  model state that is not an nnx.Param, so neither gradients nor the optimizer touch it; the
  train step moves it by the experts' load."""


# The variables of a plain model's checkpoint and of its Hugging Face tensors: the parameters
# and the router biases.
WEIGHTS = nnx.Any(nnx.Param, RouterBias)
