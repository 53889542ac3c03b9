"""The dry run: compile the real train step for a target without its hardware, and report.

- targets.py: the accelerator table (compiler, topology, memory, peak FLOP/s) and target names.
- measure.py: the exact compile of the train step on abstract inputs, and its figures.
- suggestions.py: config changes that make a step fit, each measured.
- hlo_flops.py: matmul FLOPs of a compiled program, loops counted per iteration.
- command.py: `python -m jaxtrain.main --dry_run` (the report and its last line).
"""
