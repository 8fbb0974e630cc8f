"""A collective that completes just as a waiting slice runs out is complete, not a failure."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_zero.comm import Communicator
from lightning_zero.comm.waiting import SLICE_TIMEOUT


class RacingWork:
    """A work whose first timed wait runs out while the work completes (seen under load)."""

    def __init__(self, error: str | None = None) -> None:
        self.waits = 0
        self.error = error  # what an untimed wait raises once completed (None: it succeeded)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        if timeout is not None and self.waits == 1:
            raise RuntimeError(f"[../third_party/gloo/gloo/transport/unbound_buffer.cc:81] {SLICE_TIMEOUT}")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return True


def test_a_work_completed_as_the_slice_ran_out_is_complete():
    work = RacingWork()
    Communicator()._wait_in_slices(work, None)  # before: raised the slice's timeout as a failure
    assert work.waits == 2


def test_a_work_that_failed_as_the_slice_ran_out_raises_its_own_error():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        Communicator()._wait_in_slices(RacingWork(error="Connection closed by peer"), None)
