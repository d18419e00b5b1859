"""The uneven data-parallel split: every rank holds the whole model and trains its own share of each batch.

- :mod:`.decisions`: the pure decisions (the split, the planner, micro-steps, the first plan, re-planning), placed low
  in the stage order because the shared layers and the other training modes use them too;
- :mod:`.steps`: one training step on this rank, in one or several micro-batches, each weighted;
- :mod:`.optimizer_shards`: uneven optimizer-state shards by device memory;
- :mod:`.training`: the data-parallel training mode the job calls at each lifecycle point, its report and checkpoints.

The split in force, the data order and the loss weights it applies are in :mod:`lightning_hetero.train`, which every
training mode shares. This ``__init__`` imports nothing: the layers below import :mod:`.decisions` through it, and an
import here of the training mode would make each of them import the layers above it, a cycle through ``train/``.
"""
