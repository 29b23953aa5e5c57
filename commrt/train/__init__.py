"""Training layers over commrt collectives: ``DataParallel`` (bucketed, overlapped gradient
all-reduce) and ``initialize`` (a DeepSpeed-style engine with ZeRO stages 0-3)."""
from .config import TrainConfig, ZeroConfig
from .ddp import DataParallel
from .engine import Engine, NonFiniteGradients, initialize

__all__ = ["DataParallel", "Engine", "NonFiniteGradients", "TrainConfig", "ZeroConfig", "initialize"]
