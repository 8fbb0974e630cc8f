"""Decisions about a checkpoint that every rank takes together.

[Note: agreed checkpoint decisions]
Reading or writing a checkpoint can fail on some ranks only: a file missing on one node, an I/O
error, a damaged page one rank reads and the others do not, a full disk seen by the rank that
writes. A rank that fails and branches on its own (falls back to an older checkpoint, stops
writing, raises) enters other collectives than its peers, which then wait, or pair collectives
that do not belong together. So every step of a read or a save that can fail locally and is
followed by a collective ends in one small exchange of each rank's outcome (``ok``, or the error:
its type and message), and every rank then takes the same branch: all go on, or all raise, the
error naming the ranks that failed and why. A refused object (:class:`UnsafeCheckpointError`) on
any rank is a refusal on every rank: it is never fallen back from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from lightning_zero.checkpoint.format import CheckpointError, UnsafeCheckpointError
from lightning_zero.comm import Communicator

T = TypeVar("T")


class Outcome(NamedTuple):
    """One rank's result of a step, as the other ranks learn it."""

    rank: int  # the rank it happened on
    error: str | None  # "TypeName: message"; None: the step succeeded
    refused: bool  # an UnsafeCheckpointError: a refusal, not damage


def attempt(step: Callable[[], T], *, where: Any) -> tuple[T | None, Exception | None]:
    """``step()``'s value, or the exception it raised. Errors that are not already about the
    checkpoint (a ``BadZipFile``, an ``OSError``) become a :class:`CheckpointError` naming ``where``;
    a missing file stays a ``FileNotFoundError``."""
    try:
        return step(), None
    except (CheckpointError, FileNotFoundError) as err:
        return None, err
    except Exception as err:
        wrapped = CheckpointError(f"cannot read {where}: {type(err).__name__}: {err}")
        wrapped.__cause__ = err
        return None, wrapped


def agreed(comm: Communicator | None, error: BaseException | None, *, what: str, name: str) -> None:
    """Every rank's ``error`` (None: it succeeded) exchanged (one control collective), then the same
    branch on every rank: return when all succeeded, otherwise raise on all (see [Note: agreed
    checkpoint decisions]). When every rank failed alike, each raises its own error (its type kept);
    otherwise every rank raises one error naming the ranks that failed: an
    :class:`UnsafeCheckpointError` if any rank refused an object, else a :class:`CheckpointError`."""
    rank = comm.rank if comm is not None else 0
    mine = Outcome(rank, _describe(error), isinstance(error, UnsafeCheckpointError))
    outcomes = comm.all_gather_object(mine, name=name) if comm is not None and comm.active else [mine]
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        return
    if error is not None and all(o.error == mine.error for o in outcomes):
        raise error
    raise disagreement(outcomes, what=what) from error


def disagreement(outcomes: list[Outcome], *, what: str) -> CheckpointError:
    """The error every rank raises when ``what`` failed on some ranks (not all alike)."""
    failed = [o for o in outcomes if o.error is not None]
    fine = [o.rank for o in outcomes if o.error is None]
    parts = [f"rank {o.rank}: {o.error}" for o in failed[:4]]
    more = f"; and {len(failed) - 4} more rank(s)" if len(failed) > 4 else ""
    ok = f"; rank(s) {_ranks(fine)} succeeded" if fine else ""
    message = (
        f"{what} failed on rank(s) {_ranks(o.rank for o in failed)} ({'; '.join(parts)}{more}){ok}. Every "
        "rank stops here together"
    )
    cls = UnsafeCheckpointError if any(o.refused for o in failed) else CheckpointError
    return cls(message)


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _ranks(ranks: Any) -> str:
    return ", ".join(str(r) for r in ranks)


Share = Callable[[int, int], None]  # (rank, world size) -> None; raises what that rank's share finds


def _shared_verdict(comm: Communicator | None, share: Share | None, path: Any) -> None:
    """``share(rank, world_size)`` on every rank (each checks its part; None: nothing to check), then
    one verdict for all (a control collective): the first damage found is raised on every rank."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    _, error = attempt(lambda: share(rank, world) if share is not None else None, where=path)
    mine = _describe(error)
    errors = comm.all_gather_object(mine, name="checkpoint/verify") if comm is not None else [mine]
    found = next(((r, e) for r, e in enumerate(errors) if e), None)
    if found is None:
        return
    if error is not None:
        raise error
    raise CheckpointError(f"{found[1].split(': ', 1)[1]} (found by rank {found[0]})")
