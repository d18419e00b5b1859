"""Simulate: plan a cluster before using it (`lightning-hetero plan`): the catalog, the cluster file, the step model."""
