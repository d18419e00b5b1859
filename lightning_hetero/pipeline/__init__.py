"""Pipeline parallelism: the model split into stages placed by speed and memory (``HeteroStrategy(pipeline=...)``).

The capability, in the order a run meets it:

- :mod:`.options`: ``PipelineChoice``, the ``pipeline=`` argument checked, and what a pipeline cannot run (yet);
- :mod:`.chain`: the contract a LightningModule's chain of blocks meets, and a stage's part of it;
- :mod:`.blocks`: each block measured on every rank (time and memory), the model whole;
- :mod:`.placement`: the pure decisions: stages placed on ranks by speed and memory, and re-placed from measured times;
- :mod:`.description`: the plan's printed table;
- :mod:`.stage`: this rank's stage, its schedule (1F1B, GPipe) and its exchanges with the next and previous stage;
- :mod:`.last_stage_metrics`: metrics the last stage logs, seen by every rank's callbacks;
- :mod:`.training`: the training object the job calls at each lifecycle point;
- :mod:`.state`: each rank's blocks saved and loaded by name, and the whole model rebuilt from them;
- :mod:`.report`: the stages' fields of the run report.
"""
