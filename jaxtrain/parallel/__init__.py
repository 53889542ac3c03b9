"""Parallelism outside the model: the device mesh and its logical-axis rules (`mesh`), pipeline
stages over the `stage` axis (`pipeline`), and context parallelism over the `context` axis
(`context_parallel`: the sequence layout; `context_attention`, `context_kernels`: attention
across the split sequence). The model calls into these; they never import the model.

Import the submodules themselves (`from jaxtrain.parallel.mesh import shard`): this package
imports nothing, so none of them depends on another through it.
"""
