"""A profiler trace of one zero3 step: named collectives, and gathers running while units compute."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from lightning_zero.comm import Communicator
from lightning_zero.config import ZeroConfig
from lightning_zero.engines import make_engine
from tests.distributed.harness import run_ranks


class WideBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return x + self.fc2(torch.relu(self.fc1(x)))


class Wide(nn.Module):
    """Blocks wide enough that a unit's compute takes longer than the ranks drift apart."""

    def __init__(self, dim: int = 512, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*(WideBlock(dim) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inp(x)).pow(2).mean()


def _trace_one_step(rank: int, world: int, out_dir: str) -> int:
    torch.manual_seed(0)
    model = Wide()
    comm = Communicator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = make_engine(ZeroConfig(stage=3, wrap_policy=f"{__name__}.WideBlock"), comm)
    wrapped = engine.setup(model, [optimizer])
    x = torch.randn(4, 128, 512)
    for _ in range(2):  # the first step records the forward order that prefetch follows
        wrapped(x).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        wrapped(x).backward()
    profiler.export_chrome_trace(os.path.join(out_dir, f"trace{rank}.json"))
    return 0


def test_trace_names_and_overlap(tmp_path):
    run_ranks(_trace_one_step, 2, tmp_path, str(tmp_path))
    events = [e for e in json.load(open(tmp_path / "trace0.json"))["traceEvents"] if e.get("ph") == "X"]
    launches = [e for e in events if e["name"].startswith("zero3/all_gather/unit=")]
    names = {e["name"] for e in launches}
    assert {f"zero3/all_gather/unit=blocks.{i}" for i in range(4)} | {"zero3/all_gather/unit=root"} <= names
    assert len(launches) == 2 * 5 - 1  # root + 4 blocks: 2L-1 gathers
    main = launches[0]["tid"]
    compute = [
        e for e in events if e["tid"] == main and e["name"] in ("aten::addmm", "aten::mm", "aten::relu")
    ]
    # on gloo at N = 2 an all-gather runs as a swap, an all-to-all (see [Note: collectives in place])
    gloo = sorted({e["name"] for e in events if e["name"].startswith("gloo:")})
    # reduce-scatters are swaps too: the gathers counted are those before the first one's launch
    first_reduce = min(e["ts"] for e in events if e["name"].startswith("zero3/reduce_scatter/"))
    swaps = [e for e in events if e["name"].startswith("gloo:all_to_all") and e["tid"] != main]
    gathers = [e for e in swaps if e["ts"] < first_reduce]
    assert gathers, f"the backend's gathers run on its own thread (gloo's events: {gloo})"

    def overlaps(a, b):
        return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]

    overlapped = [g for g in gathers if any(overlaps(g, c) for c in compute)]
    # with prefetch, the next unit's gather is in flight while the current unit computes
    assert len(overlapped) >= 2, f"{len(overlapped)} of {len(gathers)} gathers overlapped compute"
