"""Watch: what every rank did in each step, the split that follows it, the run report and the monitor callback."""
