"""BucketPlan without a process group: order, dtype split, caps, first bucket, rebuild, padding."""

import pytest
import torch

from lightning_zero.grad_sync.buckets import ParamInfo, plan_buckets

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16


def infos(*sizes, dtype=F32):
    return [ParamInfo(i, n, dtype, CPU) for i, n in enumerate(sizes)]


def test_reverse_registration_order_and_caps():
    # 4 bytes per element: caps of 40 bytes = 10 elements, first bucket 8 bytes = 2 elements
    specs = plan_buckets(infos(6, 6, 6, 2, 3), cap_bytes=40, first_cap_bytes=8)
    assert [s.params for s in specs] == [(4,), (3, 2, 1), (0,)]
    assert [s.numel for s in specs] == [3, 14, 6]
    assert specs[1].offsets == (0, 2, 8)


def test_first_bucket_is_smaller():
    specs = plan_buckets(infos(*[5] * 6), cap_bytes=60, first_cap_bytes=20)
    assert [len(s.params) for s in specs] == [1, 3, 2]


def test_bucket_closes_after_the_parameter_that_reaches_the_cap():
    # as torch DDP: a large parameter joins the open bucket and closes it; the next one starts fresh
    specs = plan_buckets(infos(1, 100, 1, 1), cap_bytes=16, first_cap_bytes=16)
    assert [s.params for s in specs] == [(3, 2, 1), (0,)]


def test_split_by_dtype():
    params = [ParamInfo(0, 4, F32, CPU), ParamInfo(1, 4, BF16, CPU), ParamInfo(2, 4, F32, CPU)]
    specs = plan_buckets(params, cap_bytes=1000, first_cap_bytes=1000)
    assert {(s.dtype, s.params) for s in specs} == {(F32, (2, 0)), (BF16, (1,))}
    # launch order follows the first parameter of each bucket in the walk
    assert specs[0].params == (2, 0)


def test_rebuild_in_observed_order_and_missing_parameters_last():
    specs = plan_buckets(infos(2, 2, 2, 2), cap_bytes=16, first_cap_bytes=8, order=[1, 0])
    assert [s.params for s in specs] == [(1,), (0, 3), (2,)]


def test_padding_to_world_size():
    specs = plan_buckets(infos(3, 4), cap_bytes=1000, first_cap_bytes=1000, pad_to=4)
    assert specs[0].numel == 7 and specs[0].padded_numel == 8


def test_bad_caps_and_order():
    with pytest.raises(ValueError, match="bucket caps must be > 0"):
        plan_buckets(infos(1), cap_bytes=0, first_cap_bytes=4)
    with pytest.raises(ValueError, match="index 7"):
        plan_buckets(infos(1), cap_bytes=4, first_cap_bytes=4, order=[7])
