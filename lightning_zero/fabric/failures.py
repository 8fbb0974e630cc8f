"""How a failure in a Fabric loop reaches every rank: the exception hook, the reporting launcher,
and the wait of a failing rank for its peers.

[Note: failures in a Fabric loop]
The Trainer tells the strategy that fit raised (``on_exception``); Fabric has no such hook, so the
strategy finds the exception itself, in the two places a user's error surfaces: ``sys.excepthook``
(a script launched by Fabric's default launcher, which re-runs it per rank, or by torchrun or srun;
installed once the process group exists, chained to the previous hook and restored at teardown),
and its own multiprocessing launcher (``start_method`` spawn, fork or forkserver: the user's function
runs in :meth:`ReportingLauncher._wrapping_function`, inside torch's wrapper, which would otherwise
send the error to the parent process and exit). Either way the failing rank publishes its failure
as the Trainer's does (``lightning_zero.faults.on_fit_exception``; the step is the ledger's, the
number of optimizer steps taken), so that its peers raise ``PeerFailure`` with its message, then
waits for them (:func:`wait_until_read`), and leaves without destroying the process group. It leaves
last because every launcher ends the other ranks once one exits with an error (torch's spawn at
once, Fabric's re-run launcher within 5 s, torchrun): its peers must have had their say first.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override

from lightning_zero.comm import Communicator
from lightning_zero.comm.faults import StoreUnreachable, process_exists
from lightning_zero.comm.waiting import POLL_S
from lightning_zero.runtime import ZeroRun


class Failing(Protocol):
    """What the hook and the launcher use of the Fabric strategy (``ZeroFabricStrategy``)."""

    _run: ZeroRun
    comm: Communicator


def publish(run: ZeroRun, exception: BaseException) -> bool:
    """User code raised ``exception`` on this rank: tell every rank why (once), as the Trainer's
    ``on_exception`` does; no collective runs after it. True when this rank published its own
    failure (not a peer's it noticed)."""
    if run.failed or run._comm is None or run.comm.board is None:
        return False
    run.report_failure(exception, step=run.ledger.step)
    return run.comm.published


def leave_last(run: ZeroRun) -> None:
    """After publishing its failure this rank waits for its peers; its heartbeat stops first: the
    peers need it no more, and the store may go with rank 0 meanwhile."""
    run.stop_watchdog()
    wait_until_read(run.comm)


class FailureHook:
    """``sys.excepthook`` while a strategy is active: an uncaught error in the user's script is
    published before the previous hook prints it (see [Note: failures in a Fabric loop]). One per
    process: a later strategy's hook replaces an earlier one's, keeping the hook before both."""

    def __init__(self, strategy: Failing, previous: Callable[..., Any]) -> None:
        self.strategy = strategy  # whose communicator publishes the failure
        self.previous = previous  # the hook installed before this one: prints the traceback

    @classmethod
    def install(cls, strategy: Failing) -> FailureHook:
        current = sys.excepthook
        hook = cls(strategy, current.previous if isinstance(current, FailureHook) else current)
        sys.excepthook = hook
        return hook

    def uninstall(self) -> None:
        if sys.excepthook is self:
            sys.excepthook = self.previous

    def __call__(self, kind: type[BaseException], error: BaseException, tb: Any) -> None:
        published = publish(self.strategy._run, error)  # first: the peers stop waiting at once
        self.previous(kind, error, tb)
        if published:
            leave_last(self.strategy._run)
        # the interpreter exits: status 1, the process group kept (comm/collectives.py)


class ReportingLauncher(_MultiProcessingLauncher):
    """Fabric's spawn/fork launcher, with the user's function's failure published in the worker
    before torch's wrapper hands it to the parent process (see [Note: failures in a Fabric loop])."""

    @override
    def _wrapping_function(self, process_idx: int, *args: Any) -> None:
        try:
            super()._wrapping_function(process_idx, *args)
        except (Exception, KeyboardInterrupt) as error:
            strategy: Failing = self._strategy  # type: ignore[assignment]
            if publish(strategy._run, error):  # its own: the parent may report a peer's instead
                traceback.print_exc()
                leave_last(strategy._run)
            elif strategy._run.failed:  # a peer's: rank 0 keeps the store until the others have read it
                strategy.comm.linger_for_peers()
            raise  # torch's wrapper hands it to the parent and exits: status 1, the group kept


def wait_until_read(comm: Communicator) -> None:
    """A rank that published its failure waits until its peers have read it (at most
    ``fault_wait_s`` and two wait slices). Rank 0 hosts the store and leaves only once every other
    rank has read the board or failed (``Communicator.linger_for_peers``), so another rank waits for
    rank 0 to end, by its pid on this host: a read of the store while rank 0 exits would fail. Rank
    0 (or a rank on another host than rank 0) reads the store: peers that failed too are not waited
    for, the others until they end (this host) or have noted themselves (another host)."""
    if comm.board is None:
        return
    deadline = time.monotonic() + comm.fault_wait_s + 2 * POLL_S
    try:
        while time.monotonic() < deadline:
            store_host = process_exists(comm.ranks[0]) if comm.rank != 0 else None
            if store_host is False or (store_host is None and _all_read(comm)):
                return
            time.sleep(0.1)
    except StoreUnreachable:  # the store's host (rank 0) is gone: nobody is left to read it
        return


def _all_read(comm: Communicator) -> bool:
    """Every peer that did not fail too has ended (this host) or noted itself (another host)."""
    failed, noted = {f.rank for f in comm.board.faults()}, comm.board.noted()
    for peer in comm.ranks:
        if peer.rank == comm.rank or peer.rank in failed:
            continue
        running = process_exists(peer)
        if running is True or (running is None and peer.rank not in noted):
            return False
    return True
