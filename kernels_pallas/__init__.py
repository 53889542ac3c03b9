"""Pallas kernels owned by jaxtrain; each ships with a pure-jnp reference and an interpret flag."""
