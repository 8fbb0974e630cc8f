"""The timing of exposed communication on a GPU (see [Note: timing a wait]): a pair of CUDA events
around a stream's wait measures how long the stream stood still, without the host waiting for it.
The same timing over NCCL, through the Trainer and the monitor, is in test_trainer.py and
test_engines.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_zero.comm import CommLedger
from lightning_zero.comm.timing import StreamInterval
from tests.gpu.cuda import requires_gpus

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 100_000_000  # GPU clock cycles the side stream spins: 50-100 ms at 1-2 GHz


@requires_gpus(1)
def test_a_stalled_stream_is_timed_on_the_gpu_not_the_host():
    device = torch.device("cuda", 0)
    ledger = CommLedger()
    side = torch.cuda.Stream(device)  # stands for the collective's stream
    torch.cuda.synchronize(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        finished = torch.cuda.Event()
        finished.record(side)
    start = time.perf_counter()
    interval = StreamInterval(device)
    torch.cuda.current_stream(device).wait_event(finished)  # what NCCL's Work.wait() does
    ledger.add_stream_wait("all_reduce", interval.close())
    host_s = time.perf_counter() - start
    assert not interval.done() and len(ledger.pending) == 1  # the GPU is still spinning
    stalled = ledger.wait_totals()["all_reduce"]  # a read: waits for the events
    assert host_s < 0.01 < stalled, (host_s, stalled)
    assert not ledger.pending and ledger.timing == "cuda-events"
