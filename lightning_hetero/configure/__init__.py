"""Configure: what each rank hands DeepSpeed and Lightning, decided before the engine is built.

Pure functions over plain values: each rank's DeepSpeed config and the check of a user's config keys, the ZeRO stage
that fits every device, the strategy names registered with Lightning, the learning rate of a resume on another global
batch, and the check that every rank built the same model. The split they are given is decided in
:mod:`lightning_hetero.split.decisions`.
"""
