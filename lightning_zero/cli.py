"""The ``lightning-zero`` console command.

    lightning-zero plan --params 7.5B -n 64 --memory 80GB
    lightning-zero plan --model torch.nn:Transformer -n 8 64 --hardware h100-cluster \\
        --tokens-per-rank 4096 --bucket-sweep --plot-dir plots
    lightning-zero plan --params 8B -n 128 512 --global-batch-tokens 4M --seq-len 4096 \\
        --micro-batch 2 --pow2 --json
    lightning-zero plan --params 70B -n 64 --hardware h100-cluster --shard-size auto
    lightning-zero consolidate checkpoints/last.ckpt last-full.ckpt [--weights-only] [--trusted]

Each subcommand is one ``_add_<name>_parser`` function that builds its arguments and one
``_run_<name>`` function that the dispatcher in :func:`main` calls with the parsed arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from lightning_zero.planning import batch, comm, hybrid, memory
from lightning_zero.planning.comm import Hardware
from lightning_zero.planning.hybrid import Link

_STAGE_NAMES = ("DP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lightning-zero`` with ``argv`` (default: the command line); returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"lightning-zero {args.command}: error: {err}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-zero", description="ZeRO data parallelism for Lightning."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan_parser(subparsers)
    _add_consolidate_parser(subparsers)
    return parser


# --------------------------------------------------------------------------- quantities


_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12, "p": 1e15}
_PREFIXES |= {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = re.compile(r"^\s*(\d*\.?\d+(?:[eE][+-]?\d+)?)\s*([a-zA-Zµ]*)\s*$")


def _quantity(unit: str = "") -> Callable[[str], float]:
    """argparse type: a number with an optional K/M/G/B/T/Ki/Mi/Gi suffix, then ``unit``."""

    def parse(text: str) -> float:
        body = text.strip()
        if unit and body.lower().endswith(unit.lower()) and len(body) > len(unit):
            body = body[: -len(unit)]
        match = _NUMBER.match(body)
        if not match or match.group(2).lower() not in _PREFIXES:
            raise argparse.ArgumentTypeError(
                f"cannot read {text!r}; expected e.g. 7.5e9, 7.5B, 80GB, 400GB/s"
            )
        return float(match.group(1)) * _PREFIXES[match.group(2).lower()]

    return parse


def _seconds(text: str) -> float:
    """argparse type: a time such as 16us, 0.5ms or 1.6e-5 (seconds)."""
    match = _NUMBER.match(text)
    if not match or match.group(2).lower() not in _SECONDS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a time; expected e.g. 16us, 0.5ms, 1.6e-5")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def _shard_size(text: str) -> int | str:
    """argparse type: a shard size K (an int >= 1), ``node`` (K = G) or ``auto``."""
    if text.strip().lower() in (hybrid.AUTO, hybrid.NODE):
        return text.strip().lower()
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a shard size; expected an int >= 1, 'node' or 'auto'"
        )
    return value


def _caps(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated bucket caps in MiB."""
    try:
        caps = tuple(float(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r}; expected MiB values like 1,5,25,100"
        ) from None
    if not caps or min(caps) <= 0:
        raise argparse.ArgumentTypeError(f"bucket caps must be > 0 MiB, got {text!r}")
    return caps


# --------------------------------------------------------------------------- plan: arguments


def _add_plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="memory, traffic, compute/communication threshold, bucket size and batch plan",
        description="Plan a ZeRO run without a process group. See docs/planning.md.",
    )
    p.set_defaults(run=_run_plan)
    model = p.add_argument_group("model")
    model.add_argument("--params", type=_quantity(), help="Ψ, trainable parameters: 7.5e9 or 7.5B")
    model.add_argument(
        "--model", help="package.module:Class to instantiate (no arguments) for Ψ and layer sizes"
    )
    model.add_argument("--layers", type=int, default=32, help="equal layers to assume without --model (32)")
    mem = p.add_argument_group("memory")
    mem.add_argument(
        "-n", "--world-size", type=int, nargs="+", default=[64], help="data-parallel ranks N (64)"
    )
    mem.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd_momentum", "sgd"])
    mem.add_argument(
        "--k", type=float, help="optimizer bytes per parameter, fp32 master included (overrides)"
    )
    mem.add_argument("--no-master-copy", action="store_true", help="no fp32 master copy (fp32 training)")
    mem.add_argument("--param-bytes", type=float, default=2, help="bytes per parameter element (2)")
    mem.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element (2)")
    mem.add_argument(
        "--fp32-grad-accum", action="store_true", help="count an fp32 gradient-accumulation buffer"
    )
    mem.add_argument(
        "--frozen-params",
        type=_quantity(),
        default=0.0,
        help="Ψ_f, frozen parameters (a fine-tuned base): 7B",
    )
    mem.add_argument("--frozen-bytes", type=float, default=2, help="bytes per frozen parameter element (2)")
    mem.add_argument(
        "--memory", type=_quantity("B"), help="device memory: 80GB, 96GiB (default: the preset's)"
    )
    _add_hardware_arguments(p)
    _add_hybrid_arguments(p)
    _add_batch_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--plot-dir", type=Path, help="write PNG plots (memory.png, buckets.png) here")


def _add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    hw = p.add_argument_group("hardware and communication")
    hw.add_argument("--hardware", choices=sorted(comm.HARDWARE), help="preset for C, W and device memory")
    hw.add_argument("--flops", type=_quantity("FLOP/s"), help="C, FLOP/s per rank: 989T or 9.89e14")
    hw.add_argument("--bandwidth", type=_quantity("B/s"), help="W, bytes/s per rank: 400GB/s or 4e11")
    hw.add_argument(
        "--alpha", type=_seconds, default=comm.DEFAULT_ALPHA, help="latency per collective (16us)"
    )
    hw.add_argument("--experts", type=int, default=1, help="MoE: experts per layer E (1: dense)")
    hw.add_argument("--top-k", type=int, default=1, help="MoE: experts per token k")
    hw.add_argument("--bucket-sweep", action="store_true", help="sweep bucket_cap_mb in the alpha-beta model")
    hw.add_argument(
        "--bucket-caps", type=_caps, default=comm.DEFAULT_CAPS_MB, help="caps to sweep, MiB: 1,5,25"
    )
    hw.add_argument("--first-bucket-cap-mb", type=float, default=1.0, help="cap of the first bucket, MiB (1)")
    hw.add_argument(
        "--quantize-weights", action="store_true", help="stage 3: int8 all-gathers (docs/quantized.md)"
    )
    hw.add_argument("--quantize-grads", action="store_true", help="stage 3: int8 gradient reductions")
    hw.add_argument("--quantize-block", type=int, default=256, help="elements per int8 block (256)")
    hw.add_argument(
        "--secondary-shard-size",
        type=_shard_size,
        help="stage 3's secondary shards (hpZ): s ranks or 'node'; a table of the backward all-gathers "
        "moved inside the group, with the memory they cost (needs the ranks per node)",
    )


def _add_hybrid_arguments(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("hybrid sharding (HSDP)")
    h.add_argument(
        "--shard-size",
        type=_shard_size,
        help="K, ranks per shard group, 'node' (K = G) or 'auto' (the fastest K whose states fit "
        "--memory): a table beside full sharding (K = N)",
    )
    h.add_argument(
        "--ranks-per-node",
        type=int,
        help="G, consecutive ranks per node (default: the preset's GPUs per node)",
    )
    h.add_argument(
        "--stage", type=int, nargs="+", choices=memory.STAGES, help="stages of the table (default: 1 2 3)"
    )
    h.add_argument(
        "--groups",
        type=int,
        help="buckets (stages 1-2) or wrap units (stage 3) per step (default: 1 call each)",
    )
    h.add_argument(
        "--intra-bandwidth",
        type=_quantity("B/s"),
        help="bytes/s per rank inside a node (default: the preset's link)",
    )
    h.add_argument(
        "--inter-bandwidth",
        type=_quantity("B/s"),
        help="bytes/s per rank across nodes (default: the preset's node bandwidth / GPUs per node)",
    )
    h.add_argument(
        "--intra-alpha", type=_seconds, help="latency per collective inside a node (default: --alpha)"
    )
    h.add_argument(
        "--inter-alpha", type=_seconds, help="latency per collective across nodes (default: --alpha)"
    )


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("batch")
    b.add_argument("--global-batch-tokens", type=_quantity(), help="target tokens per optimizer step: 4M")
    b.add_argument("--global-batch", type=int, help="target samples per optimizer step: 1024")
    b.add_argument("--seq-len", type=int, help="tokens per sample")
    b.add_argument("--micro-batch", type=int, help="largest micro-batch that fits one rank")
    b.add_argument("--pow2", action="store_true", help="round the global batch in samples to a power of two")
    b.add_argument(
        "--tokens-per-rank", type=_quantity(), help="tokens per rank per micro-batch (for buckets)"
    )


# --------------------------------------------------------------------------- plan: inputs


class PlanInputs(NamedTuple):
    model: str | None  # class name of --model, None for --params
    psi: float  # Ψ, trainable parameters
    layers: tuple[int, ...]  # parameters per layer, backward order
    world_sizes: tuple[int, ...]  # N values to plan for
    memory_options: dict[str, Any]  # keyword arguments of memory.model_state_memory
    device_memory: float | None  # bytes per rank
    hardware: Hardware | None  # preset, if given
    flops: float | None  # C, FLOP/s per rank
    bandwidth: float | None  # W given on the command line (else from the preset per N)
    alpha: float  # s per collective
    experts: int  # MoE E
    top_k: int  # MoE k
    int8: dict[str, float] | None = None  # stage 3 with int8 on the wire: its param_bytes / grad_bytes


def _plan_inputs(args: argparse.Namespace) -> PlanInputs:
    model, psi, layers = _model_sizes(args)
    if min(args.world_size) < 1:
        raise ValueError(f"world sizes must be >= 1, got {args.world_size}")
    k = (
        args.k
        if args.k is not None
        else memory.optimizer_k(args.optimizer, master_copy=not args.no_master_copy)
    )
    hw = comm.get_hardware(args.hardware) if args.hardware else None
    return PlanInputs(
        model=model,
        psi=psi,
        layers=layers,
        world_sizes=tuple(dict.fromkeys(args.world_size)),
        memory_options=dict(
            k=k,
            param_bytes=args.param_bytes,
            grad_bytes=args.grad_bytes,
            fp32_grad_accum=args.fp32_grad_accum,
            frozen=args.frozen_params,
            frozen_bytes=args.frozen_bytes,
        ),
        device_memory=args.memory or (hw.memory if hw else None),
        hardware=hw,
        flops=args.flops or (hw.flops if hw else None),
        bandwidth=args.bandwidth,
        alpha=args.alpha,
        experts=args.experts,
        top_k=args.top_k,
        int8=_int8_bytes(args, dict(param_bytes=args.param_bytes, grad_bytes=args.grad_bytes)),
    )


def _model_sizes(args: argparse.Namespace) -> tuple[str | None, float, tuple[int, ...]]:
    if args.model:
        from lightning_zero.planning.model import load_model, summarize_model

        try:
            summary = summarize_model(load_model(args.model))
        except TypeError as err:
            raise ValueError(str(err)) from err
        if summary.psi == 0:
            raise ValueError(f"model {args.model!r} has no trainable parameters")
        return summary.name, float(summary.psi), tuple(layer.numel for layer in summary.layers)
    if args.params is None:
        raise ValueError("give the model size: --params 7.5B or --model package.module:Class")
    return None, args.params, comm.uniform_layers(args.params, args.layers)


_HYBRID_ONLY = (  # options that only the hybrid-sharding table reads
    "ranks_per_node",
    "stage",
    "groups",
    "intra_bandwidth",
    "inter_bandwidth",
    "intra_alpha",
    "inter_alpha",
)


class HybridInputs(NamedTuple):
    shard_size: int | str  # K, "node" (K = G) or "auto"
    ranks_per_node: int  # G
    stages: tuple[int, ...]  # stages of the table
    groups: int | None  # buckets (stages 1-2) or wrap units (stage 3)
    intra: Link | None  # alpha and W inside a node; None: no time column
    inter: Link | None  # alpha and W across nodes; None: no time column


def _hybrid_inputs(args: argparse.Namespace, inp: PlanInputs) -> HybridInputs | None:
    if args.shard_size is None:
        given = [name for name in _HYBRID_ONLY if getattr(args, name) is not None]
        if given and args.secondary_shard_size is None:
            raise ValueError(
                f"--{given[0].replace('_', '-')} belongs to hybrid sharding: add --shard-size K or auto"
            )
        return None
    ranks_per_node, intra, inter = _node_links(args, inp, "--shard-size")
    if args.shard_size == hybrid.AUTO:
        _check_auto(args, inp, intra, inter)
    stages = tuple(dict.fromkeys(args.stage)) if args.stage else (1, 2, 3)
    return HybridInputs(args.shard_size, ranks_per_node, stages, args.groups, intra, inter)


def _node_links(
    args: argparse.Namespace, inp: PlanInputs, option: str
) -> tuple[int, Link | None, Link | None]:
    """G and the two links (None where not given) of the hybrid and secondary-shard tables."""
    hw = inp.hardware
    ranks_per_node = args.ranks_per_node or (hw.gpus_per_node if hw else None)
    if ranks_per_node is None:
        raise ValueError(f"{option} needs the ranks per node: --ranks-per-node G, or --hardware")
    if args.groups is not None and args.groups < 1:
        raise ValueError(f"--groups must be >= 1, got {args.groups}")
    intra_bw = args.intra_bandwidth or (hw.link_bw if hw else None)
    inter_bw = args.inter_bandwidth or (hw.node_bw / hw.gpus_per_node if hw and hw.node_bw else None)
    intra = None if intra_bw is None else Link(_or(args.intra_alpha, args.alpha), intra_bw)
    inter = None if inter_bw is None else Link(_or(args.inter_alpha, args.alpha), inter_bw)
    return ranks_per_node, intra, inter


def _secondary_section(inp: PlanInputs, args: argparse.Namespace) -> Section:
    """Stage 3 over all N ranks, without and with secondary shards (and int8 forward gathers when
    asked): bytes per link, the memory the copies cost at the end of forward, the time."""
    g, intra, inter = _node_links(args, inp, "--secondary-shard-size")
    p, grads = inp.memory_options["param_bytes"], inp.memory_options["grad_bytes"]
    wire = inp.int8 or {"param_bytes": p, "grad_bytes": grads}
    rows, data = [], []
    for n in inp.world_sizes:
        s = min(g, n) if args.secondary_shard_size == hybrid.NODE else args.secondary_shard_size
        if n % s or (g % s and s % g):
            raise ValueError(
                f"--secondary-shard-size {s} must divide N = {n} and divide G = {g} or be a multiple of it"
            )
        for secondary in (None, s) if s < n else (None,):
            t = hybrid.hybrid_traffic(
                inp.psi, n, 3, ranks_per_node=g, groups=args.groups,
                secondary_shard_size=secondary, secondary_bytes=p, **wire,
            )  # fmt: skip
            extra = hybrid.secondary_shard_memory(inp.psi, secondary, p) if secondary else 0.0
            seconds = hybrid.hybrid_comm_time(t, intra=intra, inter=inter) if intra and inter else None
            label = f"secondary s = {secondary}" if secondary else "without"
            rows.append(
                (str(n), label, *(f"{v / memory.GB:.4g}" for v in (t.intra, t.inter, extra)), _ms(seconds))
            )
            data.append(
                {"world_size": n, "secondary_shard_size": secondary, "intra": t.intra, "inter": t.inter,
                 "memory": extra, "time_s": seconds}
            )  # fmt: skip
    headers = (
        "N",
        "stage 3" + (", int8" if inp.int8 else ""),
        "intra GB",
        "inter GB",
        "copies GB",
        "comm ms",
    )
    notes = (
        f"G = {g} ranks per node; the backward all-gathers run inside groups of s ranks, in the compute dtype "
        "(param bytes); copies = what each rank holds at the end of forward, Psi x param bytes / s",
        "s = N (one node) changes nothing: the all-gathers are inside the node already",
    )
    return Section("secondary", "Secondary shards (hpZ), full sharding", headers, rows, data, notes)


def _check_auto(args: argparse.Namespace, inp: PlanInputs, intra: Link | None, inter: Link | None) -> None:
    if intra is None or inter is None:
        raise ValueError(
            "--shard-size auto needs both links: --hardware with a cluster preset (h100-cluster, ...), "
            "or --intra-bandwidth and --inter-bandwidth"
        )
    if inp.device_memory is None:
        raise ValueError("--shard-size auto needs a memory budget per rank: --memory, or --hardware")
    if args.stage and 0 in args.stage:
        raise ValueError("--shard-size auto needs stages 1-3: stage 0 shards nothing (drop 0 from --stage)")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _bandwidth(inp: PlanInputs, world_size: int | None) -> float | None:
    if inp.bandwidth is not None:
        return inp.bandwidth
    return comm.bus_bandwidth(inp.hardware, world_size=world_size) if inp.hardware else None


# --------------------------------------------------------------------------- plan: sections


class Section(NamedTuple):
    key: str  # JSON key
    title: str  # table title
    headers: tuple[str, ...]  # column headers
    rows: list[tuple[str, ...]]  # formatted cells
    data: Any  # the same content for --json, SI units (bytes, seconds)
    notes: tuple[str, ...] = ()  # lines printed under the table


def _memory_section(inp: PlanInputs) -> Section:
    rows, data = [], []
    for n in inp.world_sizes:
        estimates = memory.memory_by_stage(inp.psi, n, **inp.memory_options)
        fit = [m.stage for m in estimates if inp.device_memory and m.total <= inp.device_memory]
        fits = ", ".join(_STAGE_NAMES[s].split(" ")[0] for s in fit) or "none"
        rows.append((str(n), *(_gb(m.total) for m in estimates), fits if inp.device_memory else "-"))
        data.extend({**m._asdict(), "fits": m.stage in fit if inp.device_memory else None} for m in estimates)
    mem = f"{inp.device_memory / memory.GB:.3g} GB" if inp.device_memory else "(no --memory)"
    title = f"Model-state memory per rank, GB (Ψ = {_count(inp.psi)}, k = {inp.memory_options['k']:g})"
    return Section("memory", title, ("N", *_STAGE_NAMES, f"fits {mem}"), rows, data)


def _int8_bytes(args: argparse.Namespace, plain: dict[str, float]) -> dict[str, float] | None:
    """The wire bytes per element of stage 3 with ``--quantize-weights`` / ``--quantize-grads``."""
    if not (args.quantize_weights or args.quantize_grads):
        return None
    int8 = comm.int8_wire_bytes(args.quantize_block)
    return {
        "param_bytes": int8 if args.quantize_weights else plain["param_bytes"],
        "grad_bytes": int8 if args.quantize_grads else plain["grad_bytes"],
    }


def _traffic_section(inp: PlanInputs) -> Section:
    rows, data = [], []
    plain = {k: inp.memory_options[k] for k in ("param_bytes", "grad_bytes")}
    variants = [(stage, _STAGE_NAMES[stage], plain) for stage in memory.STAGES]
    if inp.int8 is not None:
        variants.append((3, f"{_STAGE_NAMES[3]}, int8", inp.int8))
    for n in inp.world_sizes:
        bw = _bandwidth(inp, n)
        for stage, name, wire in variants:
            t = comm.step_traffic(inp.psi, n, stage, **wire)
            seconds = comm.traffic_time(t, bw, alpha=inp.alpha) if bw else None
            volumes = (t.all_reduce, t.reduce_scatter, t.all_gather, t.total)
            rows.append((str(n), name, *(f"{v / memory.GB:.4g}" for v in volumes), _ms(seconds)))
            data.append({**t._asdict(), "time_s": seconds, "bandwidth": bw, "int8": name.endswith("int8")})
    headers = ("N", "stage", "AllReduce GB", "ReduceScatter GB", "AllGather GB", "total GB", "time ms")
    note = "bytes one rank sends per step, ring algorithm; time = bytes / W + alpha x collectives, not overlapped"
    return Section("traffic", "Communication per rank per step", headers, rows, data, (note,))


def _hybrid_section(inp: PlanInputs, hyb: HybridInputs) -> Section:
    rows, data = [], []
    for n in inp.world_sizes:
        for stage in hyb.stages:
            options, chosen = _shard_options(inp, hyb, n, stage)
            for option, cells in zip(options, hybrid.shard_table_rows(options)):
                full = option.shard_size == n
                mark = " ".join(
                    m for m, on in (("full sharding", full), ("<- chosen", option.shard_size == chosen)) if on
                )
                rows.append((str(n), _STAGE_NAMES[stage], *cells, mark))
                data.append(
                    {
                        "world_size": n,
                        "stage": stage,
                        **option._asdict(),
                        "full_sharding": full,
                        "chosen": chosen,
                    }
                )
    budget = f", budget {inp.device_memory / memory.GB:.3g} GB" if inp.device_memory else ""
    title = (
        f"Hybrid sharding, shard_size = {hyb.shard_size} (G = {hyb.ranks_per_node} ranks per node{budget})"
    )
    section_data = {
        "shard_size": hyb.shard_size,
        "ranks_per_node": hyb.ranks_per_node,
        "groups": hyb.groups,
        "intra": hyb.intra._asdict() if hyb.intra else None,
        "inter": hyb.inter._asdict() if hyb.inter else None,
        "memory_budget": inp.device_memory,
        "rows": data,
    }
    headers = ("N", "stage", *hybrid.SHARD_TABLE_HEADERS, "")
    return Section("hybrid", title, headers, rows, section_data, _hybrid_notes(hyb))


def _shard_options(
    inp: PlanInputs, hyb: HybridInputs, n: int, stage: int
) -> tuple[tuple[hybrid.ShardOption, ...], int | None]:
    """The options of one row group (N, stage) and the K chosen among them (None: K was given)."""
    common = dict(ranks_per_node=hyb.ranks_per_node, intra=hyb.intra, inter=hyb.inter, groups=hyb.groups)
    if hyb.shard_size == hybrid.AUTO:
        choice = hybrid.choose_shard_size(
            inp.psi, n, stage, memory_budget=inp.device_memory, **common, **inp.memory_options
        )
        return choice.options, choice.shard_size
    k = min(hyb.ranks_per_node, n) if hyb.shard_size == hybrid.NODE else hyb.shard_size
    sizes = dict.fromkeys((n, k))  # full sharding first
    options = tuple(
        hybrid.evaluate_shard_size(
            inp.psi, n, stage, shard_size=k, memory_budget=inp.device_memory, **common, **inp.memory_options
        )
        for k in sizes
    )
    return options, None


def _hybrid_notes(hyb: HybridInputs) -> tuple[str, ...]:
    links = [
        f"{name} W = {link.bandwidth / 1e9:.4g} GB/s per rank, alpha {link.alpha * 1e6:g} us"
        for name, link in (("intra-node", hyb.intra), ("inter-node", hyb.inter))
        if link is not None
    ]
    return (
        "K ranks per shard group, R = N/K replicas; memory = model states per rank; intra/inter GB = bytes one "
        "rank sends per step on groups inside one node / spanning nodes (ring algorithm, as the ledger counts)",
        "comm ms = calls x alpha + bytes / W per link, one collective after another, not overlapped; a collective "
        "whose group spans nodes is charged all its bytes at the inter-node W"
        + (f" ({'; '.join(links)})" if links else ""),
    )


def _threshold_section(inp: PlanInputs) -> Section:
    rows, data = [], []
    for n in (None, *inp.world_sizes):
        bw = _bandwidth(inp, n)
        t = comm.comm_threshold(inp.flops, bw, world_size=n, experts=inp.experts, top_k=inp.top_k)
        min_batch = comm.min_global_batch_tokens(t, n) if n else None
        label = "large N" if n is None else str(n)
        rows.append(
            (
                label,
                f"{bw / 1e9:.4g}",
                f"{t.ring_factor:.4g}",
                f"{t.moe_factor:g}",
                f"{t.tokens_per_rank:,.0f}",
                f"{min_batch:,.0f}" if min_batch else "-",
            )
        )
        data.append({**t._asdict(), "world_size": n, "min_global_batch_tokens": min_batch})
    name = inp.hardware.name if inp.hardware else "given C and W"
    headers = ("N", "W GB/s", "(N-1)/N", "E/k", "tokens per rank >", "global batch tokens >")
    note = f"compute-bound when tokens per rank > C/W x (N-1)/N x E/k, C = {inp.flops:.3g} FLOP/s"
    return Section("threshold", f"Compute/communication threshold ({name})", headers, rows, data, (note,))


def _tokens_per_rank(args: argparse.Namespace) -> float:
    if args.tokens_per_rank:
        return args.tokens_per_rank
    if args.micro_batch and args.seq_len:
        return float(args.micro_batch * args.seq_len)
    raise ValueError(
        "--bucket-sweep needs --tokens-per-rank (or --micro-batch with --seq-len) for backward time"
    )


def _bucket_sweep(inp: PlanInputs, args: argparse.Namespace) -> tuple[comm.BucketRecommendation, float]:
    """The sweep for the first N, and the tokens per rank it assumed."""
    bw = _bandwidth(inp, inp.world_sizes[0])
    if bw is None or inp.flops is None:
        raise ValueError("--bucket-sweep needs --hardware, or --flops and --bandwidth")
    tokens = _tokens_per_rank(args)
    times = comm.backward_times_from_flops(inp.layers, tokens_per_rank=tokens, flops=inp.flops)
    rec = comm.recommend_bucket_cap_mb(
        inp.layers,
        times,
        world_size=inp.world_sizes[0],
        bandwidth=bw,
        alpha=inp.alpha,
        grad_bytes=inp.memory_options["grad_bytes"],
        first_bucket_cap_mb=args.first_bucket_cap_mb,
        caps_mb=args.bucket_caps,
    )
    return rec, tokens


def _bucket_section(inp: PlanInputs, rec: comm.BucketRecommendation, tokens: float) -> Section:
    rows, sweep = [], []
    for s in rec.sweep:
        mark = "<- recommended" if s.bucket_cap_mb == rec.bucket_cap_mb else ""
        rows.append((f"{s.bucket_cap_mb:g}", str(len(s.buckets)), _ms(s.comm), _ms(s.exposed), mark))
        sweep.append(
            {
                "bucket_cap_mb": s.bucket_cap_mb,
                "buckets": len(s.buckets),
                "comm_s": s.comm,
                "exposed_s": s.exposed,
            }
        )
    backward = rec.sweep[0].backward
    data = {
        "world_size": inp.world_sizes[0],
        "bandwidth": _bandwidth(inp, inp.world_sizes[0]),
        "alpha": inp.alpha,
        "tokens_per_rank": tokens,
        "layers": len(inp.layers),
        "backward_s": backward,
        "recommended_bucket_cap_mb": rec.bucket_cap_mb,
        "exposed_s": rec.exposed,
        "sweep": sweep,
    }
    title = f"Gradient buckets (N = {inp.world_sizes[0]}, {len(inp.layers)} layers)"
    note = (
        f"exposed = AllReduce time left after backward ({_ms(backward)} ms at {tokens:,.0f} tokens per rank); "
        f"alpha {inp.alpha * 1e6:g} us"
    )
    return Section("buckets", title, ("cap MiB", "buckets", "comm ms", "exposed ms", ""), rows, data, (note,))


def _batch_section(inp: PlanInputs, args: argparse.Namespace) -> Section:
    rows, data, notes = [], [], []
    if args.micro_batch is None:
        raise ValueError("batch planning needs --micro-batch (the largest that fits one rank)")
    for n in inp.world_sizes:
        plan = _plan_batch(args, n)
        rows.append(
            (
                str(n),
                str(plan.global_batch),
                str(plan.micro_batch),
                str(plan.grad_acc),
                f"{plan.global_batch_tokens:,}" if plan.global_batch_tokens else "-",
            )
        )
        data.append(plan._asdict())
        notes.extend(f"N = {n}: {w}" for w in plan.warnings)
    return Section(
        "batch",
        "Batch plan: gbs = mbs x grad_acc x dp",
        ("dp", "gbs", "mbs", "grad_acc", "tokens"),
        rows,
        data,
        tuple(notes),
    )


def _plan_batch(args: argparse.Namespace, dp: int) -> batch.BatchPlan:
    with warnings.catch_warnings():  # the warnings are shown as table notes
        warnings.simplefilter("ignore", batch.BatchPlanWarning)
        if args.global_batch is not None:
            return batch.plan_batch_samples(
                args.global_batch, max_micro_batch=args.micro_batch, dp=dp, seq_len=args.seq_len
            )
        if args.seq_len is None:
            raise ValueError("--global-batch-tokens needs --seq-len")
        return batch.plan_batch(
            args.global_batch_tokens,
            seq_len=args.seq_len,
            max_micro_batch=args.micro_batch,
            dp=dp,
            round_to_power_of_two=args.pow2,
        )


# --------------------------------------------------------------------------- plan: run


def _run_plan(args: argparse.Namespace) -> int:
    inp = _plan_inputs(args)
    hyb = _hybrid_inputs(args, inp)
    sections = [_memory_section(inp), _traffic_section(inp)]
    if hyb is not None:
        sections.append(_hybrid_section(inp, hyb))
    if args.secondary_shard_size is not None:
        sections.append(_secondary_section(inp, args))
    if inp.flops and _bandwidth(inp, None):
        sections.append(_threshold_section(inp))
    rec = None
    if args.bucket_sweep:
        rec, tokens = _bucket_sweep(inp, args)
        sections.append(_bucket_section(inp, rec, tokens))
    if args.global_batch is not None or args.global_batch_tokens is not None:
        sections.append(_batch_section(inp, args))
    plots = _write_plots(args.plot_dir, inp, rec) if args.plot_dir else []
    if args.json:
        print(json.dumps(_json_report(inp, sections, plots), indent=2))
    else:
        _print_sections(inp, sections, plots)
    return 0


def _json_report(inp: PlanInputs, sections: list[Section], plots: list[Path]) -> dict[str, Any]:
    inputs = {
        "model": inp.model,
        "psi": inp.psi,
        "layers": len(inp.layers),
        "world_sizes": list(inp.world_sizes),
        **inp.memory_options,
        "device_memory": inp.device_memory,
        "hardware": inp.hardware._asdict() if inp.hardware else None,
        "flops": inp.flops,
        "bandwidth": inp.bandwidth,
        "alpha": inp.alpha,
        "experts": inp.experts,
        "top_k": inp.top_k,
    }
    return {"inputs": inputs, **{s.key: s.data for s in sections}, "plots": [str(p) for p in plots]}


def _print_sections(inp: PlanInputs, sections: list[Section], plots: list[Path]) -> None:
    header = f"{inp.model + ': ' if inp.model else ''}Ψ = {_count(inp.psi)} trainable parameters"
    frozen = inp.memory_options.get("frozen", 0)
    header += f" + {_count(frozen)} frozen (no gradient or optimizer state)" if frozen else ""
    try:
        from rich.console import Console
    except ImportError:  # rich is an optional extra: plain text then
        print(header)
        for section in sections:
            _print_plain(section)
    else:
        console = Console() if sys.stdout.isatty() else Console(width=130)
        console.print(header, highlight=False)
        for section in sections:
            console.print(_rich_table(section))
            for line in _note_lines(section):
                console.print(line, highlight=False, markup=False, soft_wrap=True)
    for path in plots:
        print(f"wrote {path}")


def _rich_table(section: Section) -> Any:
    from rich.table import Table

    table = Table(title=section.title, title_justify="left")
    for i, header in enumerate(section.headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in section.rows:
        table.add_row(*row)
    return table


def _print_plain(section: Section) -> None:
    widths = [max(len(h), *(len(r[i]) for r in section.rows)) for i, h in enumerate(section.headers)]
    print(f"\n{section.title}")
    for row in (section.headers, *section.rows):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    for line in _note_lines(section):
        print(line)


def _note_lines(section: Section) -> list[str]:
    """The notes under a table, wrapped at 110 columns whatever the terminal (continuations indented)."""
    return [
        line
        for note in section.notes
        for line in textwrap.wrap(note, width=110, initial_indent="  ", subsequent_indent="    ")
    ]


# --------------------------------------------------------------------------- plan: plots


def _write_plots(plot_dir: Path, inp: PlanInputs, rec: comm.BucketRecommendation | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = [_plot_memory(plt, plot_dir / "memory.png", inp)]
    if rec is not None:
        paths.append(_plot_buckets(plt, plot_dir / "buckets.png", rec, inp.world_sizes[0]))
    return paths


def _plot_memory(plt: Any, path: Path, inp: PlanInputs) -> Path:
    top = max(1024, 2 * max(inp.world_sizes))
    ns = [2**i for i in range(top.bit_length())]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for stage, name in enumerate(_STAGE_NAMES):
        gb = [
            memory.model_state_memory(inp.psi, n, stage, **inp.memory_options).total / memory.GB for n in ns
        ]
        ax.plot(ns, gb, marker="o", markersize=3, label=name)
    if inp.device_memory:
        ax.axhline(inp.device_memory / memory.GB, color="black", linestyle="--", label="device memory")
    title = f"Model-state memory per rank, Ψ = {_count(inp.psi)}"
    return _save_log_log(plt, fig, ax, path, "data-parallel ranks N", "model states per rank, GB", title)


def _plot_buckets(plt: Any, path: Path, rec: comm.BucketRecommendation, n: int) -> Path:
    caps = [s.bucket_cap_mb for s in rec.sweep]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(caps, [s.exposed * 1e3 for s in rec.sweep], marker="o", label="exposed after backward")
    ax.plot(caps, [s.comm * 1e3 for s in rec.sweep], linestyle=":", label="total AllReduce time")
    ax.axvline(
        rec.bucket_cap_mb, color="green", linestyle="--", label=f"recommended {rec.bucket_cap_mb:g} MiB"
    )
    title = f"Gradient AllReduce exposed after backward (N = {n})"
    return _save_log_log(plt, fig, ax, path, "bucket_cap_mb, MiB", "ms", title)


def _save_log_log(plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Log-log axes with a grid and a legend, written to ``path``; the figure is closed."""
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- consolidate


def _add_consolidate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one plain Lightning checkpoint file",
        description="Read a checkpoint written with state_dict_type='sharded' in this process alone (no "
        "process group, no GPU) and write one file that LightningModule.load_from_checkpoint and "
        "Trainer.fit(ckpt_path=...) load. See docs/checkpoints.md.",
    )
    p.set_defaults(run=_run_consolidate)
    p.add_argument("checkpoint_dir", type=Path, help="the sharded checkpoint (a directory)")
    p.add_argument("out", type=Path, help="the checkpoint file to write")
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="leave out optimizer, LR-scheduler and callback state (weights, hyper-parameters, progress)",
    )
    p.add_argument(
        "--trusted",
        action="store_true",
        help="the checkpoint comes from a trusted source: unpickle the objects in meta.pt and the shards "
        "as saved, which runs the code they name (default: only plain values and tensors load)",
    )


def _run_consolidate(args: argparse.Namespace) -> int:
    from lightning_zero.checkpoint import CheckpointError, consolidate  # torch: only when asked

    try:
        result = consolidate(
            args.checkpoint_dir, args.out, weights_only=args.weights_only, trusted=args.trusted
        )
    except (CheckpointError, FileNotFoundError) as err:
        raise ValueError(str(err)) from err
    print(
        f"wrote {result.path}: {result.tensors} model tensors, {result.optimizers} optimizer state(s), "
        f"{result.nbytes / 2**20:.2f} MiB"
    )
    return 0


# --------------------------------------------------------------------------- formatting


def _count(value: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.4g}{suffix}"
    return f"{value:g}"


def _gb(nbytes: float) -> str:
    gb = nbytes / memory.GB
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.3g}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"


if __name__ == "__main__":
    sys.exit(main())
