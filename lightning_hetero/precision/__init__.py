"""Precision: each rank's own precision: the choice (pure), Lightning's Precision plugin that applies it, one loss scale
for the job, and what happens to steps whose gradients are not finite."""
