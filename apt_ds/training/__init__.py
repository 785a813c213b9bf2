"""The training loop (APT's Algorithm 1), evaluation, baselines and the run that ties a
model, data, a backend and the trainer together."""
