"""lightning_zero: ZeRO data parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy names (``zero0``, ``zero0_spawn``, ...) in
Lightning's StrategyRegistry and in Fabric's, so ``Trainer(strategy="zero0")`` and
``L.Fabric(strategy="zero0")`` work. Importing twice is harmless.
The public names below are loaded on first use; the ``lightning-zero`` command imports the
package without the registration, so that it answers without torch (see [Note: a command that
answers at once] in lightning_zero_cli.py).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_zero.callbacks import ZeroMonitor
    from lightning_zero.checkpoint import CheckpointError
    from lightning_zero.comm import CommLedger
    from lightning_zero.config import ZeroConfig
    from lightning_zero.grad_sync import UnusedParametersError
    from lightning_zero.strategy import ZeroStrategy

_PUBLIC = {  # public name -> the module that defines it
    "CheckpointError": "lightning_zero.checkpoint",
    "CommLedger": "lightning_zero.comm",
    "UnusedParametersError": "lightning_zero.grad_sync",
    "ZeroConfig": "lightning_zero.config",
    "ZeroMonitor": "lightning_zero.callbacks",
    "ZeroStrategy": "lightning_zero.strategy",
}
__all__ = [
    "CheckpointError",
    "CommLedger",
    "UnusedParametersError",
    "ZeroConfig",
    "ZeroMonitor",
    "ZeroStrategy",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lightning_zero' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


def _register_strategies() -> None:
    """Register ``zero0`` .. ``zero3`` (and their ``_spawn``/``_fork`` forms) with Lightning: the
    Trainer's registry and Fabric's (``L.Fabric(strategy="zero3")``, see ``lightning_zero/fabric``)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero.fabric import ZeroFabricStrategy
    from lightning_zero.strategy import ZeroStrategy

    ZeroStrategy.register_strategies(StrategyRegistry)
    ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)


def _imported_by_the_command() -> bool:
    launcher = sys.modules.get("lightning_zero_cli")
    return bool(launcher is not None and getattr(launcher, "DEFER_REGISTRATION", False))


if not _imported_by_the_command():
    _register_strategies()
