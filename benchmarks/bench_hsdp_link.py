"""Hybrid sharding (stage 3, ``shard_size=2``) and ZeRO++'s three options against full sharding on a
slowed inter-node link.

Four CPU ranks pose as 2 nodes of 2 (``Trainer(devices=2, num_nodes=2)``). Each "node" is a Linux
network namespace of its own, joined to the other by a veth pair: the ranks of one node talk over
their namespace's loopback (the intra-node link, never shaped), and every byte between the nodes
crosses the veth pair (the inter-node link). ``--rate`` puts a token-bucket filter (``tc qdisc ...
tbf``) on both ends of the pair; the kernel of this machine has no ``netem``, so the link is slowed
in bandwidth only, not in latency (docs/benchmarks.md, "Hybrid sharding on a slowed link").

Per condition (unshaped, then shaped; ``--rounds`` times), one set of 4 fresh processes:

1. measures both links as the engine's ``shard_size="auto"`` does (``measure_link``: timed
   all-reduces on the groups inside each node and on the groups across the nodes, rank 0's figures);
2. fits the ``--variants`` in turn, ``--repeats`` times each (A B A B ...), and keeps rank 0's
   median step time (after ``--warmup`` steps) and the ledger's collectives of a step in the middle
   of the fit. Variants (all stage 3): ``full`` (``shard_size=None``), ``hsdp`` (``shard_size=2``),
   ``zeropp`` (full sharding with ``quantize_weights``, ``quantize_grads`` and
   ``secondary_shard_size="node"``, docs/quantized.md);
3. just before every fit, times the compute of one step alone (forward, backward, AdamW on the
   whole model, no collective) on all 4 ranks at once, so that the 2 cores are shared as in a
   training step.

The planner's prediction of a step's communication is ``hybrid_comm_time(hybrid_traffic(...),
intra=..., inter=...)`` with the links of step 1; it is compared with the measured step time less the
compute of step 3 (the prediction covers communication only, serialised, no overlap), and the
increase that shaping brings with the increase it predicts (compute and per-step costs cancel).

Needs root (``ip netns``, ``tc``); the namespaces are removed on exit, also on failure. Run::

    python benchmarks/bench_hsdp_link.py --out-dir benchmarks/results
    python benchmarks/bench_hsdp_link.py --rate 100mbit --repeats 6 --out-dir /tmp/hsdp
    python benchmarks/bench_hsdp_link.py --report benchmarks/results/hsdp_link.json   # tables again
    python benchmarks/bench_hsdp_link.py --variants full,zeropp,hsdp --tag zeropp_link --out-dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import torch
import torch.nn as nn

NODES, PER_NODE = 2, 2  # 2 posing nodes of 2 ranks
WORLD = NODES * PER_NODE  # N
NAMESPACES = ("lzbench0", "lzbench1")  # network namespace of node 0, of node 1
VETH = ("lzveth0", "lzveth1")  # the end of the pair inside node 0's namespace, inside node 1's
ADDRESSES = ("10.77.0.1", "10.77.0.2")  # each node's address on the pair
VARIANTS: dict[str, dict[str, Any]] = {  # name -> ZeroStrategy options, all stage 3
    "hsdp": {"shard_size": 2},
    "full": {"shard_size": None},
    # ZeRO++'s three (docs/quantized.md): int8 all-gathers and gradient reductions, secondary shards
    # per node, over full sharding
    "zeropp": {
        "shard_size": None,
        "quantize_weights": True,
        "quantize_grads": True,
        "secondary_shard_size": "node",
    },
}
BLOCK = "benchmarks.bench_hsdp_link.Block"  # the wrap unit of stage 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ranks' working directory


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    """One wrap unit: Linear(width, width) then GELU, with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)  # width^2 + width parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        return x + nn.functional.gelu(self.fc(x))


def make_model(width: int, layers: int) -> nn.Sequential:
    """``layers`` Blocks: layers x (width^2 + width) parameters, all in wrap units."""
    return nn.Sequential(*(Block(width) for _ in range(layers)))


def make_module(args: argparse.Namespace) -> Any:
    import lightning as L

    class Regression(L.LightningModule):
        """The MLP fitted to fixed random targets by mean squared error, AdamW."""

        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args.width, args.layers)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch  # (B, width), (B, width)
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Regression()


def make_loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    n = args.batch_size * args.steps * WORLD
    x = torch.randn(n, args.width, generator=generator)
    y = torch.randn(n, args.width, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size)


# --------------------------------------------------------------------------- one rank


class StepTimes:
    """Lightning callback: wall seconds of every training step on this rank (batch start to end)."""

    def __init__(self) -> None:
        from lightning.pytorch import Callback

        times: list[float] = []  # seconds per step, in order
        start = [0.0]  # perf_counter at the current step's start

        class _Timer(Callback):
            def on_train_batch_start(self, *_: Any) -> None:
                start[0] = time.perf_counter()

            def on_train_batch_end(self, *_: Any) -> None:
                times.append(time.perf_counter() - start[0])

        self.callback = _Timer()
        self.times = times


def fit_variant(args: argparse.Namespace, options: dict[str, Any], root: str) -> dict[str, Any]:
    """One fit of stage 3 with a variant's ``options``: its step times and a step's ledger figures."""
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy

    torch.manual_seed(0)
    strategy = ZeroStrategy(stage=3, wrap_policy=BLOCK, **options)
    timer = StepTimes()
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=PER_NODE,
        num_nodes=NODES,
        max_epochs=1,
        callbacks=[timer.callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(make_module(args), make_loader(args))
    ledger = strategy.ledger
    steps = ledger.steps()
    step = steps[len(steps) // 2]  # a step in the middle: the last one also has the gathers of the fit's end
    records = ledger.for_step(step)
    return {
        "times": timer.times,
        "links": ledger.link_bytes(step),
        "calls": {link: sum(1 for r in records if r.link == link) for link in ("intra", "inter")},
        "units": sum(1 for r in records if r.op == "reduce_scatter"),
        "records": [(r.op, r.link, r.wire_bytes, r.name) for r in records],
    }


def compute_time(args: argparse.Namespace) -> float:
    """Median seconds of one step's compute alone: forward, backward, AdamW on the whole model."""
    torch.manual_seed(0)
    model = make_model(args.width, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(args.batch_size, args.width), torch.randn(args.batch_size, args.width)
    samples = []
    for i in range(args.warmup + 8):
        start = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= args.warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_links() -> dict[str, list[float]]:
    """Alpha and bandwidth of the link inside each node and across the nodes, as the engine
    measures them for ``shard_size="auto"`` (rank 0's figures)."""
    import torch.distributed as dist

    from lightning_zero.comm import Communicator
    from lightning_zero.comm.mesh import measure_link, replicate_ranks, shard_ranks

    nodes = [shard_ranks(i * PER_NODE, PER_NODE) for i in range(NODES)]
    acrosses = [replicate_ranks(i, PER_NODE, WORLD) for i in range(PER_NODE)]
    within, _ = dist.new_subgroups_by_enumeration(nodes, backend="gloo")
    across, _ = dist.new_subgroups_by_enumeration(acrosses, backend="gloo")
    world = Communicator()
    cpu = torch.device("cpu")
    figures = {}
    for label, group in (("intra", within), ("inter", across)):
        link = measure_link(world.subgroup(group, link=label), cpu, label)
        figures[label] = [link.alpha, link.bandwidth]
    return figures


def worker(args: argparse.Namespace) -> None:
    """One rank: links, compute alone, then the fits A B A B ...; rank 0 writes the results."""
    import torch.distributed as dist

    rank = args.rank
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR=ADDRESSES[0],
        MASTER_PORT="29500",  # read by Lightning's environment, never used: the group exists
        WORLD_SIZE=str(WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank % PER_NODE),
        NODE_RANK=str(rank // PER_NODE),
    )
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=WORLD)
    result: dict[str, Any] = {"links": measure_links(), "load_before": os.getloadavg()}
    runs = []
    for repeat in range(args.repeats):
        for name in args.variants.split(","):
            dist.barrier()
            compute = compute_time(args)  # just before the fit: the machine's load drifts
            dist.barrier()
            run = fit_variant(
                args, VARIANTS[name], os.path.join(os.path.dirname(args.store), f"{name}{repeat}")
            )
            runs.append({"variant": name, "repeat": repeat, "compute_s": compute, **run})
    result["load_after"] = os.getloadavg()
    result["runs"] = runs
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # the package's exit hooks would wait on peers that are already leaving


# --------------------------------------------------------------------------- the network


def sh(*command: str, check: bool = True) -> None:
    subprocess.run(command, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def net_up() -> None:
    """Two namespaces joined by a veth pair, each with its loopback up and its address on the pair."""
    net_down()
    for ns in NAMESPACES:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NAMESPACES, VETH, ADDRESSES):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def net_down() -> None:
    """Remove both namespaces (and with them the veth pair and its qdiscs); quiet if absent."""
    for ns in NAMESPACES:
        sh("ip", "netns", "del", ns, check=False)


def shape(rate: str | None, burst: str) -> None:
    """A tbf of ``rate`` on the egress of both ends of the pair (both directions); None: none."""
    for ns, dev in zip(NAMESPACES, VETH):
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if rate is not None:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", rate, "burst", burst, "latency", "100ms")  # fmt: skip


def qdiscs() -> str:
    """The qdiscs on both ends of the pair, as ``tc`` shows them (kept with the results)."""
    out = []
    for ns, dev in zip(NAMESPACES, VETH):
        shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        out.append(f"{ns}/{dev}: {shown}")
    return "; ".join(out)


# --------------------------------------------------------------------------- one job


def run_job(args: argparse.Namespace, rate: str | None, scratch: str) -> dict[str, Any]:
    """4 ranks in the two namespaces, the link shaped to ``rate``; rank 0's results."""
    shape(rate, args.burst)
    os.makedirs(scratch, exist_ok=True)
    store, result = os.path.join(scratch, "store"), os.path.join(scratch, "rank0.json")
    procs = []
    for rank in range(WORLD):
        node = rank // PER_NODE
        env = {**os.environ, "GLOO_SOCKET_IFNAME": VETH[node], "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        command = ["ip", "netns", "exec", NAMESPACES[node], sys.executable, "-m", "benchmarks.bench_hsdp_link",
                   "--worker", "--rank", str(rank), "--store", store, "--result", result,
                   *forwarded(args)]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env, cwd=REPO))
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"a rank failed (exit codes {[p.returncode for p in procs]}); see its output above"
        )
    with open(result) as f:
        job = json.load(f)
    job.update(rate=rate, qdiscs=qdiscs())
    shape(None, args.burst)
    return job


def forwarded(args: argparse.Namespace) -> list[str]:
    keys = ("width", "layers", "batch_size", "steps", "warmup", "repeats", "variants")
    return [item for key in keys for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


# --------------------------------------------------------------------------- the report


class Row(NamedTuple):
    condition: str  # "unshaped" or the tbf rate
    variant: str  # a VARIANTS name
    step_s: float  # median of the repeats' median step times
    spread: float  # (max - min) / median of the repeats' medians
    compute_s: float  # one step's compute alone (median over the measurements before each fit)
    comm_s: float  # step_s - compute_s
    predicted_s: float  # the planner's communication time of a step
    error: float  # predicted_s / comm_s - 1
    gloo_s: float  # alpha-beta time of the bytes gloo sends (see gloo_time)
    intra_mb: float  # ledger: wire MB per rank per step inside the nodes
    inter_mb: float  # ledger: wire MB per rank per step across the nodes
    planned_inter_mb: float  # the planner's inter-node MB


def rows_of(job: dict[str, Any], psi: int, warmup: int) -> list[Row]:
    condition = job["rate"] or "unshaped"
    names = list(dict.fromkeys(r["variant"] for r in job["runs"]))
    return [variant_row(job, name, condition, psi, warmup) for name in names]


def variant_row(job: dict[str, Any], name: str, condition: str, psi: int, warmup: int) -> Row:
    from lightning_zero.planning import Link, hybrid_comm_time, hybrid_traffic, int8_wire_bytes

    intra, inter = (Link(*job["links"][k]) for k in ("intra", "inter"))
    options = VARIANTS[name]
    runs = [r for r in job["runs"] if r["variant"] == name]
    medians = [statistics.median(r["times"][warmup:]) for r in runs]
    step = statistics.median(medians)
    int8 = int8_wire_bytes()
    plan = hybrid_traffic(
        psi,
        WORLD,
        3,
        ranks_per_node=PER_NODE,
        shard_size=options["shard_size"],
        param_bytes=int8 if options.get("quantize_weights") else 4,
        grad_bytes=int8 if options.get("quantize_grads") else 4,
        groups=runs[0]["units"],
        secondary_shard_size=PER_NODE if options.get("secondary_shard_size") else None,
        secondary_bytes=4,
    )
    int8_grads = bool(options.get("quantize_grads"))  # an all-to-all: gloo sends the ring's bytes
    predicted = hybrid_comm_time(plan, intra=intra, inter=inter, backend="gloo", int8_grads=int8_grads)
    compute = statistics.median(r["compute_s"] for r in runs)
    comm = step - compute
    links = runs[0]["links"]
    return Row(
        condition,
        name,
        step,
        (max(medians) - min(medians)) / step,
        compute,
        comm,
        predicted,
        predicted / comm - 1,
        gloo_time(runs[0]["records"], intra, inter),
        links.get("intra", 0) / 1e6,
        links.get("inter", 0) / 1e6,
        plan.inter / 1e6,
    )


def gloo_time(records: list[list[Any]], intra: Any, inter: Any) -> float:
    """The planner's alpha-beta sum over the collectives the ledger counted in a step, with the
    bytes gloo sends: at stage 3 (every variant here) the ring's, (K-1)/K x V, for the all-gathers,
    for the reduce-scatters (sends and receives, lightning_zero/comm/inplace.py) and for the int8
    gradient reduction (an all-to-all); the replicas' all-reduce 2(R-1)/R x V."""
    total = 0.0
    for _op, link, wire, *_name in records:  # results of older runs have no names
        alpha, bandwidth = intra if link == "intra" else inter
        total += alpha + wire / bandwidth
    return total


def slowdown_table(rows: list[Row]) -> str:
    """What the slowed link adds to a step, measured and predicted: compute and the engine's
    per-step costs cancel."""
    lines = ["| variant | measured: shaped - unshaped ms | planner: shaped - unshaped ms | planner / measured |",
             "|---|---|---|---|"]  # fmt: skip
    for name in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == name]
        base = statistics.median(r.step_s for r in mine if r.condition == "unshaped")
        plan0 = statistics.median(r.predicted_s for r in mine if r.condition == "unshaped")
        shaped = [r for r in mine if r.condition != "unshaped"]
        measured = statistics.median(r.step_s for r in shaped) - base
        predicted = statistics.median(r.predicted_s for r in shaped) - plan0
        lines.append(
            f"| {name} | {measured * 1e3:.0f} | {predicted * 1e3:.0f} | {predicted / measured:.2f} |"
        )
    return "\n".join(lines)


def speedup_table(jobs: list[dict[str, Any]], warmup: int) -> str:
    """Per condition, each variant against full sharding: full's step time over the variant's, the
    median over the repeats of each repeat's pair (fitted one after the other)."""
    lines = ["| condition | variant | full / variant (paired median) | per repeat |", "|---|---|---|---|"]
    for job in jobs:
        by = {}
        for r in job["runs"]:
            by.setdefault(r["variant"], []).append(statistics.median(r["times"][warmup:]))
        if "full" not in by:
            continue
        for name, medians in by.items():
            if name == "full":
                continue
            ratios = [f / v for f, v in zip(by["full"], medians)]
            each = " ".join(f"{x:.2f}" for x in ratios)
            lines.append(
                f"| {job['rate'] or 'unshaped'} | {name} | {statistics.median(ratios):.2f}x | {each} |"
            )
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    head = ("condition", "variant", "step ms", "spread", "compute ms", "step - compute ms", "predicted comm ms",
            "predicted / measured", "gloo bytes ms", "intra MB", "inter MB (ledger)", "inter MB (planner)")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (r.condition, r.variant, f"{r.step_s * 1e3:.0f}", f"{r.spread:.0%}", f"{r.compute_s * 1e3:.0f}",
                 f"{r.comm_s * 1e3:.0f}", f"{r.predicted_s * 1e3:.0f}", f"{r.error + 1:.2f}", f"{r.gloo_s * 1e3:.0f}",
                 f"{r.intra_mb:.1f}", f"{r.inter_mb:.1f}", f"{r.planned_inter_mb:.1f}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def links_table(jobs: list[dict[str, Any]]) -> str:
    lines = [
        "| condition | intra alpha us | intra MB/s | inter alpha us | inter MB/s |",
        "|---|---|---|---|---|",
    ]
    for job in jobs:
        (a1, w1), (a2, w2) = job["links"]["intra"], job["links"]["inter"]
        lines.append(
            f"| {job['rate'] or 'unshaped'} | {a1 * 1e6:.0f} | {w1 / 1e6:.0f} | {a2 * 1e6:.0f} | {w2 / 1e6:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r.condition}\n{r.variant}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.step_s * 1e3 for r in rows], 0.4, label="measured step")
    ax.bar([x + 0.2 for x in xs], [(r.compute_s + r.predicted_s) * 1e3 for r in rows], 0.4,
           label="compute alone + planner's comm")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [r.compute_s * 1e3 for r in rows], 0.4, color="grey", label="compute alone")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms per step (rank 0, median)")
    ax.set_title("ZeRO-3 on 2 posing nodes x 2 ranks: " + ", ".join(dict.fromkeys(r.variant for r in rows)))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def report(result: dict[str, Any], out_dir: str | None, tag: str = "hsdp_link") -> None:
    rows = [
        row for job in result["jobs"] for row in rows_of(job, result["psi"], result["settings"]["warmup"])
    ]
    print(links_table(result["jobs"]))
    print()
    print(table(rows))
    print()
    print(slowdown_table(rows))
    print()
    print(speedup_table(result["jobs"], result["settings"]["warmup"]))
    if out_dir is not None:
        with open(os.path.join(out_dir, f"{tag}.csv"), "w") as f:
            f.write(",".join(Row._fields) + "\n")
            f.writelines(",".join(str(v) for v in row) + "\n" for row in rows)
        png = os.path.join(out_dir, f"{tag}.png")
        print(f"plot: {png}" if plot(rows, png) else "matplotlib not installed: no plot")


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="200mbit", help="tbf rate of the inter-node link when shaped")
    p.add_argument("--burst", default="32kb", help="tbf bucket size")
    p.add_argument("--width", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=4, help="Blocks, each a wrap unit")
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch per rank")
    p.add_argument("--steps", type=int, default=10, help="steps per fit")
    p.add_argument("--warmup", type=int, default=3, help="first steps of a fit left out")
    p.add_argument("--repeats", type=int, default=4, help="fits per variant, interleaved A B A B")
    p.add_argument(
        "--variants",
        default="hsdp,full",
        help=f"comma-separated, fitted in this order each repeat: {', '.join(VARIANTS)}",
    )
    p.add_argument("--rounds", type=int, default=1, help="unshaped job then shaped job, this many times")
    p.add_argument("--timeout", type=float, default=300, help="seconds one job may take")
    p.add_argument("--out-dir", default=None, help="write TAG.json, .csv, .png here")
    p.add_argument("--tag", default="hsdp_link", help="the files' names in --out-dir")
    p.add_argument(
        "--report",
        default=None,
        help="print the tables of this JSON (with --out-dir: rewrite its CSV and plot) and run nothing",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if args.worker:  # run from the named module, so that BLOCK names the model's class
        from benchmarks import bench_hsdp_link

        return bench_hsdp_link.worker(args)
    if args.report:
        with open(args.report) as f:
            return report(json.load(f), args.out_dir, args.tag)
    if os.geteuid() != 0:
        raise SystemExit("bench_hsdp_link.py needs root (ip netns, tc qdisc); run it as uid 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    psi = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
    jobs = []
    try:
        net_up()
        with tempfile.TemporaryDirectory(prefix="hsdp-link-") as scratch:
            for i in range(args.rounds):
                for rate in (None, args.rate):
                    print(f"round {i}: {rate or 'unshaped'}", flush=True)
                    jobs.append(run_job(args, rate, os.path.join(scratch, f"{i}-{rate}")))
    finally:
        net_down()
    settings = {
        k: v for k, v in vars(args).items() if k not in ("worker", "rank", "store", "result", "report")
    }
    result = {"settings": settings, "psi": psi, "torch": torch.__version__, "jobs": jobs}
    if args.out_dir is not None:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"{args.tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    report(result, args.out_dir, args.tag)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
