"""How long a rank lost waiting for a collective: the host's clock, or CUDA events on the stream.

[Note: timing a wait]
With CPU tensors (gloo) ``Work.wait()`` blocks the host until the collective is done, so the
wall-clock time around it is the time the rank could not compute. With CUDA tensors it does not
(NCCL's ``wait()`` returns at once): it makes the current CUDA stream wait for the collective, and
the kernels queued after it start only once the collective ends. The host's clock reads about
zero there; the time lost is on the stream. So for a CUDA collective a CUDA event is recorded on
the current stream just before ``wait()`` and another just after it: the GPU time between the two
is the time the compute stream stood still behind the collective.

Reading that time needs the second event to have run on the GPU, which the host must not wait
for on the training path. The ledger therefore keeps each pair pending: a new pair first resolves
the pairs already complete (``Event.query()``, which does not block), and whoever reads the waits
(the monitor, at the end of a step) first waits for the rest (``CommLedger.settle``).
"""

from __future__ import annotations

import torch

WALL_CLOCK = "wall-clock"  # perf_counter around a host-blocking wait (CPU tensors)
CUDA_EVENTS = "cuda-events"  # two CUDA events on the compute stream around the wait (CUDA tensors)


def timing_for(device: torch.device | None) -> str:
    """How a wait on tensors of ``device`` is timed (see [Note: timing a wait])."""
    return CUDA_EVENTS if device is not None and device.type == "cuda" else WALL_CLOCK


class StreamInterval:
    """Two CUDA events on ``device``'s current stream around a wait: the time that stream stood still.

    ``start`` is recorded when the interval is made, ``end`` by :meth:`close`, after ``wait()``.
    """

    __slots__ = ("start", "end", "_stream")

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.current_stream(device)  # the compute stream that waits
        self.start = torch.cuda.Event(enable_timing=True)  # before wait(): compute queued so far
        self.end = torch.cuda.Event(enable_timing=True)  # after wait(): runs once the collective ended
        self.start.record(self._stream)

    def close(self) -> StreamInterval:
        self.end.record(self._stream)
        return self

    def done(self) -> bool:
        """Whether both events have run on the GPU (does not block)."""
        return self.end.query()

    def seconds(self) -> float:
        """GPU seconds from ``start`` to ``end``; blocks the host until ``end`` has run."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3
