"""Tensors lent to the backend, given back on the thread that waits, so that no process aborts at exit.

[Note: tensors lent to the backend]
A collective's torch Work holds the tensors it was launched with, and the backend's thread (gloo's
worker, NCCL's watchdog) drops that hold a moment *after* the wait returned. When the caller drops
its own Python object first (a temporary: a chunk view, a table, a scratch buffer), torch keeps the
Python object alive on behalf of the C++ tensor, and the backend's thread later destroys it, which
takes the GIL. If the interpreter has begun to finalize by then (the program's last collective, then
its exit), the thread cannot take the GIL: Python ends it with ``pthread_exit``, whose unwinding
through torch's frames aborts the process ("terminate called without an active exception",
SIGABRT) after the program had ended well. Measured: 1 exit in 60 of a two-collective test.

So every tensor the Communicator hands to the backend is a private alias (``detach()``: the same
storage, a tensor object of its own and no view: a view would hold the caller's tensor, and so
would any view the backend makes of it), and the Handle gives the aliases
back here after its wait. An alias the backend no longer holds (use count 1: only this object)
is dropped at once, on the waiting thread; one it still holds is kept until it lets go, checked
at every later give-back and, at exit, before the process group goes (a bounded wait). The
caller's tensors are never touched: dropping them later is ordinary.

Temporaries this package does not hand over itself (those of torch's object collectives, of
Lightning's own collectives, or a storage whose Python object torch keeps for its C++ owner)
can still be dropped by a backend thread a moment after their wait returned. So at exit, before
the interpreter finalizes, :func:`quiesce` also waits (bounded, sleeping so that those threads can
take the GIL) until no other thread of the process is running: a backend thread busy dropping a
finished work shows as running; idle ones wait on a condition or a socket. Read from
``/proc/self/task`` (Linux); elsewhere a short sleep stands for it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from torch import Tensor

KEEP_S = 5.0  # an alias still held this long is dropped anyway (no backend holds a finished work so long)


def lend(tensor: Tensor) -> Tensor:
    """A private alias of ``tensor`` to hand to the backend (see [Note: tensors lent to the backend])."""
    return tensor.detach()


class Lent:
    """Aliases the backend may still hold after their collective's wait returned, oldest first."""

    def __init__(self) -> None:
        self._kept: deque[tuple[float, tuple[Tensor, ...]]] = deque()  # (when given back, aliases)

    def give_back(self, aliases: tuple[Tensor, ...]) -> None:
        """After a successful wait: drop ``aliases`` now if the backend let go of them, else keep them."""
        if self._kept:
            self.settle()
        if _held(aliases):
            self._kept.append((time.monotonic(), aliases))

    def settle(self) -> None:
        """Drop the oldest aliases while the backend let go of them (or they were kept ``KEEP_S``):
        backends let go of their works in about the order they finish, so one look per call."""
        now = time.monotonic()
        while self._kept and (now - self._kept[0][0] >= KEEP_S or not _held(self._kept[0][1])):
            self._kept.popleft()

    def drain(self, timeout_s: float = 0.5) -> None:
        """Before the process group goes at exit: wait (sleeping, so that the backend's threads
        run) until the backend let go of every alias, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while any(_held(a) for _, a in self._kept) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._kept.clear()
        quiesce()


IDLE_CHECKS = 3  # looks in a row with no other thread running before the backend counts as idle


def quiesce(timeout_s: float = 0.25, poll_s: float = 0.002) -> bool:
    """Wait until no other thread of this process is running, at most ``timeout_s``; whether they
    settled (see [Note: tensors lent to the backend])."""
    deadline = time.monotonic() + timeout_s
    idle = 0
    while time.monotonic() < deadline:
        time.sleep(poll_s)  # the GIL is free meanwhile: a backend thread dropping a Python object finishes
        running = _others_running()
        if running is None:  # no /proc: the sleep was all there is
            return True
        idle = idle + 1 if not running else 0
        if idle >= IDLE_CHECKS:
            return True
    return False


def _others_running() -> bool | None:
    """Whether a thread of this process other than the caller is running (state R); None: unknown."""
    me = str(threading.get_native_id())
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        state = stat[stat.rindex(b")") + 2 :][:1]  # the field after the thread's name
        if state == b"R":
            return True
    return False


def _held(aliases: tuple[Tensor, ...]) -> bool:
    return any(a._use_count() > 1 for a in aliases)


LENT = Lent()
