"""apt-ds: APT (Adaptive Pruning and Tuning) for LLaMA-family models under DeepSpeed.

The public names below are imported on first use (PEP 562): `import apt_ds.cli.train` must not
load torch and transformers, so that `--help` is quick and a Ctrl-C while a command starts is
caught by the command, not printed as a traceback from inside an import."""

import importlib as _importlib
import logging as _logging

# On a CPU with AVX512-BF16, bitsandbytes 0.50 tries at import to fetch an optional GEMV kernel from
# the Hub and warns when it cannot (offline, untrusted publisher): its own kernels run instead. peft
# imports bitsandbytes wherever it is installed, so every run would print it before its first line.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)

_PUBLIC = {
    "APTAdapter": "apt_ds.algorithm.adapters",
    "SelfDistiller": "apt_ds.algorithm.distill",
    "AdaptivePruner": "apt_ds.algorithm.pruner",
    "SparsityScheduler": "apt_ds.algorithm.schedule",
    "AdaptiveTuner": "apt_ds.algorithm.tuner",
    "ModelShape": "apt_ds.algorithm.units",
    "UnsupportedModelError": "apt_ds.algorithm.units",
    "APTConfig": "apt_ds.config",
    "ConfigError": "apt_ds.config",
    "TrainConfig": "apt_ds.config",
    "export_run": "apt_ds.export.merge",
    "load_pretrained": "apt_ds.io.modeling",
    "merge_and_compact": "apt_ds.export.merge",
    "APTrainer": "apt_ds.training.trainer",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'apt_ds' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) - {"_importlib", "_PUBLIC"} | set(_PUBLIC))
