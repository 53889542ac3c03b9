"""Sampling from a model with a KV cache (`sampler.py`) and its command line (`cli.py`):
`python -m jaxtrain.generate --checkpoint=... --prompt=...`."""
