"""What the strategy does when fit ends in an exception: say why to every rank, and leave without a
collective.

Lightning calls ``strategy.on_exception`` on a rank whose fit raised, then tears the strategy
down. :func:`on_fit_exception` decides what the exception is (see [Note: failures travel through
the store] in ``comm/faults.py``):

- this rank's own failure (a bad batch, an unused parameter, out of memory, a KeyboardInterrupt):
  published to the store, so that every peer raises with this message;
- a peer's failure this rank noticed in one of this package's collectives (:class:`PeerFailure`),
  or a desync it found with the others (:class:`CollectivesStopped`): nothing to add but its
  note on the board, the word that lets rank 0, which hosts the store, leave without lingering
  for it (``Communicator.linger_for_peers``);
- a backend error in a collective that is not this package's (Lightning's ``self.log(...,
  sync_dist=True)``, a metric's sync): explained from the board, the failing rank's message put in
  front of the backend's words;
- an agreed stop (a signal, see ``signals.py``): not a failure, every rank is at the same point.

After a failure the strategy tears the stage down with ``failed=True`` (engines.py): hooks removed,
nothing gathered (a collective that the peers, gone or elsewhere, would never join).
"""

from __future__ import annotations

import logging
import time

from lightning_zero.comm import Communicator
from lightning_zero.comm.faults import (
    CollectivesStopped,
    Fault,
    PeerFailure,
    StoreUnreachable,
    describe_error,
    looks_like_comm_error,
)

log = logging.getLogger(__name__)


class AgreedStop(SystemExit):
    """Every rank leaves fit at the same point, on purpose (a signal, see ``signals.py``)."""


def on_fit_exception(comm: Communicator, exception: BaseException, *, step: int | None) -> bool:
    """Handle ``exception`` ending fit on this rank; True when it is a failure (not an agreed stop)."""
    if isinstance(exception, AgreedStop):
        return False
    if isinstance(exception, (PeerFailure, CollectivesStopped)):
        comm.mark_failed(exception)
        where = comm.tracker.current()
        if comm.board is not None:
            try:
                comm.board.note(comm.ranks[comm.rank].rank, where.describe() if where else "no collective")
            except StoreUnreachable:
                pass
        return True
    if comm.failure is None and looks_like_comm_error(exception):
        explained = comm.explain(exception, comm.tracker.current())
        if explained is not None:
            exception.args = (f"{explained}\n(the collective that noticed: {describe_error(exception)})",)
            return True
    publish(comm, exception, step=step)
    return True


def publish(comm: Communicator, exception: BaseException, *, step: int | None) -> None:
    """Write this rank's failure into the store (see [Note: failures travel through the store])."""
    me = comm.ranks[comm.rank]
    where = comm.tracker.current()
    fault = Fault(
        me.rank,
        me.host,
        me.pid,
        step,
        describe_error(exception),
        where.describe() if where is not None else "no collective yet",
        time.time(),
    )
    if comm.board is not None:
        try:
            comm.board.publish(fault)
            comm.published = True
        except StoreUnreachable as err:
            log.warning("could not tell the other ranks why rank %d fails: %s", comm.rank, err)
    comm.mark_failed(exception)
