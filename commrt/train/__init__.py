"""Training layers over commrt collectives: ``DataParallel`` (bucketed, overlapped gradient
all-reduce) and ``initialize`` (a DeepSpeed-style engine with ZeRO stages 0-3)."""
from commrt.train.config import TrainConfig, ZeroConfig
from commrt.train.ddp import DataParallel
from commrt.train.engine import Engine, EngineClosed, NonFiniteGradients, initialize

__all__ = ["DataParallel", "Engine", "EngineClosed", "NonFiniteGradients", "TrainConfig", "ZeroConfig", "initialize"]
