"""Recover: complete-or-ignored checkpoints, resuming on another world size or from another strategy's file, a lost
or signalled rank stopping every rank, and every failure said on every rank."""
