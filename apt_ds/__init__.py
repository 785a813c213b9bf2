"""apt-ds: APT (Adaptive Pruning and Tuning) for LLaMA-family models under DeepSpeed."""

from apt_ds.algorithm.adapters import APTAdapter
from apt_ds.algorithm.distill import SelfDistiller
from apt_ds.algorithm.pruner import AdaptivePruner
from apt_ds.algorithm.schedule import SparsityScheduler
from apt_ds.algorithm.tuner import AdaptiveTuner
from apt_ds.algorithm.units import ModelShape, UnsupportedModelError
from apt_ds.config import APTConfig, ConfigError, TrainConfig
from apt_ds.io.modeling import load_pretrained
from apt_ds.training.trainer import APTrainer

__all__ = [
    "APTAdapter", "APTConfig", "APTrainer", "AdaptivePruner", "AdaptiveTuner", "ConfigError", "ModelShape",
    "SelfDistiller", "SparsityScheduler", "TrainConfig", "UnsupportedModelError", "load_pretrained",
]
__version__ = "0.1.0"
