"""The strategies in Lightning Fabric, against Fabric's own DDP on the same hand-written loop.

Every run of this file's tests happens in one pair of processes (tests/matrix/runner.py), once:
Fabric loops at every stage and under Fabric's ``ddp``, mid-run saves and loads in both checkpoint
forms across stages, Trainer checkpoints continued in Fabric and Fabric checkpoints resumed by the
Trainer, Fabric's collectives, and what unsupported uses say. The tests then read their part.

Tolerances. fp32: the stages reduce the same gradients as DDP, in other groupings (buckets, shards),
so parameters agree to float rounding: 1e-6 after six SGD or AdamW steps (observed: at most 1.2e-7;
mid-run loads and checkpoints crossing between the Trainer and Fabric: exactly equal). bf16-mixed:
Fabric's DDP keeps fp32 parameters and only autocasts the operations; the stages keep bf16
parameters (fp32 masters in the optimizer), so the embedding and LayerNorm weights enter forward
rounded to 8 bits of mantissa and the gradients are summed across ranks in bf16, where DDP sums
fp32 gradients: 1e-3 (observed 4.4e-5 after two steps). bf16-true: both train bf16 parameters, but
the stages sum the two ranks' bf16 gradients in other orders than DDP's bucket: one bf16 rounding
of a weight near 1 is 2^-7 = 7.8e-3, observed once; 2e-2, as in the Trainer's matrix.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning
import pytest
import torch

from tests.fabric import jobs
from tests.fabric.jobs import HALF, Loop
from tests.matrix.runner import run_jobs

STAGES = (None, 0, 1, 2, 3)  # None: Fabric's ddp
PARITY = (
    Loop(apart=True),
    Loop(accumulate=3, clip=("norm", 0.05)),
    Loop(halves=True, clip=("value", 0.01)),
    Loop(accumulate=3, checkpointing="nonreentrant", halves=True),
    Loop(checkpointing="reentrant", clip=("norm", 0.05), apart=True),
    Loop(optimizer="adamw", accumulate=3),
    Loop(precision="bf16-mixed", accumulate=3, clip=("norm", 0.05)),
    Loop(precision="bf16-true", halves=True),
)
VARIANTS = (  # one loop under other options: (loop, stage, options)
    (Loop(accumulate=3), 2, {"accumulate_unsharded": True}),
    (Loop(accumulate=3), 3, {"prefetch": False}),
)
SAVES = (  # (loop, stage that saves, form); Fabric's ddp writes its own format
    (Loop(), None, "full"),
    (Loop(optimizer="adamw"), None, "full"),
    (Loop(), 3, "full"),
    (Loop(), 3, "sharded"),
    (Loop(optimizer="adamw"), 1, "sharded"),
    (Loop(), 2, "full"),
    (Loop(), 0, "sharded"),
)
RESUMES = (  # (the save, in SAVES, and the stage that loads it)
    ((Loop(), 3, "full"), 3),
    ((Loop(), 3, "sharded"), 1),
    ((Loop(optimizer="adamw"), 1, "sharded"), 3),
    ((Loop(), 2, "full"), 0),
    ((Loop(), 0, "sharded"), 2),
)
TRAINER_SAVES = ((1, "full"), (3, "sharded"))  # the Trainer writes, at (stage, form)
FABRIC_CONTINUES = (
    (None, (1, "full")),
    (2, (1, "full")),
    (0, (3, "sharded")),
)  # (Fabric stage, Trainer save)
TRAINER_RESUMES = ((0, (Loop(), 3, "full")), (2, (Loop(), 3, "full")), (3, (Loop(), 0, "sharded")))
INT8 = (Loop(accumulate=3, clip=("norm", 0.05)), Loop(precision="bf16-mixed", halves=True, apart=True))
QUANTIZED = {
    "quantize_weights": True,
    "quantize_grads": True,
    "quantize_block": 32,
}  # the tiny net: 32-blocks
TOL = 1e-6
TOLERANCES = {"32-true": TOL, "bf16-mixed": 1e-3, "bf16-true": 2e-2}  # parameters against Fabric's DDP


def _tol(loop: Loop) -> float:
    return TOLERANCES[loop.precision]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"other names: {sorted(a.keys() ^ b.keys())[:6]}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _save_path(root: Path, save: tuple) -> str:
    loop, stage, form = save
    return str(root / "ckpt" / f"{loop.name}-{'ddp' if stage is None else f'zero{stage}'}-{form}.ckpt")


def _trainer_path(root: Path, save: tuple) -> str:
    return str(root / "ckpt" / f"trainer-zero{save[0]}-{save[1]}.ckpt")


def _jobs(root: Path) -> dict[tuple, object]:
    """Every job of the file, keyed by what it is; in the order they must run."""
    out = {}
    for loop in PARITY:
        for stage in STAGES:
            out[("fit", loop, stage, ())] = functools.partial(jobs.fit, loop, stage)
    for loop, stage, options in VARIANTS:
        out.setdefault(("fit", loop, None, ()), functools.partial(jobs.fit, loop, None))
        out[("fit", loop, stage, tuple(options.items()))] = functools.partial(
            jobs.fit, loop, stage, **options
        )
    for save in SAVES:
        out[("save", save)] = functools.partial(jobs.save_midway, *save, _save_path(root, save))
    for save, stage in RESUMES:
        out[("resume", save, stage)] = functools.partial(jobs.resume, save[0], stage, _save_path(root, save))
    for save in TRAINER_SAVES:
        out[("trainer_save", save)] = functools.partial(jobs.trainer_save, *save, _trainer_path(root, save))
    for stage, save in FABRIC_CONTINUES:
        out[("continue", stage, save)] = functools.partial(
            jobs.fabric_continue, stage, _trainer_path(root, save)
        )
    for strategy, save in TRAINER_RESUMES:
        out[("trainer_resume", strategy, save)] = functools.partial(
            jobs.trainer_resume, strategy, _save_path(root, save)
        )
    for stage in (0, 2):
        out[("fp16", stage)] = functools.partial(
            jobs.fp16, stage, str(root / "ckpt" / f"fp16-zero{stage}.ckpt")
        )
    out[("surface",)] = jobs.surface
    out[("misuse",)] = jobs.misuse
    for stage in (1, 2, 3):
        out[("clip_nonfinite", stage)] = functools.partial(jobs.clip_nonfinite, stage)
    out[("module_state_dict", 3)] = functools.partial(jobs.module_state_dict, 3)
    for loop in INT8:
        out.setdefault(("fit", loop, None, ()), functools.partial(jobs.fit, loop, None))
        out[("int8", loop)] = functools.partial(jobs.fit, loop, 3, **QUANTIZED)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """key -> (rank 0's result, rank 1's result), every job run once in one pair of processes."""
    root = tmp_path_factory.mktemp("fabric")
    todo = _jobs(root)
    ranks = run_jobs(list(todo.values()), str(root / "ranks"), world=2, timeout=180 + 5 * len(todo))
    return {"root": root, **{key: (ranks[0][i], ranks[1][i]) for i, key in enumerate(todo)}}


def _ok(runs: dict, key: tuple) -> tuple[dict, dict]:
    pair = runs[key]
    for rank, result in enumerate(pair):
        assert result["error"] is None, f"{key}: rank {rank} raised {result['error']}"
    return pair


def _fit_errors(runs: dict, loop: Loop, stage: int, options: tuple = ()) -> list[str]:
    name = f"zero{stage}{''.join(f'-{k}={v}' for k, v in options)} {loop.name}"
    ddp, _ = _ok(runs, ("fit", loop, None, ()))
    r0, r1 = runs[("fit", loop, stage, options)]
    if r0["error"] or r1["error"]:
        return [f"{name}: raised {r0['error'] or r1['error']}"]
    errors = []
    if (d := _max_diff(r0["params"], r1["params"])) != 0.0:
        errors.append(f"{name}: the ranks differ by {d:.2e}")
    if (d := _max_diff(r0["params"], ddp["params"])) > _tol(loop):
        errors.append(f"{name}: parameters differ from Fabric's DDP by {d:.2e} (> {_tol(loop):.0e})")
    if (d := max(abs(a - b) for a, b in zip(r0["losses"], ddp["losses"]))) > 10 * _tol(loop):
        errors.append(f"{name}: losses differ from DDP's by {d:.2e}")
    return errors


def test_every_stage_equals_fabric_ddp(runs):
    """Accumulation with no_backward_sync, clipping by norm and by value, two synchronised backward
    passes per step, activation checkpointing (non-reentrant and reentrant), AdamW, bf16-mixed and
    bf16-true, set up together and apart: every stage ends where Fabric's DDP ends."""
    errors = [e for loop in PARITY for stage in STAGES[1:] for e in _fit_errors(runs, loop, stage)]
    errors += [
        e for loop, stage, options in VARIANTS for e in _fit_errors(runs, loop, stage, tuple(options.items()))
    ]
    assert not errors, "\n".join(errors)


def test_no_collective_inside_no_backward_sync_at_stages_0_and_1(runs):
    """Accumulating 3 micro-batches, twice: the four inside ``no_backward_sync`` issue no collective
    at stages 0-1 (nor at stage 2 with accumulate_unsharded). Stage 2 reduce-scatters each of them
    into its shard (the model is one bucket: 4); stage 3 holds parameters sharded, so each also
    gathers its L = 4 units (root and 3 blocks) for forward and the 3 blocks again for backward
    (2L-1 = 7) and reduce-scatters the 4 units' gradients: 28 and 16."""
    loop = Loop(accumulate=3, clip=("norm", 0.05))
    inside = {stage: _ok(runs, ("fit", loop, stage, ()))[0]["inside"] for stage in (0, 1, 2, 3)}
    unsharded = _ok(runs, ("fit", Loop(accumulate=3), 2, (("accumulate_unsharded", True),)))[0]["inside"]
    assert inside[0] == {} and inside[1] == {} and unsharded == {}, (inside, unsharded)
    assert inside[2] == {"reduce_scatter": 4}, inside[2]
    assert inside[3] == {"all_gather": 28, "reduce_scatter": 16}, inside[3]


def test_full_checkpoint_holds_what_one_process_holds(runs):
    """A full Fabric checkpoint keeps the user's keys as Fabric's DDP writes them: ``model`` equals
    Fabric DDP's model and ``optimizer`` its optimizer's state dict at the same step (stages 2 and
    3); two entries are added: the key record and the checksums."""
    root = runs["root"]
    ddp = torch.load(_save_path(root, (Loop(), None, "full")), weights_only=False)
    for stage in (2, 3):
        ours = torch.load(_save_path(root, (Loop(), stage, "full")), weights_only=False)
        assert ours["lightning_zero_fabric"] == {
            "model": "model",
            "optimizers": ["optimizer"],
            "lr_schedulers": [],
            "layout": "user keys",
            "lightning": lightning.__version__,
        }
        assert set(ours) == {*ddp, "lightning_zero_fabric", "lightning_zero_integrity"}
        assert ours["step"] == HALF
        assert _max_diff(ours["model"], ddp["model"]) <= TOL
        mine, theirs = ours["optimizer"], ddp["optimizer"]
        assert mine["param_groups"] == theirs["param_groups"]
        assert mine["state"].keys() == theirs["state"].keys()
        for i, entry in theirs["state"].items():
            assert _max_diff(mine["state"][i], entry) <= TOL, (stage, i)


def test_mid_run_save_and_load_continue_as_the_uninterrupted_run(runs):
    """Saved after 3 of 6 micro-batches (full and sharded), loaded into a model made under
    ``init_module(empty_init=True)`` and moved away, at the same or another stage: the run ends where
    the uninterrupted run ends, and where Fabric's DDP does. Loading the model alone returns the
    rest under the keys it was saved with."""
    errors = []
    for save, stage in RESUMES:
        saver = _ok(runs, ("save", save))[0]
        r0, r1 = _ok(runs, ("resume", save, stage))
        ddp = _ok(runs, ("save", (save[0], None, "full")))[0]
        name = f"zero{save[1]} {save[2]} -> zero{stage} ({save[0].name})"
        if r0["step"] != HALF or r0["remainder"] != []:
            errors.append(f"{name}: step {r0['step']}, remainder {r0['remainder']}")
        rest = ["optimizer", "step"] if save[2] == "full" else ["step"]  # a sharded optimizer: only by load
        if r0["model_only"] != rest:
            errors.append(f"{name}: loading the model alone leaves {r0['model_only']}, not {rest}")
        if (d := _max_diff(r0["loaded"], saver["saved"])) > 0.0:
            errors.append(f"{name}: loaded parameters differ from the saved ones by {d:.2e}")
        if (d := _max_diff(r0["params"], saver["params"])) > TOL:
            errors.append(f"{name}: ends {d:.2e} from the uninterrupted run")
        if (d := _max_diff(r0["params"], ddp["params"])) > TOL:
            errors.append(f"{name}: ends {d:.2e} from Fabric's DDP")
        if _max_diff(r0["params"], r1["params"]) != 0.0:
            errors.append(f"{name}: the ranks differ")
    assert not errors, "\n".join(errors)


def test_trainer_checkpoint_continues_in_fabric(runs):
    """A checkpoint the Trainer wrote (zero1 full, zero3 sharded) loads in Fabric (zero2, zero0) and
    trains on as Fabric's DDP does from the same file; the Trainer's other entries come back."""
    for save in TRAINER_SAVES:
        _ok(runs, ("trainer_save", save))
    reference = _ok(runs, ("continue", None, (1, "full")))[0]
    for stage, save in FABRIC_CONTINUES[1:]:
        r0, _ = _ok(runs, ("continue", stage, save))
        assert _max_diff(r0["params"], reference["params"]) <= TOL, (stage, save)
        assert {"global_step", "loops", "epoch", "pytorch-lightning_version"} <= set(r0["remainder"]), r0[
            "remainder"
        ]


def test_fabric_checkpoint_resumes_in_the_trainer(runs):
    """A checkpoint Fabric wrote (zero3 full, zero0 sharded) resumes in the Trainer (zero2, zero3) as it
    resumes at zero0 from the full file (Lightning's own DDP Trainer reads only the Trainer's layout;
    tests/fabric/test_model_then_optimizer.py compares with it on the same entries)."""
    reference = _ok(runs, ("trainer_resume", 0, (Loop(), 3, "full")))[0]
    for strategy, save in TRAINER_RESUMES[1:]:
        r0, r1 = _ok(runs, ("trainer_resume", strategy, save))
        assert _max_diff(r0["params"], reference["params"]) <= TOL, (strategy, save)
        assert _max_diff(r0["params"], r1["params"]) == 0.0


def test_collectives_memory_load_raw_and_gathered_parameters(runs):
    """all_reduce (sum, mean), broadcast and barrier through the strategy; after a step
    ``memory_report()`` counts half the fp32 parameters and half of SGD's momentum per rank (4Ψ/N
    bytes each, N = 2, within the padding of the 4 units to a multiple of N) and no gradient;
    ``fabric.load_raw`` puts the untrained model's state dict back into the trained stage-3 model,
    whose whole parameters inside ``gathered()`` then equal it."""
    for r in _ok(runs, ("surface",)):
        assert r["sum"] == 3.0 and r["mean"] == 1.5 and r["broadcast"] == {"from": 1}
        parameters, gradients, optimizer_states = r["memory"]
        half = 4 * r["numel"] // 2
        assert 0 <= parameters - half <= 4 * 4 and 0 <= optimizer_states - half <= 4 * 4, (r["memory"], half)
        assert gradients == 0, r["memory"]
        assert r["shapes_ok"] and r["moved"] > 1e-3 and r["loaded"] == 0.0, r


def test_fp16_loss_scale_agreed_saved_and_loaded(runs):
    """fp16 (param_dtype="fp16"): the strategy's ZeroGradScaler replaces the plugin's; rank 0's
    overflow at one step makes every rank skip it and halve the scale (2^16 -> 2^15), the ranks stay
    equal, stage 2 ends where stage 0 does, and the scale comes back from the checkpoint."""
    zero0, _ = _ok(runs, ("fp16", 0))
    r0, r1 = _ok(runs, ("fp16", 2))
    for r in (zero0, r0, r1):
        assert r["scaler"] == "ZeroGradScaler", r["scaler"]
        assert (r["skipped"], r["scale"], r["loaded_scale"]) == (1, 2.0**15, 2.0**15), r
    assert _max_diff(r0["params"], r1["params"]) == 0.0
    assert _max_diff(r0["params"], zero0["params"]) <= 1e-3


def test_unsupported_uses_say_what_to_do(runs):
    out = _ok(runs, ("misuse",))[0]
    expected = {
        "late optimizer": "RuntimeError: ZeroFabricStrategy(stage=3) already laid out the model's shards",
        "second model": "RuntimeError: ZeroFabricStrategy sets up one model per Fabric",
        "norm type": "ValueError: norm_type='inf': stage 3 clips by the 2-norm",
        "no model saved": "ValueError: the state holds no model set up by this strategy",
        "another Fabric's model": "TypeError: no_backward_sync needs the model that ZeroFabricStrategy set up",
        "one of two optimizers": "ValueError: the state holds 1 of the 2 optimizers set up",
        "sharded without state": "CheckpointError:",
        "key clash": "KeyError:",
    }
    for what, start in expected.items():
        assert out[what].startswith(start), f"{what}: {out[what]}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_that_raises_leaves_the_gradients_as_they_were(runs, stage):
    """torch's clip_grad_norm_ raises on a non-finite norm before it touches a gradient; so does
    clip_gradients at the sharded stages (a program that catches the error and skips the step keeps
    usable gradients; before, every shard was multiplied by NaN first)."""
    for result in _ok(runs, ("clip_nonfinite", stage)):
        assert result["raised"] is not None and "non-finite" in result["raised"]
        assert result["kept"], result
    assert any(r["nan_held"] for r in runs[("clip_nonfinite", stage)])  # the NaN is in some rank's shard


def test_module_state_dict_gathers_one_unit_at_a_time_to_rank_0(runs):
    rank0, rank1 = _ok(runs, ("module_state_dict", 3))
    assert rank0["same"] and rank0["keys"] > 0
    assert rank1["keys"] == 0  # as Lightning's FSDP: the whole model in rank 0's memory only
    for result in (rank0, rank1):
        assert [op for op, _ in result["gathers"]] == ["gather"] * len(result["spaces"])
        assert [nbytes for _, nbytes in result["gathers"]] == result["spaces"]  # never the whole model


@pytest.mark.parametrize("loop", INT8, ids=lambda loop: loop.name)
def test_int8_on_the_wire_follows_fabric_ddp(runs, loop):
    """Stage 3 with int8 weights and gradients in a hand-written Fabric loop (accumulation with
    no_backward_sync and clipping; bf16 with two backward passes, set up apart): both ranks end with
    the same parameters, within a few percent of Fabric's DDP, losses within 1%."""
    ddp, _ = _ok(runs, ("fit", loop, None, ()))
    r0, r1 = _ok(runs, ("int8", loop))
    assert _max_diff(r0["params"], r1["params"]) == 0.0
    worst = max(
        ((r0["params"][k] - v).norm() / v.norm().clamp_min(1e-3)).item() for k, v in ddp["params"].items()
    )
    assert 0 < worst <= 0.03  # 0: nothing was quantized
    assert all(abs(a - b) <= 0.01 * abs(b) for a, b in zip(r0["losses"], ddp["losses"]))
