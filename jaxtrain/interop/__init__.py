"""Interoperability with other model formats: `hf` (Hugging Face Llama safetensors + config.json).

Submodules are imported on use (`from jaxtrain.interop import hf`), so importing the package
pulls in no optional dependency.
"""
