"""ZeroConfig and ZeroStrategy refuse bad input where it enters, naming field and value."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import lightning_zero
from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.config import register_hydra_schema


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage": 7}, ValueError, r"stage must be one of \[0"),
        ({"stage": "1"}, TypeError, "stage must be an int, got '1'"),
        ({"bucket_cap_mb": -1}, ValueError, "bucket_cap_mb must be > 0 \\(MiB\\), got -1"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be > 0"),
        ({"bucket_cap_mb": "big"}, TypeError, "bucket_cap_mb must be a number, got 'big'"),
        ({"first_bucket_cap_mb": float("nan")}, ValueError, "first_bucket_cap_mb must be > 0"),
        ({"broadcast_buffers": "yes"}, TypeError, "broadcast_buffers must be true or false"),
        ({"find_unused_parameters": 1}, TypeError, "find_unused_parameters must be true or false"),
    ],
)
def test_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZeroConfig(**kwargs)
    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_unknown_option_names_the_option_and_lists_the_known_ones():
    with pytest.raises(TypeError, match="bucket_cap_mbb.*known.*bucket_cap_mb"):
        ZeroConfig.from_kwargs(bucket_cap_mbb=1)
    with pytest.raises(TypeError, match="bucket_cap_mbb.*known options.*bucket_cap_mb"):
        ZeroStrategy(bucket_cap_mbb=1)


def test_each_glue_passes_its_frameworks_arguments_on_and_names_them_when_a_name_is_unknown():
    from datetime import timedelta

    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

    from lightning_zero.fabric import ZeroFabricStrategy

    trainer_plugin, fabric_plugin = TrainerPrecision(), FabricPrecision()
    trainer = ZeroStrategy(2, timeout=timedelta(seconds=7), precision_plugin=trainer_plugin, bucket_cap_mb=3)
    assert trainer._timeout == timedelta(seconds=7) and trainer.precision_plugin is trainer_plugin
    assert (trainer.config.stage, trainer.config.bucket_cap_mb, trainer._start_method) == (2, 3, "popen")
    fabric = ZeroFabricStrategy(
        3, start_method="spawn", precision=fabric_plugin, process_group_backend="gloo"
    )
    assert fabric.precision is fabric_plugin and fabric._process_group_backend == "gloo"
    assert (fabric.config.stage, fabric._start_method) == (3, "spawn")
    # each takes its own framework's name for the precision, and says which names it takes
    with pytest.raises(
        TypeError, match="unknown ZeroConfig option.*precision;.*strategy's own.*precision_plugin"
    ):
        ZeroStrategy(precision=fabric_plugin)
    with pytest.raises(
        TypeError, match="precision_plugin;.*strategy's own: accelerator.*timeout, precision$"
    ):
        ZeroFabricStrategy(precision_plugin=trainer_plugin)


def test_defaults():
    cfg = ZeroConfig()
    assert (cfg.stage, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb) == (0, 25.0, 1.0)
    assert cfg.bucket_cap_bytes == 25 * 2**20 and cfg.first_bucket_cap_bytes == 2**20


def test_registered_names_and_second_import():
    import importlib

    from lightning.pytorch.strategies import StrategyRegistry

    importlib.reload(lightning_zero)  # a second registration must not fail
    assert {"zero0", "zero0_spawn"} <= set(StrategyRegistry)
    assert StrategyRegistry["zero0_spawn"]["init_params"] == {"stage": 0, "start_method": "spawn"}


def test_hydra_schema_rejects_typos_and_wrong_types(tmp_path):
    register_hydra_schema()
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "z.yaml").write_text(
        "defaults:\n  - /schema/strategy@_here_\n  - _self_\nstage: 0\n"
    )
    (tmp_path / "config.yaml").write_text("defaults:\n  - strategy: z\n  - _self_\n")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose("config", overrides=["strategy.bucket_cap_mb=2"])
        assert ZeroStrategy(**OmegaConf.to_container(cfg.strategy)).config.bucket_cap_mb == 2.0
        with pytest.raises(Exception, match="bucket_cap_mbb"):
            compose("config", overrides=["strategy.bucket_cap_mbb=2"])
        with pytest.raises(Exception, match="bucket_cap_mb"):
            compose("config", overrides=["strategy.bucket_cap_mb=big"])
    GlobalHydra.instance().clear()


def test_precision_policy_from_lightning_flags_and_options():
    import torch

    from lightning_zero.precision import resolve_policy

    assert resolve_policy(None, None, "32-true") is None
    assert resolve_policy(None, None, "bf16-true") is None  # Lightning converts the module itself
    bf16 = resolve_policy(None, None, "bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.master_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )
    assert resolve_policy("bf16", None, "32-true") == bf16  # an explicit policy overrides the flag
    assert resolve_policy("fp32", None, "bf16-mixed") is None
    fp16 = resolve_policy(None, None, "16-mixed")
    assert (fp16.param_dtype, fp16.master_dtype) == (torch.float16, torch.float32)
    assert resolve_policy("fp16", None, "32-true") == fp16  # the strategy adds the loss scaler
    with pytest.raises(ValueError, match="param_dtype='fp16' does not go with.*'bf16-mixed'"):
        resolve_policy("fp16", None, "bf16-mixed")
    with pytest.raises(ValueError, match="param_dtype='bf16' does not go with.*'16-true'"):
        resolve_policy("bf16", None, "16-true")
    fp32_reduce = resolve_policy("bf16", "fp32", "32-true")
    assert (fp32_reduce.param_dtype, fp32_reduce.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="reduce_dtype must be param_dtype.*'fp32', got 'fp16'"):
        resolve_policy("bf16", "fp16", "32-true")
    with pytest.raises(ValueError, match="reduce_dtype='bf16' needs param_dtype"):
        resolve_policy(None, "bf16", "32-true")
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        ZeroConfig(param_dtype="half")


def test_global_batch_experiment_derives_accumulation():
    from pathlib import Path

    from lightning_zero.planning import register_resolvers

    register_resolvers()
    register_hydra_schema()
    GlobalHydra.instance().clear()
    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=global_batch", "trainer.devices=4"])
        assert cfg.trainer.accumulate_grad_batches == 128 // (32 * 4)
        cfg = compose("config", overrides=["+experiment=global_batch", "global_batch=96"])
        with pytest.raises(Exception, match="96"):
            _ = cfg.trainer.accumulate_grad_batches  # 96 is no multiple of 32 x 2: an error naming it
    GlobalHydra.instance().clear()
