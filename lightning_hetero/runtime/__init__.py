"""Runtime: what every stage leans on: argument checks, the collectives, the private internals list, quiet output,
start-up and a clean exit. Imports nothing else of the package."""
