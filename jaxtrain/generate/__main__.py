"""`python -m jaxtrain.generate`: the JAX backends are chosen before JAX is imported."""

from jaxtrain import platforms

platforms.choose_jax_platforms()

# After the platform choice: the CLI imports JAX and the model.
from jaxtrain.generate import cli  # pylint: disable=wrong-import-position

cli.run()
