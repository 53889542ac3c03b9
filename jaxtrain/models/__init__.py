"""Decoder-only language models: a shared decoder (layers.py, decoder.py) and the families that
differ from it in a few switches (features.py; one module each, listed in registry.py).

Nothing is imported here, so `jaxtrain.models.registry` and `jaxtrain.models.config` stay cheap
to import from the config layer.
"""
