"""litgpt's own ``GPT`` (``litgpt.model``) in litgpt's Fabric loop at stage 3 (tests/fabric/order.py):
``init_module(empty_init=True)``, ``fabric.setup(model)``, ``AdamW(model.parameters())``,
``fabric.setup_optimizers``, ``fabric.load_raw`` of the initial weights, ``chunked_cross_entropy``,
``fabric.save(path, {"model", "optimizer", "iter_num"})`` and ``fabric.load(path, state)``.

litgpt is not a dependency of this package. Its import needs only two small packages beyond those
installed here (its other requirements - tokenizers, huggingface-hub, jsonargparse - serve its
command line and downloads), so ``make install`` (and so ``make test``) installs it without them,
at the versions in constraints.txt::

    .venv/bin/pip install --no-deps -c constraints.txt litgpt safetensors psutil

Without litgpt (another way of installing) the test is skipped and says so. Tolerance: 1e-5 on fp32 parameters after 4 AdamW
steps against Fabric's DDP (the same mean gradient, summed in other groupings).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from tests.fabric import order
from tests.fabric.order import SAVE_AT, Run
from tests.matrix.runner import run_jobs


def _litgpt_missing() -> str | None:
    """Why ``litgpt.model`` cannot be imported here, or None."""
    if importlib.util.find_spec("litgpt") is None:
        return "litgpt is not installed: .venv/bin/pip install --no-deps litgpt safetensors psutil"
    try:
        import litgpt.model  # noqa: F401
    except ImportError as err:
        return (
            f"litgpt.model does not import ({err}): .venv/bin/pip install --no-deps litgpt safetensors psutil"
        )
    return None


pytestmark = pytest.mark.skipif(_litgpt_missing() is not None, reason=str(_litgpt_missing()))

DDP, ZERO3 = Run(model="litgpt", stage=None), Run(model="litgpt", stage=3)
SHARDED = Run(model="litgpt", stage=3, form="sharded")
RESUMES = ((ZERO3, ZERO3), (SHARDED, ZERO3), (ZERO3, Run(model="litgpt", stage=2)), (DDP, ZERO3))
TOL = 1e-5


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"other names: {sorted(a.keys() ^ b.keys())[:6]}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("litgpt")
    paths = {run: str(root / f"{run.name}.ckpt") for run in (DDP, ZERO3, SHARDED)}
    todo = {("fit", run): functools.partial(order.fit, run, path) for run, path in paths.items()}
    for saved, run in RESUMES:
        todo[("resume", saved, run)] = functools.partial(order.resume, run, paths[saved])
    ranks = run_jobs(list(todo.values()), str(root / "ranks"), world=2, timeout=240 + 30 * len(todo))
    return {"paths": paths, **{key: (ranks[0][i], ranks[1][i]) for i, key in enumerate(todo)}}


def _ok(runs: dict, key: tuple) -> tuple[dict, dict]:
    for rank, result in enumerate(runs[key]):
        assert result["error"] is None, f"{key}: rank {rank} raised {result['error']}"
    return runs[key]


def test_gpt_at_stage_3_in_litgpts_loop_equals_fabric_ddp(runs):
    ddp = _ok(runs, ("fit", DDP))[0]
    for run in (ZERO3, SHARDED):
        r0, r1 = _ok(runs, ("fit", run))
        assert _max_diff(r0["params"], ddp["params"]) <= TOL, run.name
        assert _max_diff(r0["params"], r1["params"]) == 0.0, run.name
        assert _max_diff(r0["params"], r0["saved"]) > 1e-4, f"{run.name}: the last steps moved nothing"
        assert max(abs(a - b) for a, b in zip(r0["losses"], ddp["losses"])) <= 10 * TOL, run.name


def test_full_file_loads_into_a_plain_gpt(runs):
    """``torch.load(path)["model"]`` is GPT's plain state dict, equal to DDP's; it loads into a GPT
    built normally (strict); ``["optimizer"]`` is DDP's AdamW ``state_dict()``."""
    from litgpt.model import GPT

    _ok(runs, ("fit", ZERO3))
    ours = torch.load(runs["paths"][ZERO3], weights_only=True)
    ddp = torch.load(runs["paths"][DDP], weights_only=True)
    assert ours["iter_num"] == SAVE_AT
    assert list(ours["model"]) == list(ddp["model"]) == list(GPT(order.litgpt_config()).state_dict())
    assert _max_diff(ours["model"], ddp["model"]) <= TOL
    GPT(order.litgpt_config()).load_state_dict(ours["model"])
    assert ours["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    assert ours["optimizer"]["state"].keys() == ddp["optimizer"]["state"].keys()
    for i, entry in ddp["optimizer"]["state"].items():
        assert _max_diff(ours["optimizer"]["state"][i], entry) <= TOL, i


def test_resume_from_full_and_sharded_files(runs):
    ddp = _ok(runs, ("fit", DDP))[0]
    for saved, run in RESUMES:
        r0, r1 = _ok(runs, ("resume", saved, run))
        saver = _ok(runs, ("fit", saved))[0]
        name = f"{saved.name} -> {run.name}"
        assert (r0["iter_num"], r0["remainder"]) == (SAVE_AT, []), name
        assert _max_diff(r0["loaded"], saver["saved"]) == 0.0, name
        assert _max_diff(r0["params"], ddp["params"]) <= TOL, name
        assert _max_diff(r0["params"], r1["params"]) == 0.0, name
