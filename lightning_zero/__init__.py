"""lightning_zero: ZeRO data parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy names (``zero0``, ``zero0_spawn``, ...) in
Lightning's StrategyRegistry, so ``Trainer(strategy="zero0")`` works. Importing twice is harmless.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.callbacks import ZeroMonitor
from lightning_zero.checkpoint import CheckpointError
from lightning_zero.comm import CommLedger
from lightning_zero.config import ZeroConfig
from lightning_zero.grad_sync import UnusedParametersError
from lightning_zero.strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "CheckpointError",
    "CommLedger",
    "UnusedParametersError",
    "ZeroConfig",
    "ZeroMonitor",
    "ZeroStrategy",
]
__version__ = "0.1.0"
