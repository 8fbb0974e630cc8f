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

[Note: a backward that raised]
When a backward raises (an error inside an autograd function, a hook, a nested backward), autograd
drops the callbacks queued on its graph task without calling them: the wrap-up never runs, and the
stage is left in the middle of a backward (parameters marked ready, collectives in flight). Each
queued or deferred call is therefore an object that notices being dropped unrun; the owner then
learns, through :meth:`EndOfBackward.raised`, that the backward in which :meth:`~EndOfBackward.note`
ran is over without its wrap-up, and the next :meth:`~EndOfBackward.note` queues a fresh one. The
owner also asks with ``idle=True`` where it knows that no backward is running (a forward begins, a
backward is about to begin): a wrap-up still queued then belongs to a backward that raised. The
optional ``on_raise`` runs where the drop is noticed (inside autograd's unwinding, possibly on an
autograd thread), so it may only take note: no collective, no wait.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _queue(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class _Call:
    """One queued call of the wrap-up, or (``deferred``) the node hook that queues it again on the
    outer task; dropped without being called, it tells its owner (see [Note: a backward that raised])."""

    __slots__ = ("deferred", "owner", "ran", "token")

    def __init__(self, owner: EndOfBackward, token: int, *, deferred: bool = False) -> None:
        self.owner = owner  # the EndOfBackward that queued it
        self.token = token  # the backward it belongs to
        self.deferred = deferred  # a node hook of the outer task, not a queued callback
        self.ran = False  # called (dropping it afterwards is the normal end)

    def __call__(self, *_: object) -> None:
        self.ran = True
        if not self.deferred:
            self.owner._run(self.token)
        elif self.owner.queued and self.token == self.owner._token:
            _queue(_Call(self.owner, self.token))

    def __del__(self) -> None:
        if not self.ran:
            self.owner._dropped(self.token)


class EndOfBackward:
    """Calls ``callback`` once at the end of the outermost backward pass in which :meth:`note` ran.

    Args:
        callback: the stage's wrap-up.
        on_raise: called when a backward in which :meth:`note` ran raised instead of ending; it may
            only take note (see [Note: a backward that raised]).
    """

    def __init__(self, callback: Callable[[], None], on_raise: Callable[[], None] | None = None) -> None:
        self.callback = callback  # the stage's wrap-up
        self.on_raise = on_raise  # told, inside autograd's unwinding, that a backward raised
        self.queued = False  # queued (or deferred) for the running backward
        self._token = 0  # tells a deferral of this backward from a stale one
        self._raised = False  # a backward raised and its owner has not asked yet

    def note(self) -> None:
        """A hook of the running backward fired: make sure the wrap-up is queued."""
        if not self.queued:
            self.queued = True
            self._token += 1
            _queue(_Call(self, self._token))

    def raised(self, *, idle: bool = False) -> bool:
        """Whether the last backward in which :meth:`note` ran raised instead of ending; asking
        forgets it. ``idle``: the caller knows no backward is running now, so a wrap-up still queued
        belongs to a backward that raised."""
        if idle and self.queued:
            self._forget()
        raised, self._raised = self._raised, False
        return raised

    def _run(self, token: int) -> None:
        if not self.queued or token != self._token:
            return
        node = torch._C._current_autograd_node()
        if node is not None:  # a nested (reentrant) backward ended; its outer task goes on
            node.register_hook(_Call(self, token, deferred=True))
            return
        self.queued = False
        self.callback()

    def _dropped(self, token: int) -> None:
        """Autograd dropped a call of backward ``token`` unrun: that backward raised."""
        if self.queued and token == self._token:
            self._forget()
            if self.on_raise is not None:
                self.on_raise()

    def _forget(self) -> None:
        self.queued = False
        self._token += 1  # its remaining calls, if any, are stale
        self._raised = True
