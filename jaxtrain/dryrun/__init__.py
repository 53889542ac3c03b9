"""The dry run: compile the real train step for a target without its hardware, and report.

- command.py: `python -m jaxtrain.main --dry_run` (the report and its last line).
- suggestions.py: config changes that make a step fit, each measured.
- hlo_dots.py: the matmuls of a compiled program by operand types (FP8 evidence).
- interconnect.py: the collectives per step and an estimate of their time over the target's link.
- check_configs.py: `python -m jaxtrain.dryrun.check_configs`, every shipped config's fit.

The compile and its figures are the trainer's own (train/measure.py, train/memory_breakdown.py,
train/hlo_flops.py: the preflight check runs them too; train/hlo_collectives.py); the accelerator
table is jaxtrain/hardware.py.
"""
