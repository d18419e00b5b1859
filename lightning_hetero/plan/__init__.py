"""Plan: how a global batch is split (pure arithmetic, the exact min-max planner), when to re-plan, and each rank's
DeepSpeed config."""
