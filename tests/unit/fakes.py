"""Stand-ins shared by the unit tests."""

from __future__ import annotations


class FakeInterval:
    """A stream-timed wait whose events the test completes by hand (see [Note: timing a wait])."""

    def __init__(self, seconds: float) -> None:
        self.value = seconds  # what elapsed_time would read
        self.complete = False  # the GPU has run the end event
        self.blocked = False  # seconds() was read before the events completed: the host waited

    def done(self) -> bool:
        return self.complete

    def seconds(self) -> float:
        self.blocked = not self.complete
        return self.value
