"""The training backends: one process (backend.LocalBackend) and DeepSpeed ZeRO-2/3
(zero.DeepSpeedBackend), with device placement, the DeepSpeed JSON, partitioned loading and
the engine's checkpoint format. Only this package imports deepspeed."""
