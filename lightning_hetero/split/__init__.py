"""The uneven data-parallel split's training: every rank holds the whole model and trains its slice of each batch.

- :mod:`.steps`: one training step on this rank, in one or several micro-batches, each weighted;
- :mod:`.training`: the data-parallel training mode the job calls at each lifecycle point, its report and checkpoints.

The split's decisions (the planner, micro-steps, re-planning) are in :mod:`lightning_hetero.plan`, the split in force
and the data order in :mod:`lightning_hetero.train`.
"""
