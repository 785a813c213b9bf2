"""The training backends: one process (backend.LocalBackend) and DeepSpeed ZeRO-2/3
(zero.DeepSpeedBackend), with device placement, the DeepSpeed JSON, partitioned loading and
the engine's checkpoint format. Only this package imports deepspeed.

DeepSpeedBackend's pieces: the process group in `zero_comm` (launchers: `launcher_env`), the
full state moved across rebuilds in `zero_state`, checkpoints (the same full state as
safetensors + JSON, loadable under another world size or ZeRO stage) in `zero_checkpoint`, the
run's DeepSpeed monitor in `zero_monitor`, every DeepSpeed internal in `deepspeed_private`.
Work the ranks split among themselves (the base model's fingerprint) is in `split_work`."""
