"""Local training: ranks train on their own and merge (``sync="local_sgd"`` or ``"diloco"``, ``asynchronous=True``).

The capability, in the order a run meets it:

- :mod:`.inner_steps`: the arguments checked, and the pure decisions: each rank's inner steps planned and re-planned
  from its speed, and the plan's lines;
- :mod:`.fragments`: streaming merges' fragments, cut inside tensors, and which are due at a step (pure);
- :mod:`.claim_decisions`: asynchronous merges' pure decisions: the claims, the merges due, when a rank leaves the
  epoch's last claims or takes one over, the report's summary;
- :mod:`.claims_refusal`: what asynchronous merges cannot run, said before the process group exists;
- :mod:`.merges`: the merges' state (DiLoCo's outer optimizer, overlap, quantized pseudo-gradients, error feedback)
  and each rank's part of a checkpoint;
- :mod:`.claim_counter` and :mod:`.claims`: the shared counter in the job's store and the loader that claims;
- :mod:`.training`: the local and asynchronous training modes the job calls at each lifecycle point.
"""
