"""A rank that fails in a Fabric loop is named on its peers, as in the Trainer (docs/failures.md).

Real processes, 2 gloo ranks on CPU, started each way Fabric's ranks start: torch's spawn and fork
(``zero2_spawn``, ``zero2_fork``: the strategy's launcher sees the error), Fabric's default launcher
(``fabric.launch()`` re-runs the script for rank 1) and ranks started as torchrun starts them (both:
the strategy's ``sys.excepthook``). Rank 1 raises ``ValueError("boom at step 2")`` in the loop after
2 optimizer steps while rank 0 goes on to its next backward (under torchrun also the other way
round: rank 0, which hosts the store, fails). Before the strategy published a Fabric
loop's failures, rank 0 got gloo's "Connection closed by peer" (or, under spawn, was terminated by
the parent process before it said anything).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.fault_harness import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()
BOUND_S = 30  # from rank 1's error until every process has ended

SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    import time
    from pathlib import Path

    import lightning as L
    import torch

    import lightning_zero  # noqa: F401  (registers zero2, zero2_spawn, zero2_fork)

    MODE, OUT, FAILING = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])  # FAILING: the rank that raises


    def train(fabric):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        data = torch.Generator().manual_seed(fabric.global_rank)
        for step in range(6):
            if fabric.global_rank == FAILING and step == 2:
                last = fabric.strategy.comm.tracker.current().describe()
                (OUT / "raised.json").write_text(json.dumps({"time": time.time(), "last": last}))
                raise ValueError("boom at step 2")
            x = torch.randn(4, 8, generator=data)
            fabric.backward((model(x) - x.sum(1, keepdim=True)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            print(f"rank {fabric.global_rank} took step {fabric.strategy.ledger.step}", flush=True)


    if __name__ == "__main__":
        if MODE in ("spawn", "fork"):
            fabric = L.Fabric(strategy=f"zero2_{MODE}", accelerator="cpu", devices=2)
            try:
                fabric.launch(train)
            except Exception as err:  # torch's report of the first worker that failed
                ended = {"time": time.time(), "index": getattr(err, "error_index", None), "message": str(err)}
                (OUT / "parent.json").write_text(json.dumps(ended))
                raise
        else:  # popen (fabric.launch() re-runs this script for rank 1) or torchrun-like ranks
            fabric = L.Fabric(strategy="zero2", accelerator="cpu", devices=2)
            fabric.launch()
            train(fabric)
    """
)


def peer_failure(failing: int, other: int) -> re.Pattern:
    """What rank ``other`` raises when rank ``failing`` published its error."""
    return re.compile(
        rf"PeerFailure: rank {failing} \((?P<host>[^,]+), pid (?P<pid>\d+)\) failed at step (?P<step>\d+): "
        r"(?P<error>ValueError: boom at step 2) \(its last collective: (?P<last>.+?)\)\. "
        rf"Rank {other} stops too: it was in (?P<where>\w+ #\d+ zero2/\S+ \([\d.]+ \w*B\))"
    )


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    for name in [n for n in env if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        del env[name]  # not a SLURM job, whatever the shell running the tests is
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    return script


def _raised(tmp_path: Path) -> dict:
    """When the failing rank raised, and its last collective as its own tracker names it."""
    return json.loads((tmp_path / "raised.json").read_text())


def _check_peer_failure(text: str, raised: dict, failing: int = 1) -> re.Match:
    found = peer_failure(failing, 1 - failing).search(text)
    assert found is not None, text[-4000:]
    assert found["host"] == HOST and found["step"] == "2", found.group(0)
    assert found["last"] == raised["last"], (found["last"], raised["last"])
    assert "Connection closed by peer" not in found.group(0)
    return found


@pytest.mark.slow  # two launches of 4 processes, about 30 s (make test-slow)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_multiprocessing_launchers_name_the_failing_rank(tmp_path, start_method):
    """The worker that raised publishes before torch's wrapper takes the error, and leaves last:
    rank 0 raises PeerFailure with rank 1's step, error and last collective, and torch's parent
    reports it (rank 0 is the first to exit, status 1); rank 1 prints its own traceback."""
    script = _script(tmp_path)
    done = subprocess.run(
        [sys.executable, str(script), start_method, str(tmp_path), "1"],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    ended = time.time()
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    raised, parent = _raised(tmp_path), json.loads((tmp_path / "parent.json").read_text())
    assert parent["index"] == 0, parent["message"][-3000:]  # "-- Process 0 terminated with ... PeerFailure"
    found = _check_peer_failure(parent["message"], raised)
    # rank 1 raised before its third forward: rank 0 waits in the agreement before its own (see
    # [Note: steps agreed] in signals.py), and takes no third step
    assert found["where"].startswith("agree #") and "zero2/agree/counts" in found["where"], found["where"]
    assert "rank 0 took step 3" not in output
    own = re.search(r"raise ValueError\(\"boom at step 2\"\)\nValueError: boom at step 2", output)
    assert own is not None, output[-4000:]  # rank 1 printed its own traceback
    assert max(parent["time"], ended) - raised["time"] < BOUND_S, (raised, parent, ended)


def test_fabric_launch_rerunning_the_script_names_the_failing_rank(tmp_path):
    """``fabric.launch()`` re-runs the script for rank 1 (Fabric's default launcher): its uncaught
    error goes through the strategy's excepthook, rank 0 (the script's own process) ends with
    PeerFailure, status 1; both processes (rank 1 holds the output pipe too) end within the bound."""
    script = _script(tmp_path)
    done = subprocess.run(
        [sys.executable, str(script), "popen", str(tmp_path), "1"],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    ended = time.time()
    output = done.stdout + done.stderr
    raised = _raised(tmp_path)
    assert done.returncode == 1, output[-4000:]
    _check_peer_failure(output, raised)
    assert "[rank1]: ValueError: boom at step 2" in output  # its own traceback (torch prefixes the rank)
    assert "[rank0]: lightning_zero.comm.faults.PeerFailure: rank 1" in output
    assert ended - raised["time"] < BOUND_S, (raised, ended)


@pytest.mark.parametrize("failing", [1, 0])
def test_ranks_started_like_torchrun_both_exit_1_with_the_reason(tmp_path, failing):
    """Ranks started as torchrun starts them (``LOCAL_RANK`` set): the failing rank prints its
    traceback and exits 1 after its peer has read its message and ended (rank 0, failing, hosts the
    store: it waits for rank 1); the other prints PeerFailure and exits 1."""
    script, env = _script(tmp_path), _env()
    env["WORLD_SIZE"] = "2"
    procs, logs = [], []
    for rank in range(2):
        log = tmp_path / f"rank{rank}.log"
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), "torchrun", str(tmp_path), str(failing)],
                    env={**env, "LOCAL_RANK": str(rank), "RANK": str(rank), "NODE_RANK": "0"},
                    cwd=tmp_path,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
        logs.append(log)
    ended = {}
    deadline = time.monotonic() + 180
    while len(ended) < 2 and time.monotonic() < deadline:
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    outputs = [log.read_text() for log in logs]
    other = 1 - failing
    assert [p.returncode for p in procs] == [1, 1], (outputs[0][-3000:], outputs[1][-3000:])
    raised = _raised(tmp_path)
    found = _check_peer_failure(outputs[other], raised, failing)
    assert found["pid"] == str(procs[failing].pid)
    assert outputs[failing].rstrip().endswith("ValueError: boom at step 2"), outputs[failing][-3000:]
    assert "PeerFailure" not in outputs[failing]
    assert ended[failing] > ended[other] - 0.1, ended  # the failing rank leaves last (polled every 0.05 s)
    assert max(ended.values()) - raised["time"] < BOUND_S, (raised, ended)


def _one_rank_out_of_step(fabric, out: Path, what: str) -> None:
    """Rank 1 alone skips its optimizer step at step 2 (``what="step"``), or runs one more forward
    and backward there (``"backward"``); each rank writes what its loop raised."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.Generator().manual_seed(fabric.global_rank)
    outcome = "completed"
    try:
        for step in range(6):
            x = torch.randn(4, 8, generator=data)
            fabric.backward((model(x) - x.sum(1, keepdim=True)).pow(2).mean())
            if fabric.global_rank == 1 and step == 2:
                (out / "fault_at").write_text(str(time.time()))
            if fabric.global_rank == 1 and step == 2 and what == "backward":
                fabric.backward((model(x) - x.sum(1, keepdim=True)).pow(2).mean())
            if not (fabric.global_rank == 1 and step == 2 and what == "step"):
                optimizer.step()
            optimizer.zero_grad()
    except Exception as err:  # noqa: BLE001  (the test asserts on it)
        outcome = f"{type(err).__name__}: {err}"
    (out / f"rank{fabric.global_rank}").write_text(outcome)


@pytest.mark.parametrize(("stage", "what"), [(3, "step"), (0, "step"), (3, "backward")])
def test_a_step_skipped_or_a_backward_added_on_one_rank_is_a_named_desync(tmp_path, stage, what):
    """Before every training forward the ranks agree their optimizer steps and backward passes
    (Fabric has no per-batch agreement): rank 1 skipping a step, or running one more backward, once
    trained on with the others at stages 0 and 3 (no collective at the step) and exited 0."""
    import torch  # noqa: F401  (the loop's)
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=stage, start_method="fork")
    try:
        Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_one_rank_out_of_step, tmp_path, what)
    except Exception:  # noqa: BLE001  (the launcher re-raises a rank's error; the files say which)
        pass
    after = time.time() - float((tmp_path / "fault_at").read_text())
    assert after < 5, after  # from the fault until both ranks have left (rank 0 lingers for no one)
    for rank in (0, 1):
        outcome = (tmp_path / f"rank{rank}").read_text()
        assert outcome.startswith(
            "CollectivesStopped: the ranks are out of step (a desync) before training forward"
        ), (
            rank,
            outcome,
        )


def _gathers_other_shapes(fabric, out: Path) -> None:
    """Each rank all-gathers a tensor of its own shape (a metric computed on uneven data)."""
    outcome = "completed"
    try:
        fabric.barrier()
        gathered = fabric.all_gather(torch.ones(2 + fabric.global_rank, 3))
        outcome = f"completed {tuple(gathered.shape)}"
    except Exception as err:  # noqa: BLE001  (the test asserts on it)
        outcome = f"{type(err).__name__}: {err}"
    (out / f"rank{fabric.global_rank}").write_text(outcome)
    # a failed rank exits with status 1, and the launcher then ends the others at once: wait (a
    # bounded time) for the other rank's outcome, so the test reads what both found
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all((out / f"rank{r}").exists() for r in (0, 1)):
        time.sleep(0.05)


def test_fabric_all_gather_of_different_shapes_is_a_named_desync_on_every_rank(tmp_path):
    """Fabric's own collectives were not seen by the package: gloo pairs the differently sized
    gathers and aborts a process from C++. Now they are checked as the package's own are."""
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=2, start_method="fork")
    try:
        Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_gathers_other_shapes, tmp_path)
    except Exception:  # noqa: BLE001  (the launcher re-raises a rank's error; the files say which)
        pass
    for rank in (0, 1):
        outcome = (tmp_path / f"rank{rank}").read_text()
        assert outcome.startswith("CollectivesStopped: ") and "out of step (a desync)" in outcome, (
            rank,
            outcome,
        )
        assert "lightning/all_gather float32[2, 3] (24 B)" in outcome, outcome
        assert "lightning/all_gather float32[3, 3] (36 B)" in outcome, outcome
