"""The error every Hugging Face conversion raises (a ConfigError: one line, exit code 2)."""

from jaxtrain.config import ConfigError


class HFFormatError(ConfigError):
  """A Hugging Face directory or config that cannot be converted; one line naming what and why."""
