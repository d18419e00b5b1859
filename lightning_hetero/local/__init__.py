"""Local training: ranks train on their own and merge (``sync="local_sgd"`` or ``"diloco"``, ``asynchronous=True``).

- :mod:`.training`: the local and asynchronous training modes the job calls at each lifecycle point;
- :mod:`.claims`: asynchronous merges: the loader that claims micro-batches, the merges at step boundaries;
- :mod:`.claim_counter`: the shared counter in the job's store that hands out the claims;
- :mod:`.claims_refusal`: what asynchronous merges cannot run, said before the process group exists.

The merges themselves (outer steps, fragments, overlap, quantized pseudo-gradients) are
:class:`lightning_hetero.train.local_sgd.LocalTraining`; their pure decisions are in :mod:`lightning_hetero.plan`.
"""
