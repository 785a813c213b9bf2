"""The distributed layer's user error, in its own module so that every module of the layer can
raise it without importing another (ds_config and launcher_env both do)."""


class DeepSpeedConfigError(ValueError):
    """The DeepSpeed config or the launcher environment cannot be used (missing file, bad JSON,
    contradicting values, a launcher without the variables it needs)."""
