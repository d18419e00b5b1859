"""Train: what each rank trains on: the global data order cut into per-rank slices, streams, the buffers kept equal."""
