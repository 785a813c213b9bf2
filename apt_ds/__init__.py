"""apt-ds: APT (Adaptive Pruning and Tuning) for LLaMA-family models under DeepSpeed."""

from .adapters import APTAdapter
from .config import APTConfig, ConfigError, TrainConfig
from .distill import SelfDistiller
from .modeling import load_pretrained
from .pruner import AdaptivePruner
from .schedule import SparsityScheduler
from .trainer import APTrainer
from .tuner import AdaptiveTuner
from .units import ModelShape, UnsupportedModelError

__all__ = [
    "APTAdapter", "APTConfig", "APTrainer", "AdaptivePruner", "AdaptiveTuner", "ConfigError", "ModelShape",
    "SelfDistiller", "SparsityScheduler", "TrainConfig", "UnsupportedModelError", "load_pretrained",
]
__version__ = "0.1.0"
