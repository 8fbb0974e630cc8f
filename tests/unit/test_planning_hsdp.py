"""Hybrid sharding (HSDP) in the planner: memory with shard size K, traffic split into intra- and
inter-node bytes, the alpha-beta time, the choice of ``shard_size="auto"`` and the CLI.

The worked case, derived by hand: N = 4 ranks, G = 2 ranks per node, K = 2, Ψ = 1e6 in fp32
(p = g = 4 bytes; fp32 Adam without a master copy, k = 8). Shard groups {0, 1} and {2, 3} sit
inside a node; replicate groups {0, 2} and {1, 3} cross nodes (R = 2).

- memory per rank: stage 1 (4 + 4)Ψ + 8Ψ/2 = 12 MB, stage 2 4Ψ + 12Ψ/2 = 10 MB, stage 3 16Ψ/2 = 8 MB
  (full sharding, K = 4: 10, 7 and 4 MB);
- stages 1-2, one bucket: ReduceScatter of 4 MB over 2 ranks 1/2 x 4 MB = 2 MB (intra), AllReduce
  of the 2 MB shard over 2 ranks 2 x 1/2 x 2 MB = 2 MB (inter), AllGather 1/2 x 4 MB = 2 MB
  (intra): 4 MB intra, 2 MB inter. Full sharding: ReduceScatter + AllGather 2 x 3/4 x 4 MB = 6 MB,
  all inter-node (the 4 ranks span both nodes);
- stage 3, L = 2 units: ReduceScatters 2 MB (2 calls), AllReduces 2 MB (2 calls, inter),
  AllGathers (2L-1)/L x 1/2 x 4 MB = 3 MB (3 calls): 5 MB intra, 2 MB inter. Full sharding:
  3 + 4.5 = 7.5 MB inter, 5 calls.
"""

from __future__ import annotations

import json
import sys

import pytest

from lightning_zero.cli import main
from lightning_zero.planning import (
    Link,
    choose_shard_size,
    evaluate_shard_size,
    format_shard_table,
    hybrid_comm_time,
    hybrid_layout,
    hybrid_traffic,
    memory_by_stage,
    model_state_memory,
    step_traffic,
    valid_shard_sizes,
)
from tests.unit.test_cli_plan import HEAVY, imported_modules

PSI = 1e6
FP32 = dict(param_bytes=4, grad_bytes=4)
FP32_ADAM = dict(k=8, **FP32)  # fp32 training: the parameters are the master weights
INTRA = Link(alpha=1e-3, bandwidth=1e9)  # 1 ms, 1 GB/s
INTER = Link(alpha=1e-2, bandwidth=1e8)  # 10 ms, 100 MB/s: the slow link


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    ("stage", "hybrid", "full"),
    [(1, 12e6, 10e6), (2, 10e6, 7e6), (3, 8e6, 4e6)],
    ids=["zero1", "zero2", "zero3"],
)
def test_memory_of_the_worked_case(stage, hybrid, full):
    estimate = model_state_memory(PSI, 4, stage, shard_size=2, **FP32_ADAM)
    assert estimate.total == pytest.approx(hybrid)
    assert (estimate.world_size, estimate.shard_size) == (4, 2)
    assert model_state_memory(PSI, 4, stage, **FP32_ADAM).total == pytest.approx(full)


def test_memory_with_bf16_adam_replaces_n_by_k():
    psi, n, k = 7.5e9, 64, 8  # 4Ψ + 12Ψ/K, 2Ψ + 14Ψ/K, 16Ψ/K with K = 8
    totals = [model_state_memory(psi, n, s, shard_size=k).total for s in (1, 2, 3)]
    assert totals == pytest.approx([30e9 + 11.25e9, 15e9 + 13.125e9, 15e9])


def test_shard_size_none_or_n_is_full_sharding():
    paper = [m.total for m in memory_by_stage(7.5e9, 64)]
    assert paper == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9])
    assert [m.total for m in memory_by_stage(7.5e9, 64, shard_size=64)] == pytest.approx(paper)
    assert memory_by_stage(7.5e9, 64)[3].shard_size == 64


def test_shard_size_shards_the_accumulation_buffer_and_frozen_parameters_too():
    # stage 3, K = 2: fp32 accumulation 4Ψ/2, frozen 2Ψ_f/2, states 16Ψ/2
    estimate = model_state_memory(PSI, 8, 3, shard_size=2, fp32_grad_accum=True, frozen=3e6)
    assert (estimate.grad_accum, estimate.params) == pytest.approx((2e6, (2 * PSI + 2 * 3e6) / 2))
    assert estimate.total == pytest.approx(8 * PSI + 2 * PSI + 3e6)  # 16Ψ/2 + 4Ψ/2 + 2Ψ_f/2


def test_memory_rejects_a_bad_shard_size():
    with pytest.raises(ValueError, match=r"K = 3 does not divide the world size N = 8.*\[1, 2, 4, 8\]"):
        model_state_memory(PSI, 8, 2, shard_size=3)
    with pytest.raises(ValueError, match="stage 0 shards nothing.*K = 4 with N = 8"):
        model_state_memory(PSI, 8, 0, shard_size=4)
    assert model_state_memory(PSI, 8, 0, shard_size=8).total == pytest.approx(16 * PSI)
    with pytest.raises(ValueError, match="int >= 1 or None"):
        model_state_memory(PSI, 8, 2, shard_size=0)


# --------------------------------------------------------------------------- layout


def spans(ranks: list[int], per_node: int) -> bool:
    return len({r // per_node for r in ranks}) > 1


@pytest.mark.parametrize(("n", "g"), [(4, 2), (8, 4), (16, 4), (24, 6), (6, 8), (8, 1)])
def test_layout_agrees_with_the_groups_written_out(n, g):
    for k in valid_shard_sizes(n, g):
        layout = hybrid_layout(n, g, shard_size=k)
        shard_groups = [list(range(start, start + k)) for start in range(0, n, k)]
        replicate_groups = [list(range(i, n, k)) for i in range(k)]
        per_node = min(g, n)
        assert layout.shard_spans_nodes == any(spans(s, per_node) for s in shard_groups), (n, g, k)
        assert layout.replicate_spans_nodes == any(spans(r, per_node) for r in replicate_groups), (n, g, k)
        assert layout.replicas == len(shard_groups) == len(replicate_groups[0])


def test_valid_shard_sizes_keep_groups_inside_or_across_whole_nodes():
    assert valid_shard_sizes(16, 8) == (1, 2, 4, 8, 16)
    assert valid_shard_sizes(24, 6) == (1, 2, 3, 6, 12, 24)  # 4 and 8 would straddle a node boundary
    assert valid_shard_sizes(6, 8) == (1, 2, 3, 6)  # one node of 6 ranks: any divisor


def test_layout_errors_name_the_problem():
    with pytest.raises(
        ValueError, match=r"K = 4 ranks would span nodes of G = 6 ranks unevenly.*\[1, 2, 3, 6, 12\]"
    ):
        hybrid_layout(12, 6, shard_size=4)
    with pytest.raises(ValueError, match="N = 12 is not a multiple of the ranks per node G = 8"):
        hybrid_layout(12, 8)
    with pytest.raises(ValueError, match="does not divide the world size"):
        hybrid_layout(8, 4, shard_size=3)
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        hybrid_layout(8, 4, shard_size=4, stage=0)


# --------------------------------------------------------------------------- traffic


def test_traffic_of_the_worked_case_stage_2():
    t = hybrid_traffic(PSI, 4, 2, ranks_per_node=2, shard_size=2, **FP32)
    kinds = {(c.op, c.group): c for c in t.collectives}
    rs, ar, ag = (
        kinds["reduce_scatter", "shard"],
        kinds["all_reduce", "replicate"],
        kinds["all_gather", "shard"],
    )
    assert (rs.payload, rs.wire, rs.group_size, rs.spans_nodes) == (4e6, 2e6, 2, False)
    assert (ar.payload, ar.wire, ar.group_size, ar.spans_nodes) == (2e6, 2e6, 2, True)
    assert (ag.payload, ag.wire, ag.spans_nodes) == (4e6, 2e6, False)
    assert (t.intra, t.inter, t.intra_calls, t.inter_calls) == (4e6, 2e6, 2, 1)
    full = hybrid_traffic(PSI, 4, 2, ranks_per_node=2, **FP32)
    assert (full.intra, full.inter, full.intra_calls, full.inter_calls) == (0.0, 6e6, 0, 2)


def test_traffic_of_the_worked_case_stage_3_with_two_units():
    t = hybrid_traffic(PSI, 4, 3, ranks_per_node=2, shard_size=2, groups=2, **FP32)
    assert (t.intra, t.inter, t.intra_calls, t.inter_calls) == (5e6, 2e6, 5, 2)
    assert (t.wire("reduce_scatter"), t.wire("all_reduce"), t.wire("all_gather")) == (2e6, 2e6, 3e6)
    full = hybrid_traffic(PSI, 4, 3, ranks_per_node=2, groups=2, **FP32)
    assert (full.intra, full.inter, full.inter_calls) == (0.0, 7.5e6, 5)


@pytest.mark.parametrize(("n", "g"), [(8, 8), (16, 8)], ids=["one-node", "two-nodes"])
@pytest.mark.parametrize("groups", [None, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_sharding_is_todays_step_traffic(stage, groups, n, g):
    today = step_traffic(1e9, n, stage, groups=groups)
    t = hybrid_traffic(1e9, n, stage, ranks_per_node=g, groups=groups)
    ops = (t.wire("all_reduce"), t.wire("reduce_scatter"), t.wire("all_gather"))
    assert ops == pytest.approx((today.all_reduce, today.reduce_scatter, today.all_gather))
    assert t.total == pytest.approx(today.total)
    assert t.intra_calls + t.inter_calls == today.collectives
    assert (t.intra, t.inter) == ((today.total, 0.0) if n == g else (0.0, pytest.approx(today.total)))


def test_stage_1_2_bytes_do_not_depend_on_k():
    # 2(K-1)/K + 2(R-1)/R / K = 2(N-1)/N: the all-reduce of the shard makes up what the smaller groups save
    totals = [
        hybrid_traffic(1e9, 16, 2, ranks_per_node=8, shard_size=k).total for k in valid_shard_sizes(16, 8)
    ]
    assert totals == pytest.approx([2 * 15 / 16 * 2e9] * 5)


@pytest.mark.parametrize("stage", [1, 3])
def test_traffic_agrees_with_the_ledger(stage):
    from lightning_zero.comm import CommLedger

    psi, units = 1_200_000, 4  # bf16; every bucket or unit of 300,000 parameters
    t = hybrid_traffic(psi, 8, stage, ranks_per_node=4, shard_size=4, groups=units)
    ledger = CommLedger()
    for c in t.collectives:  # what an engine with equal buckets would file
        for _ in range(c.calls):
            ledger.record(c.op, f"hsdp/{c.group}", round(c.payload / c.calls), c.group_size)
    filed = ledger.totals(0)
    assert {op: filed[op].wire_bytes for op in filed} == pytest.approx(
        {op: t.wire(op) for op in ("reduce_scatter", "all_reduce", "all_gather")}
    )
    assert sum(v.calls for v in filed.values()) == t.intra_calls + t.inter_calls


def test_groups_of_one_rank_issue_nothing():
    dp_like = hybrid_traffic(PSI, 4, 2, ranks_per_node=2, shard_size=1, **FP32)  # K = 1: an AllReduce over N
    assert [(c.op, c.group_size) for c in dp_like.collectives] == [("all_reduce", 4)]
    assert dp_like.total == pytest.approx(step_traffic(PSI, 4, 0, grad_bytes=4).total)


# --------------------------------------------------------------------------- time


def test_time_of_the_worked_case():
    def seconds(stage, shard_size, groups=None):
        t = hybrid_traffic(PSI, 4, stage, ranks_per_node=2, shard_size=shard_size, groups=groups, **FP32)
        return hybrid_comm_time(t, intra=INTRA, inter=INTER)

    # stage 2: intra 2 x 1 ms + 4 MB / 1 GB/s = 6 ms; inter 10 ms + 2 MB / 100 MB/s = 30 ms
    assert seconds(2, 2) == pytest.approx(0.036)
    assert seconds(2, 4) == pytest.approx(2 * 0.01 + 6e6 / 1e8)  # 80 ms, all across nodes
    # stage 3, two units: intra 5 x 1 ms + 5 ms = 10 ms; inter 2 x 10 ms + 20 ms = 40 ms
    assert seconds(3, 2, groups=2) == pytest.approx(0.05)
    assert seconds(3, 4, groups=2) == pytest.approx(5 * 0.01 + 7.5e6 / 1e8)  # 125 ms


def test_time_with_the_bytes_gloo_sends():
    """On gloo a stage-2 reduce-scatter sends an all-reduce's bytes: twice the ring model's, the rest alike."""
    hybrid = hybrid_traffic(PSI, 4, 2, ranks_per_node=2, shard_size=2, **FP32)
    full = hybrid_traffic(PSI, 4, 2, ranks_per_node=2, shard_size=4, **FP32)
    # stage 2, K = 2: the reduce-scatter's 2 MB inside the node count twice: 6 ms + 2 ms, inter as before
    assert hybrid_comm_time(hybrid, intra=INTRA, inter=INTER, backend="gloo") == pytest.approx(0.038)
    # K = 4: 3 MB of reduce-scatter across the nodes count twice: 80 ms + 30 ms
    assert hybrid_comm_time(full, intra=INTRA, inter=INTER, backend="gloo") == pytest.approx(0.11)
    assert hybrid_comm_time(full, intra=INTRA, inter=INTER, backend="nccl") == pytest.approx(0.08)
    # quantize_grads reduces by an all-to-all, which gloo sends at the ring's bytes: no doubling
    assert hybrid_comm_time(full, intra=INTRA, inter=INTER, backend="gloo", int8_grads=True) == pytest.approx(
        0.08
    )
    # stage 3 exchanges its units' gradients (sends and receives): the ring's bytes on gloo too
    stage3 = hybrid_traffic(PSI, 4, 3, ranks_per_node=2, shard_size=4, **FP32)
    gloo = hybrid_comm_time(stage3, intra=INTRA, inter=INTER, backend="gloo")
    assert gloo == pytest.approx(hybrid_comm_time(stage3, intra=INTRA, inter=INTER, backend="nccl"))


def test_time_rejects_a_bad_link():
    t = hybrid_traffic(PSI, 4, 2, ranks_per_node=2, shard_size=2)
    with pytest.raises(ValueError, match="inter-node link's bandwidth must be > 0"):
        hybrid_comm_time(t, intra=INTRA, inter=Link(0.0, 0.0))
    with pytest.raises(ValueError, match="intra-node link's alpha must be >= 0"):
        hybrid_comm_time(t, intra=Link(-1.0, 1e9), inter=INTER)


# --------------------------------------------------------------------------- the choice


SLOW_INTER = dict(intra=Link(0.0, 100e9), inter=Link(0.0, 1e9))  # inter-node 100x slower


def test_auto_takes_one_node_per_shard_group_on_a_slow_inter_node_link():
    # Ψ = 1e9 bf16, N = 16 on nodes of 8, stage 3: inter-node bytes per K (intra at 100 GB/s is small)
    # K=1: 2 x 15/16 x 2 GB = 3.75 s; K=2: 1.75 GB -> 1.78 s; K=4: 0.75 GB -> 0.795 s;
    # K=8: 2 x 1/2 x 2 GB / 8 = 0.25 GB -> 0.25 + 5.25 GB / 100 GB/s = 0.3025 s; K=16: 5.625 s
    choice = choose_shard_size(1e9, 16, 3, ranks_per_node=8, memory_budget=None, **SLOW_INTER)
    assert (choice.shard_size, choice.fits) == (8, True)
    seconds = {o.shard_size: o.seconds for o in choice.options}
    assert seconds == pytest.approx({1: 3.75, 2: 1.78, 4: 0.795, 8: 0.3025, 16: 5.625})


def test_auto_keeps_within_the_memory_budget():
    # stage 3: 16Ψ/K = 2 GB at K = 8, 1 GB at K = 16; a 1.5 GB budget leaves only full sharding
    choice = choose_shard_size(1e9, 16, 3, ranks_per_node=8, memory_budget=1.5e9, **SLOW_INTER)
    assert (choice.shard_size, choice.fits) == (16, True)
    assert [o.fits for o in choice.options] == [False, False, False, False, True]


def test_auto_ties_go_to_the_largest_k():
    # one node, stage 2, no latency: every K sends 2(N-1)/N x 2Ψ, so all tie and K = N wins
    one_link = Link(0.0, 100e9)
    choice = choose_shard_size(
        1e9, 8, 2, ranks_per_node=8, memory_budget=None, intra=one_link, inter=one_link
    )
    assert len({round(o.seconds, 12) for o in choice.options}) == 1
    assert choice.shard_size == 8
    # with a latency, K = 1 issues one AllReduce, K = 8 two collectives, 1 < K < 8 three: K = 1 wins
    slow_calls = Link(1e-3, 100e9)
    choice = choose_shard_size(
        1e9, 8, 2, ranks_per_node=8, memory_budget=None, intra=slow_calls, inter=slow_calls
    )
    assert choice.shard_size == 1


def test_auto_when_nothing_fits_takes_full_sharding_and_says_so():
    choice = choose_shard_size(1e9, 16, 3, ranks_per_node=8, memory_budget=1e6, **SLOW_INTER)
    assert (choice.shard_size, choice.fits) == (16, False)
    assert "<- chosen (nothing fits: the least memory)" in format_shard_table(choice).splitlines()[-1]


def test_auto_refuses_stage_0():
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        choose_shard_size(1e9, 16, 0, ranks_per_node=8, memory_budget=None, **SLOW_INTER)


def test_evaluate_one_shard_size_uses_the_memory_options():
    option = evaluate_shard_size(
        PSI, 4, 2, shard_size=2, ranks_per_node=2, intra=INTRA, inter=INTER, memory_budget=11e6, **FP32_ADAM
    )
    assert option == (2, 2, pytest.approx(10e6), 4e6, 2e6, pytest.approx(0.036), True)
    assert evaluate_shard_size(PSI, 4, 2, shard_size=None, ranks_per_node=2).seconds is None


def test_the_table_marks_the_choice():
    choice = choose_shard_size(1e9, 16, 3, ranks_per_node=8, memory_budget=None, **SLOW_INTER)
    lines = format_shard_table(choice).splitlines()
    assert lines[0].split() == ["K", "R", "memory", "GB", "fits", "intra", "GB", "inter", "GB", "comm", "ms"]
    chosen = [line for line in lines if "<- chosen" in line]
    assert len(chosen) == 1 and chosen[0].split()[:4] == ["8", "2", "2", "-"]
    assert chosen[0].split()[4:7] == ["5.25", "0.25", "302.5"]


# --------------------------------------------------------------------------- the command


def run_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


WORKED_CASE = (
    "--params", "1M", "-n", "4", "--ranks-per-node", "2", "--param-bytes", "4", "--grad-bytes", "4",
    "--k", "8", "--intra-bandwidth", "1GB/s", "--inter-bandwidth", "100MB/s",
    "--intra-alpha", "1ms", "--inter-alpha", "10ms",
)  # fmt: skip


def test_plan_shard_size_beside_full_sharding(capsys):
    data = run_json(capsys, *WORKED_CASE, "--shard-size", "2", "--stage", "2", "--memory", "11MB")
    hybrid = data["hybrid"]
    assert (hybrid["shard_size"], hybrid["ranks_per_node"], hybrid["inter"]["bandwidth"]) == (2, 2, 1e8)
    full, hsdp = hybrid["rows"]
    assert (full["shard_size"], full["full_sharding"], full["intra"], full["inter"]) == (4, True, 0.0, 6e6)
    assert (hsdp["shard_size"], hsdp["intra"], hsdp["inter"]) == (2, 4e6, 2e6)
    assert (hsdp["memory"], full["memory"]) == pytest.approx((10e6, 7e6))
    assert hsdp["seconds"] == pytest.approx(0.036)
    assert full["seconds"] == pytest.approx(0.08)


def test_plan_shard_size_table(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # plain text: rows easy to read
    assert main(["plan", *WORKED_CASE, "--shard-size", "2", "--groups", "2", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "Hybrid sharding, shard_size = 2 (G = 2 ranks per node)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("4  ZeRO-3")]
    assert rows[0] == ["4", "ZeRO-3", "4", "1", "0.004", "-", "0", "0.0075", "125", "full", "sharding"]
    assert rows[1] == ["4", "ZeRO-3", "2", "2", "0.008", "-", "0.005", "0.002", "50"]


def test_plan_shard_size_node_is_the_ranks_per_node(capsys):
    data = run_json(
        capsys, "--params", "8B", "-n", "4", "64", "--hardware", "h100-cluster", "--shard-size", "node"
    )
    sizes = [(r["world_size"], r["stage"], r["shard_size"]) for r in data["hybrid"]["rows"]]
    assert sizes == [(4, 1, 4), (4, 2, 4), (4, 3, 4)] + [(64, s, k) for s in (1, 2, 3) for k in (64, 8)]
    zero2 = data["hybrid"]["rows"][-3]  # N = 64, K = 8, stage 2: 2Ψ + 14Ψ/8, AllReduce 2 x 7/8 x 2 GB
    assert (zero2["memory"], zero2["inter"], zero2["intra"]) == pytest.approx((30e9, 3.5e9, 28e9))


def test_plan_shard_size_auto_with_a_preset(capsys):
    # 70B on 64 H100s at stage 3: K = 8 needs 140 GB; K = 16 (70 GB) is the fastest that fits 80 GB
    data = run_json(
        capsys, "--params", "70B", "-n", "64", "--hardware", "h100-cluster", "--shard-size", "auto"
    )
    rows = [r for r in data["hybrid"]["rows"] if r["stage"] == 3]
    assert [r["shard_size"] for r in rows] == [1, 2, 4, 8, 16, 32, 64]
    assert {r["chosen"] for r in rows} == {16}
    assert data["hybrid"]["inter"] == {"alpha": 16e-6, "bandwidth": 400e9 / 8}  # the node's egress per GPU
    assert data["hybrid"]["intra"] == {"alpha": 16e-6, "bandwidth": 450e9}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["-n", "8", "--ranks-per-node", "4", "--shard-size", "3"],
            "K = 3 does not divide the world size N = 8",
        ),
        (
            ["-n", "12", "--ranks-per-node", "6", "--shard-size", "4"],
            "would span nodes of G = 6 ranks unevenly",
        ),
        (["-n", "8", "--ranks-per-node", "4", "--shard-size", "4", "--stage", "0"], "stage 0 shards nothing"),
        (["-n", "8", "--ranks-per-node", "4", "--shard-size", "auto"], "--shard-size auto needs both links"),
        (
            ["-n", "8", "--ranks-per-node", "4", "--shard-size", "auto", "--intra-bandwidth", "1GB/s"]
            + ["--inter-bandwidth", "1GB/s"],
            "--shard-size auto needs a memory budget per rank",
        ),
        (["-n", "8", "--shard-size", "2"], "--shard-size needs the ranks per node"),
        (["-n", "8", "--ranks-per-node", "4"], "--ranks-per-node belongs to hybrid sharding"),
        (["-n", "12", "--ranks-per-node", "8", "--shard-size", "4"], "N = 12 is not a multiple of"),
    ],
    ids=["not-dividing", "uneven", "stage-0", "auto-links", "auto-memory", "no-g", "g-alone", "n-not-g"],
)
def test_plan_shard_size_errors(capsys, args, message):
    assert main(["plan", "--params", "1B", *args]) == 2
    assert message in capsys.readouterr().err


def test_plan_shard_size_that_is_not_a_number(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--params", "1B", "--shard-size", "half"])
    assert exit_info.value.code == 2
    assert "cannot read 'half' as a shard size" in capsys.readouterr().err


def test_plan_shard_size_answers_without_torch():
    args = ("plan", "--params", "70B", "-n", "64", "--hardware", "h100-cluster", "--shard-size", "auto")
    result, modules = imported_modules(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "<- chosen" in result.stdout
    assert sorted(modules.intersection(HEAVY)) == []
