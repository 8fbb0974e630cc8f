"""EndOfBackward: run the stage's wrap-up once, when the outermost backward pass ends.

[Note: end of backward]
The gradient hooks cannot tell which backward pass is the last one of a step, so each stage queues
its wrap-up (wait for the collectives, hand the reduced gradients on, free what is gathered) as an
autograd callback, which runs when the graph task that queued it finishes. Reentrant activation
checkpointing (``use_reentrant=True``) runs a nested backward inside the outer one; a callback
queued from a hook inside it would run when the *nested* task ends, in the middle of the real
backward. So the callback first asks whether an outer task is still running (an autograd node is
being evaluated on this thread): if so, it defers itself to that node's completion, where it is
queued again, now on the outer task. Only the outermost task runs the wrap-up, once per backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _queue(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class EndOfBackward:
    """Calls ``callback`` once at the end of the outermost backward pass in which :meth:`note` ran."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback  # the stage's wrap-up
        self.queued = False  # queued (or deferred) for the running backward
        self._token = 0  # tells a deferral of this backward from a stale one

    def note(self) -> None:
        """A hook of the running backward fired: make sure the wrap-up is queued."""
        if not self.queued:
            self.queued = True
            self._token += 1
            _queue(self._run)

    def _run(self) -> None:
        if not self.queued:
            return
        node = torch._C._current_autograd_node()
        if node is not None:  # a nested (reentrant) backward ended; its outer task goes on
            token = self._token

            def requeue(*_: object) -> None:
                if self.queued and token == self._token:
                    _queue(self._run)

            node.register_hook(requeue)
            return
        self.queued = False
        self.callback()
