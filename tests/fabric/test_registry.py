"""The Fabric names and options, without processes: what ``L.Fabric(strategy=...)`` builds."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch import Trainer

import lightning_zero
import lightning_zero.fabric


@pytest.mark.parametrize(
    ("name", "stage", "start_method"),
    [("zero0", 0, "popen"), ("zero3", 3, "popen"), ("zero2_spawn", 2, "spawn")],
)
def test_names_build_the_fabric_strategy(name, stage, start_method):
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
    strategy = fabric.strategy
    assert type(strategy) is lightning_zero.fabric.ZeroFabricStrategy
    assert (strategy.config.stage, strategy._start_method, strategy.world_size) == (stage, start_method, 2)


def test_the_trainer_keeps_its_own_class():
    trainer = Trainer(strategy="zero1", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is lightning_zero.ZeroStrategy


def test_options_are_checked_where_they_enter():
    strategy = lightning_zero.fabric.ZeroFabricStrategy(stage=3, prefetch_limit=2, state_dict_type="sharded")
    assert (strategy.config.prefetch_limit, strategy.config.state_dict_type) == (2, "sharded")
    with pytest.raises(TypeError, match="unknown ZeroConfig option.*bucket_cap_mbb.*known options"):
        lightning_zero.fabric.ZeroFabricStrategy(stage=1, bucket_cap_mbb=1)
    with pytest.raises(ValueError, match="stage must be one of"):
        lightning_zero.fabric.ZeroFabricStrategy(stage=4)
    with pytest.raises(TypeError, match="either config"):
        lightning_zero.fabric.ZeroFabricStrategy(stage=1, config=lightning_zero.ZeroConfig(stage=1))
