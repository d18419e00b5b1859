"""The uneven split's decisions, pure functions of values (no process group, no clock), in the order a run takes them:

- :mod:`.split`: how a global batch is cut into per-rank shares and micro-batches, and each rank's loss weight;
- :mod:`.planner`: the exact min-max planner, the split that minimises the slowest rank's predicted step;
- :mod:`.micro_steps`: per-rank micro-steps for memory-bound ranks;
- :mod:`.initial`: the split a trainer call starts with;
- :mod:`.replan`: when the measured steps say another split is faster, and which;
- :mod:`.explore`: a bounded search of the split on the measured step, for what the cost model does not explain.

They sit low in the stage order (after ``measure/``), below the shared training layers that apply a split
(``train/``, ``watch/``), the other ways of training that cut a batch too (``local/``, ``pipeline/``) and the cluster
planner (``simulate/``). ``lightning_hetero.split``'s own ``__init__`` imports nothing, so a module of ``train/`` that
imports them does not import the training mode above it, and no import cycle runs through ``train/``.
"""
