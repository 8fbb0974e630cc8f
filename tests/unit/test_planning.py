"""Planning formulas: memory, traffic, C/W threshold, bucket model, batch plan, model reading.

Every expected number is either a figure the ZeRO paper / the planning docs quote, or derived by
hand in the comment next to it.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError
from torch import nn

from lightning_zero.planning import (
    GB,
    BatchPlanWarning,
    accumulate_grad_batches,
    all_reduce_time,
    assign_buckets,
    backward_times_from_flops,
    bus_bandwidth,
    comm_threshold,
    get_hardware,
    hardware_threshold,
    max_dp_ranks,
    max_params,
    memory_by_stage,
    min_global_batch_tokens,
    model_state_memory,
    optimizer_k,
    plan_batch,
    plan_batch_samples,
    recommend_bucket_cap_mb,
    register_resolvers,
    simulate_buckets,
    stages_that_fit,
    step_traffic,
    traffic_time,
    uniform_layers,
)
from lightning_zero.planning.model import load_model, summarize_model

# --------------------------------------------------------------------------- memory


def test_zero_paper_table():
    # Ψ = 7.5B, k = 12, N = 64: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
    totals = [m.total / GB for m in memory_by_stage(7.5e9, 64, k=12)]
    assert totals == pytest.approx([120.0, 31.40625, 16.640625, 1.875], rel=1e-12)
    assert [f"{t:.3g}" for t in totals] == ["120", "31.4", "16.6", "1.88"]


def test_memory_categories_of_a_replica():
    # 70B in bf16 with Adam: 140 GB weights, 140 GB grads, 840 GB Adam states, 1.12 TB in all
    m = model_state_memory(70e9, 1, 0)
    assert (m.params, m.grads, m.optimizer, m.grad_accum) == (140e9, 140e9, 840e9, 0.0)
    assert m.total == pytest.approx(1.12e12)


def test_70b_on_64_ranks():
    zero2, zero3 = (model_state_memory(70e9, 64, stage) for stage in (2, 3))
    assert zero3.total == pytest.approx(17.5e9)  # 16 x 70 / 64
    assert zero2.total == pytest.approx(140e9 + 14 * 70e9 / 64)  # 155.3 GB: over 140 GB
    assert zero2.total > 140e9
    assert stages_that_fit(70e9, 64, 80e9) == (3,)


def test_7_5b_needs_sharding_on_80gb():
    assert stages_that_fit(7.5e9, 1, 80e9) == ()
    assert stages_that_fit(7.5e9, 64, 80e9) == (1, 2, 3)
    assert stages_that_fit(7.5e9, 64, 10e9) == (3,)


def test_stages_saturate_at_4psi_and_2psi():
    zero1, zero2 = (model_state_memory(7.5e9, 10**9, stage).total for stage in (1, 2))
    assert zero1 == pytest.approx(4 * 7.5e9, rel=1e-6)
    assert zero2 == pytest.approx(2 * 7.5e9, rel=1e-6)


def test_fp32_grad_accumulation_adds_4psi_or_4psi_over_n():
    psi, n = 7.5e9, 64
    extra = [
        model_state_memory(psi, n, s, fp32_grad_accum=True).total - model_state_memory(psi, n, s).total
        for s in range(4)
    ]
    assert extra == pytest.approx([4 * psi, 4 * psi, 4 * psi / n, 4 * psi / n])
    assert model_state_memory(psi, n, 2, fp32_grad_accum=True).total == pytest.approx(17.109375e9)


def test_optimizer_k_presets():
    assert [optimizer_k(n) for n in ("adam", "AdamW", "sgd_momentum", "sgd")] == [12, 12, 8, 4]
    assert [optimizer_k(n, master_copy=False) for n in ("adam", "sgd_momentum", "sgd")] == [8, 4, 0]
    with pytest.raises(ValueError, match="'lion'"):
        optimizer_k("lion")


def test_fp32_sgd_momentum_replica():
    # fp32 training: 4-byte params and grads, momentum k = 4, no master copy: 12 bytes per parameter
    m = model_state_memory(
        1e9, 8, 0, k=optimizer_k("sgd_momentum", master_copy=False), param_bytes=4, grad_bytes=4
    )
    assert m.total == pytest.approx(12e9)


def test_max_params_pure_dp_on_tpu_v5p():
    # bf16 params + fp32 Adam moments = 10 bytes per parameter: 96 GB / 10 = 9.6B
    assert max_params(96e9, 1, 0, k=optimizer_k("adam", master_copy=False), grad_bytes=0) == pytest.approx(
        9.6e9
    )
    assert max_params(80e9, 64, 3) == pytest.approx(80e9 * 64 / 16)


def test_frozen_parameters_count_without_gradients_or_optimizer_state():
    # a 7B bf16 base frozen, 100M trainable: stage 3 shards the frozen weights too
    base = dict(k=12, param_bytes=2, grad_bytes=2, frozen=7e9, frozen_bytes=2)
    dp, z3 = model_state_memory(1e8, 8, 0, **base), model_state_memory(1e8, 8, 3, **base)
    assert dp.params == 2e8 + 14e9 and dp.grads == 2e8 and dp.optimizer == 12e8
    assert z3.params == (2e8 + 14e9) / 8 and z3.total == pytest.approx((16e8 + 14e9) / 8)
    assert model_state_memory(1e8, 8, 2, **base).params == 2e8 + 14e9  # stages 0-2 keep them whole
    with pytest.raises(ValueError, match="frozen parameters must be >= 0"):
        model_state_memory(1e8, 8, 3, frozen=-1)


def test_memory_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="stage must be one of .* got 4"):
        model_state_memory(1e9, 8, 4)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        model_state_memory(1e9, 0, 1)
    with pytest.raises(ValueError, match="psi .* got -1"):
        model_state_memory(-1, 8, 1)


# --------------------------------------------------------------------------- traffic


def test_traffic_large_n_2psi_and_3psi():
    psi = 70e9  # bf16: DP 2Ψ elements = 280 GB, ZeRO-3 3Ψ = 420 GB
    totals = [step_traffic(psi, None, s).total for s in range(4)]
    assert totals == pytest.approx([280e9, 280e9, 280e9, 420e9])
    assert totals[3] / totals[0] == pytest.approx(1.5)


def test_traffic_exact_ring_factors():
    psi, n = 1e9, 64
    dp, zero2, zero3 = (step_traffic(psi, n, s) for s in (0, 2, 3))
    assert dp.all_reduce == pytest.approx(2 * 63 / 64 * psi * 2)
    assert (zero2.reduce_scatter, zero2.all_gather) == pytest.approx((63 / 64 * psi * 2, 63 / 64 * psi * 2))
    assert (zero3.reduce_scatter, zero3.all_gather) == pytest.approx(
        (63 / 64 * psi * 2, 2 * 63 / 64 * psi * 2)
    )
    assert step_traffic(psi, 1, 3).total == 0.0


def test_traffic_agrees_with_the_ledger_wire_bytes():
    from lightning_zero.comm import wire_bytes

    psi, n = 1_000_000, 8
    assert step_traffic(psi, n, 0).all_reduce == pytest.approx(wire_bytes("all_reduce", 2 * psi, n))
    assert step_traffic(psi, n, 1).reduce_scatter == pytest.approx(wire_bytes("reduce_scatter", 2 * psi, n))


def test_stage3_units_keep_the_last_unit_gathered():
    psi, n = 1e9, 8
    four = step_traffic(psi, n, 3, groups=4)  # 2L-1 = 7 AllGathers of a quarter each, 4 ReduceScatters
    assert four.all_gather == pytest.approx(7 / 4 * 7 / 8 * psi * 2)
    assert four.collectives == 11
    one = step_traffic(psi, n, 3, groups=1)  # the whole model as one unit: gathered once, as ZeRO-1/2
    assert one.total == pytest.approx(step_traffic(psi, n, 2).total)


def test_all_reduce_time_of_8b_gradients():
    v = 16e9  # bf16 gradients of an 8B model
    assert all_reduce_time(v, 8, 450e9) == pytest.approx(2 * 7 / 8 * v / 450e9)  # about 62 ms in a node
    assert round(all_reduce_time(v, 8, 450e9) * 1e3) == 62
    assert all_reduce_time(v, None, 400e9) == pytest.approx(0.080)  # 80 ms across nodes
    assert all_reduce_time(v, 8, 450e9, alpha=1e-3) == pytest.approx(1e-3 + 2 * 7 / 8 * v / 450e9)


def test_traffic_time_adds_alpha_per_collective():
    t = step_traffic(1e9, 8, 1, groups=10)  # 20 collectives
    assert traffic_time(t, 100e9, alpha=1e-4) == pytest.approx(t.total / 100e9 + 20 * 1e-4)


# --------------------------------------------------------------------------- C/W threshold


def test_preset_thresholds():
    assert hardware_threshold("h100").tokens_per_rank == pytest.approx(2200)  # 9.9e14 / 450e9
    assert hardware_threshold("h100-cluster").tokens_per_rank == pytest.approx(2475)  # 9.9e14 / 400e9
    assert hardware_threshold("tpu-v5p").tokens_per_rank == pytest.approx(2550)
    assert hardware_threshold("tpu-v5p-3d").tokens_per_rank == pytest.approx(850)
    h800 = hardware_threshold("h800-cluster")
    assert h800.bandwidth == pytest.approx(229e9, rel=2e-3)  # NVLink 200 GB/s x 8/7
    assert round(h800.tokens_per_rank, -2) == 4300


def test_small_n_correction():
    assert comm_threshold(9.9e14, 400e9, world_size=2).tokens_per_rank == pytest.approx(2475 / 2)
    two_nodes = hardware_threshold("h100-cluster", world_size=16)  # NVLink 7/8 / 450e9 now the bottleneck
    assert two_nodes.tokens_per_rank == pytest.approx(9.9e14 * 7 / 8 / 450e9)
    assert round(two_nodes.tokens_per_rank, -2) == 1900
    one_node = hardware_threshold("h100-cluster", world_size=8)
    assert one_node.tokens_per_rank == pytest.approx(2200 * 7 / 8)


def test_bus_bandwidth_single_node_and_many_nodes():
    h100 = get_hardware("h100-cluster")
    assert bus_bandwidth(h100, world_size=4) == 450e9
    assert bus_bandwidth(h100) == pytest.approx(400e9)
    # 8 nodes of 8: max(7/8 / 450e9, 7/8 / 400e9) per byte; W = (63/64) / (7/8 / 400e9) = 450e9
    assert bus_bandwidth(h100, world_size=64) == pytest.approx(450e9)


def test_moe_factor():
    gpt_oss = hardware_threshold("h100-cluster", experts=128, top_k=4)
    assert gpt_oss.moe_factor == 32
    assert gpt_oss.tokens_per_rank == pytest.approx(79_200)  # 32 x 2475, about 79,000
    deepseek = hardware_threshold("h800-cluster", experts=256, top_k=8)
    assert deepseek.tokens_per_rank == pytest.approx(138_000, rel=0.01)  # 32 x 4300
    with pytest.raises(ValueError, match="top_k=9, experts=8"):
        comm_threshold(1e15, 1e11, experts=8, top_k=9)


def test_global_batch_needed_by_published_runs():
    h100, h800, tpu = (hardware_threshold(n) for n in ("h100-cluster", "h800-cluster", "tpu-v5p-3d"))
    llama = min_global_batch_tokens(h100, 16384)  # Llama 3 405B: about 40M tokens, it used 16M at most
    assert llama == pytest.approx(40.55e6, rel=1e-3)
    assert llama > 16e6
    assert min_global_batch_tokens(h800, 2048) == pytest.approx(8.8e6, rel=0.01)  # DeepSeek-V3, dense view
    assert min_global_batch_tokens(tpu, 8960) == pytest.approx(7.616e6)  # TPU v5p pod
    assert max_dp_ranks(9216 * 4096, tpu) == 44_410  # DeepSeek-V2's 38M-token batch: about 44,000 chips
    assert max_dp_ranks(16e6, tpu) == 18_823  # a 16M-token batch: about 18,800 chips


def test_unknown_preset():
    with pytest.raises(ValueError, match="'b200'"):
        get_hardware("b200")


# --------------------------------------------------------------------------- bucket model
#
# Hand-built case: 8 layers of 2**16 parameters (bf16: 1/8 MiB each), 0.25 s of backward each
# (2 s in all), N = 2 so 2(N-1)/N = 1, W = 1 MiB/s so a layer's gradients take 0.125 s to reduce,
# alpha = 0.5 s, first bucket cap 1/16 MiB (one layer).

LAYERS = [2**16] * 8
TIMES = [0.25] * 8
MODEL = dict(world_size=2, bandwidth=2.0**20, alpha=0.5, first_bucket_cap_mb=0.0625)


def test_assign_buckets_like_ddp():
    assert assign_buckets([1, 1, 1, 1, 1], cap_bytes=2, first_cap_bytes=1) == [(0, 1), (1, 3), (3, 5)]
    assert assign_buckets([3, 1, 1], cap_bytes=2, first_cap_bytes=2) == [(0, 1), (1, 3)]
    assert assign_buckets([1, 1, 1], cap_bytes=5, first_cap_bytes=5) == [(0, 3)]


def test_bucket_timeline_by_hand():
    s = simulate_buckets(LAYERS, TIMES, bucket_cap_mb=0.5, **MODEL)
    # buckets [L8] [L7..L4] [L3..L1]: ready 0.25, 1.25, 2.0; durations 0.625, 1.0, 0.875
    assert [b.layers for b in s.buckets] == [(0, 1), (1, 5), (5, 8)]
    assert [b.ready for b in s.buckets] == pytest.approx([0.25, 1.25, 2.0])
    assert [b.start for b in s.buckets] == pytest.approx([0.25, 1.25, 2.25])  # the third waits for the second
    assert [b.end for b in s.buckets] == pytest.approx([0.875, 2.25, 3.125])
    assert s.backward == pytest.approx(2.0)
    assert s.comm == pytest.approx(2.5)
    assert s.exposed == pytest.approx(1.125)


@pytest.mark.parametrize(
    ("cap_mb", "buckets", "exposed"),
    [
        (0.0625, 8, 3.25),  # one bucket per layer: 8 x 0.625 s back to back from 0.25 s
        (0.25, 5, 1.75),
        (0.375, 4, 1.375),
        (0.5, 3, 1.125),
        (1000.0, 2, 1.375),  # [L8] then the other 7 layers at the end: 0.5 + 0.875
    ],
)
def test_exposed_communication_by_cap(cap_mb, buckets, exposed):
    s = simulate_buckets(LAYERS, TIMES, bucket_cap_mb=cap_mb, **MODEL)
    assert len(s.buckets) == buckets
    assert s.exposed == pytest.approx(exposed)


def test_huge_cap_exposes_the_whole_last_bucket():
    s = simulate_buckets(LAYERS, TIMES, bucket_cap_mb=1e6, **MODEL)
    last = s.buckets[-1]
    assert last.nbytes == 7 * 2**17
    assert s.exposed == pytest.approx(all_reduce_time(last.nbytes, 2, 2.0**20, alpha=0.5))
    # no small first bucket: one bucket, the naive all-reduce after backward of the full model
    whole = simulate_buckets(LAYERS, TIMES, bucket_cap_mb=1e6, **{**MODEL, "first_bucket_cap_mb": None})
    assert len(whole.buckets) == 1
    assert whole.exposed == pytest.approx(0.5 + 1.0)


def test_recommend_bucket_cap_finds_the_sweet_spot():
    caps = [0.0625, 0.25, 0.375, 0.5, 1000.0]
    rec = recommend_bucket_cap_mb(LAYERS, TIMES, caps_mb=caps, **MODEL)
    assert rec.bucket_cap_mb == 0.5
    assert rec.exposed == pytest.approx(1.125)
    assert [s.bucket_cap_mb for s in rec.sweep] == caps
    tiny, huge = rec.sweep[0], rec.sweep[-1]
    assert tiny.exposed > rec.exposed and huge.exposed > rec.exposed
    assert tiny.comm == pytest.approx(8 * 0.625)  # latency-bound: 8 x alpha of the 5 s


def test_recommend_ties_go_to_fewer_buckets():
    rec = recommend_bucket_cap_mb(LAYERS, TIMES, caps_mb=[1000.0, 2000.0, 0.375], **MODEL)
    assert rec.exposed == pytest.approx(1.375)  # all three tie
    assert rec.bucket_cap_mb == 2000.0


def test_backward_times_from_flops():
    times = backward_times_from_flops([1_000_000, 10], tokens_per_rank=4096, flops=9.9e14)
    assert times == pytest.approx((4 * 4096 * 1e6 / 9.9e14, 4 * 4096 * 10 / 9.9e14))


def test_bucket_model_errors():
    with pytest.raises(ValueError, match="same length, got 8 and 2"):
        simulate_buckets(LAYERS, [1.0, 1.0], bucket_cap_mb=1, **MODEL)
    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        simulate_buckets(LAYERS, TIMES, bucket_cap_mb=0, **MODEL)
    assert uniform_layers(10, 3) == (4, 3, 3)


# --------------------------------------------------------------------------- batch


def test_batch_plan_4m_tokens_on_128_and_512_ranks():
    plan = plan_batch(4 * 2**20, seq_len=4096, max_micro_batch=2, dp=128)
    assert (plan.global_batch, plan.micro_batch, plan.grad_acc) == (1024, 2, 4)
    assert plan.global_batch_tokens == 4 * 2**20 and plan.warnings == ()
    assert plan_batch(4 * 2**20, seq_len=4096, max_micro_batch=2, dp=512).grad_acc == 1


def test_batch_plan_rounds_to_a_power_of_two():
    plan = plan_batch(4e6, seq_len=4096, max_micro_batch=2, dp=128, round_to_power_of_two=True)
    assert (plan.requested_global_batch, plan.grad_acc) == (1024, 4)  # 976.6 samples -> 1024
    with pytest.warns(BatchPlanWarning, match="977 is not a multiple of dp = 128"):
        assert plan_batch(4e6, seq_len=4096, max_micro_batch=2, dp=128).requested_global_batch == 977


def test_batch_plan_warns_when_grad_acc_below_one():
    with pytest.warns(BatchPlanWarning, match=r"= 0.5 < 1"):
        plan = plan_batch_samples(1024, max_micro_batch=2, dp=1024)
    assert plan.grad_acc_exact == 0.5
    assert (plan.global_batch, plan.micro_batch, plan.grad_acc) == (1024, 1, 1)  # smaller micro-batch
    with pytest.warns(BatchPlanWarning):
        small = plan_batch_samples(64, max_micro_batch=2, dp=128)
    assert (small.global_batch, small.micro_batch, small.grad_acc) == (128, 1, 1)
    assert "0.25 < 1" in small.warnings[0] and "not a multiple of dp = 128" in small.warnings[1]


def test_batch_plan_keeps_the_global_batch_exact():
    with pytest.warns(BatchPlanWarning, match="lowered from 4 to 1"):
        plan = plan_batch_samples(1000, max_micro_batch=4, dp=8)
    assert (plan.global_batch, plan.micro_batch, plan.grad_acc) == (1000, 1, 125)
    with pytest.warns(BatchPlanWarning, match="planned 1008 = 2 x 63 x 8"):
        plan = plan_batch_samples(1001, max_micro_batch=2, dp=8)
    assert plan.global_batch == 1008


def test_accumulate_grad_batches():
    assert accumulate_grad_batches(1024, 2, 128) == 4
    assert accumulate_grad_batches(1024, 2, [0, 1, 2, 3]) == 128  # a list of device ids counts its length
    with pytest.raises(ValueError, match="1000 is not divisible by micro_batch x world_size = 2 x 128 = 256"):
        accumulate_grad_batches(1000, 2, 128)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 'auto'"):
        accumulate_grad_batches(1024, 2, "auto")


def test_omegaconf_resolver():
    register_resolvers()
    register_resolvers()  # idempotent
    cfg = OmegaConf.create(
        {
            "data": {"global_batch": 1024, "batch_size": 2},
            "trainer": {"devices": 8, "num_nodes": 16},
            "acc": "${zero_grad_acc:${data.global_batch},${data.batch_size},${trainer.devices}}",
            "acc_nodes": "${zero_grad_acc:${data.global_batch},${data.batch_size},${trainer.devices},${trainer.num_nodes}}",
        }
    )
    assert cfg.acc == 64
    assert cfg.acc_nodes == 4
    cfg.data.global_batch = 1000
    with pytest.raises(InterpolationResolutionError, match="1000 is not divisible"):
        _ = cfg.acc


# --------------------------------------------------------------------------- reading a model


def test_summarize_model_layers_in_backward_order():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    summary = summarize_model(model)
    assert summary.psi == 40 + 16 + 18
    assert summary.layers == (("2", 18), ("1", 16), ("0", 40))


def test_summarize_model_counts_shared_once_and_skips_frozen():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(10, 3))
    model[1].weight = model[0].weight  # tied: counted once, with its first owner
    model[2].requires_grad_(False)
    summary = summarize_model(model)
    assert summary.psi == 40
    assert summary.layers == (("0", 40),)


def test_load_model_from_a_module_path(tmp_path, monkeypatch):
    (tmp_path / "planning_tiny_model.py").write_text(
        "from torch import nn\n"
        "class Tiny(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(3, 5)\n"
        "class Lazy(nn.Module):  # builds its layers in configure_model, as a LightningModule may\n"
        "    def configure_model(self):\n"
        "        self.fc = nn.Linear(2, 2)\n"
        "class NeedsArgs(nn.Module):\n"
        "    def __init__(self, width):\n"
        "        super().__init__()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("planning_tiny_model:Tiny", "planning_tiny_model.Tiny"):
        assert summarize_model(load_model(spec)).psi == 20
    with pytest.raises(ValueError, match="cannot import 'Nope'"):
        load_model("planning_tiny_model:Nope")
    assert summarize_model(load_model("planning_tiny_model:Lazy")).psi == 6
    with pytest.raises(TypeError, match="constructible with no arguments"):
        load_model("planning_tiny_model:NeedsArgs")
    with pytest.raises(TypeError, match="must build a torch.nn.Module"):
        load_model("collections:OrderedDict")
