"""The strategies in Lightning Fabric: ``L.Fabric(strategy="zero3", ...)`` or
``L.Fabric(strategy=lightning_zero.fabric.ZeroStrategy(stage=3, ...))``.

Importing ``lightning_zero`` registers ``zero0`` .. ``zero3`` (and their ``_spawn``/``_fork`` forms)
in Fabric's strategy registry as well as in the Trainer's. The Fabric glue (``strategy.py``) calls
the same engines as the Trainer's (``lightning_zero/engines.py``); ``state.py`` maps Fabric's
checkpoint state onto the Trainer's checkpoint format.
"""

from lightning_zero.fabric.strategy import ZeroStrategy

__all__ = ["ZeroStrategy"]
