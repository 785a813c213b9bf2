"""Everything that reads or writes the user's files: models, tokenizers, data, run checkpoints,
the run directory and its metrics."""
