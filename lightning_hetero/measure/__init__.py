"""Measure: what each rank is: its device facts (CPU, CUDA), and a profile of the user's own step as a cost model."""
