"""The strategies in Lightning Fabric: ``L.Fabric(strategy="zero3", ...)`` or
``L.Fabric(strategy=lightning_zero.fabric.ZeroFabricStrategy(stage=3, ...))``.

Importing ``lightning_zero`` registers ``zero0`` .. ``zero3`` (and their ``_spawn``/``_fork`` forms)
in Fabric's strategy registry as well as in the Trainer's. The Fabric glue (``strategy.py``) calls
the same engines as the Trainer's (``lightning_zero/engines.py``) and takes the model alone,
``model = fabric.setup(model)``, with its optimizers made from ``model.parameters()`` and set up
after it (litgpt's order). ``state.py`` maps Fabric's checkpoint state onto the checkpoint forms:
a full file under the user's own keys, as Fabric's DDP writes it, and a sharded directory in the
Trainer's layout; both load in Fabric and in the Trainer.
"""

from lightning_zero.fabric.strategy import ZeroFabricStrategy

ZeroStrategy = (
    ZeroFabricStrategy  # the name earlier releases used; the Trainer's is lightning_zero.ZeroStrategy
)

__all__ = ["ZeroFabricStrategy", "ZeroStrategy"]
