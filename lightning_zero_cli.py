"""Entry point of the ``lightning-zero`` console command: the package without torch until needed.

[Note: a command that answers at once]
Importing ``lightning_zero`` registers the strategy names in Lightning's StrategyRegistry, which
imports torch and Lightning: several seconds of CPU, tens of seconds on a loaded machine. The
planner and ``--help`` need neither. Python runs a package's ``__init__`` before any of its
submodules, so the command's entry point has to live outside the package: this module marks the
import as the command's (``DEFER_REGISTRATION``) while it imports ``lightning_zero.cli``, and
``lightning_zero/__init__.py`` then leaves the registration out; its public names still load on
first use. Only what needs torch imports it: ``plan --model`` (the model) and ``consolidate``.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFER_REGISTRATION = False  # True only while main() imports the package (read by lightning_zero/__init__.py)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lightning-zero`` with ``argv`` (default: the command line); returns the exit status."""
    global DEFER_REGISTRATION
    DEFER_REGISTRATION = True
    try:
        from lightning_zero.cli import main as run
    finally:
        DEFER_REGISTRATION = False
    return run(argv)
