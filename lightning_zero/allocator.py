"""glibc's malloc tuned for training on CPU, so that freed tensors go back to the system.

[Note: why the CPU allocator is tuned]
torch allocates CPU tensors with glibc's ``malloc``. By default glibc serves a request of at least
``M_MMAP_THRESHOLD`` (128 KiB at start) with its own ``mmap``, returned to the system on ``free``,
and anything smaller from its heap arenas. The threshold is dynamic: each time a mapped block is
freed, the threshold rises to that block's size (up to 32 MiB on 64-bit), and the trim threshold
to twice that. After the first few freed gradient buckets, gathered units or activations, blocks
of that size come from the heap, and a freed heap block is returned only when it lies at the top
of the heap and the free space there exceeds the trim threshold. A sharded stage frees a unit's
gathered parameters or a bucket's full gradient as soon as it is used, but the process keeps the
pages, so its resident memory (what a user sees: RSS, ``top``, the job's memory limit) stays at
the unsharded high-water mark. :func:`tune_cpu_allocator` fixes the threshold through
``mallopt`` (which also turns the dynamic adjustment off) and resets the trim threshold, so that
the user sets nothing. The threshold is 4 MiB, not the 64 KiB of ``MALLOC_MMAP_THRESHOLD_=65536``:
a mapped block costs a system call and fresh page faults each time it is made, and with 64 KiB
every activation of a step is one (+15-20% CPU time per step on the 17.9M GPT of
docs/benchmarks.md, against none measurable at 4 MiB there). Buckets, gathered units, gradient
buffers and large parameters are mapped and returned; activations and tensors below 4 MiB stay
in the arenas, where the next step reuses them. Activations of 4 MiB and more are mapped too, and
fault their pages in again every step: on the 0.8M-parameter gpt_small of docs/benchmarks.md,
whose attention scores and MLP activations are exactly 4 MiB, that is 7-10% of a step at every
stage (zero0 within the noise of DDP with ``cpu_allocator="default"``, 10-14% behind it tuned).

Stages 0 and 1 keep their buckets for the whole run and free nothing a user would see, so they
train on the other setting, the one glibc's dynamic adjustment climbs towards on its own: a 32 MiB mmap
threshold (its ceiling on 64-bit) and a 64 MiB trim threshold (twice that, as it sets them).
Tuned to 4 MiB they paid for activations mapped anew every step (zero0 against DDP on gpt_small:
0.906x). Left on glibc's defaults they paid too, less visibly: the threshold that the first freed
blocks set leaves the heap's top above the trim threshold at the end of some steps, glibc gives
the pages back, and the next step faults them in again (zero0 on gpt_small: 4,000-6,000 page
faults and 10-14 ms of system time per step of 190 ms, DDP 750 and 4 ms; with this setting 3-4
faults and 2-4 ms, at a few MiB more peak RSS). With the threshold fixed at its ceiling from the
start, activations and temporaries up to 32 MiB come from the heap and stay there between steps,
which is all a stage that frees nothing needs. A threshold derived from the blocks a stage frees
(its units' size instead of 4 MiB) was tried for stage 3: its whole-run peak on the memory-order
model rose above stage 2's (755 against 721 MiB), since blocks below a unit (gradients as
autograd makes them, optimizer temporaries) then stay in the heap; 4 MiB stays.

A stage that frees memory but no block as large as the 4 MiB threshold (every unit gathered, unit
gradient buffer and bucket smaller: a small model) gains nothing from it, and still maps its
activations of 4 MiB and more anew every step. Once the model is wrapped, such a fit takes the
setting of the stages that free nothing (``ZeroRun._settle_allocator``, by the engine's
``largest_freed_block``): zero3 on gpt_small, whose units are 0.8 MiB, from 2,750 page faults per
rank and step to 100, and 1.127x zero0's step to 1.092x (6 interleaved repeats).

Setting up is another matter at every stage on several ranks: the model is copied into flat
buckets or shards of up to the bucket cap, with the module's own tensors still alive, and the
sharded stages free what they copied. Under glibc's ceiling those blocks come from the heap, and
where they land among the model's tensors decides what stays resident after these are freed: the
memory-order test's stage 1, on the ceiling from the start, peaked 767-938 MiB above its start
over five fits in fresh processes (its model state: 730), and at 778-912 in the test's own
sequence, so that the test failed one run in three. So every stage sets up under the 4 MiB
threshold (``ZeroRun.prepare_process``) and takes the setting for training once the model is
wrapped (``ZeroRun._settle_allocator``): stage 1 then peaks at 753-768 MiB over four fits, and a
step of stages 0-1 runs on the ceiling as before. One rank keeps the model as it is and takes the
ceiling from the start.

The trim threshold is 64 MiB at every stage. At 128 KiB (glibc's start value) stages 2-3 gave
the heap's top back whenever more than that lay free there, which blocks below 4 MiB (activations,
small gathered units, per-parameter gradients) do at the end of every backward, and the next step
faulted the same pages in again: zero3 on gpt_small, 6,000 page faults and 17 ms of system time
per rank and step; at 64 MiB 2,750 and 11 ms, the rest being its 4 MiB activations mapped anew.
What scales with the model is mapped (blocks of 4 MiB and more) and leaves on free either way;
what the heap may keep is at most 64 MiB of small blocks the next step allocates again. The
memory-order test's stage-3 peak is unchanged by it (537 against 541 MiB above start).

Each setting is applied once per process (a later fit at a stage of the other kind applies its
own), on Linux with glibc only (musl, macOS and Windows have other
allocators: nothing is done there), only when the strategy trains on CPU (the CUDA caching
allocator is tuned with ``PYTORCH_CUDA_ALLOC_CONF``, see docs/benchmarks.md), and never over a
setting the user made: a parameter named in the environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, or ``GLIBC_TUNABLES``' ``glibc.malloc.*``) is left as the user set it.
``ZeroConfig(cpu_allocator="default")`` leaves glibc's defaults alone. Processes forked later
inherit the setting with the allocator's state.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from typing import NamedTuple

from lightning_zero.config import CPU_ALLOCATOR_MODES  # "tuned" | "default"

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 4 * 1024 * 1024  # bytes: blocks at least this large are mmapped and unmapped on free
STEADY_MMAP_THRESHOLD = 32 * 1024 * 1024  # stages 0-1: the ceiling of glibc's dynamic threshold (64-bit)
TRIM_THRESHOLD = 2 * STEADY_MMAP_THRESHOLD  # bytes of free heap top kept before it is returned
# (what glibc's adjustment sets beside its ceiling), at every stage


class Setting(NamedTuple):
    """One ``mallopt`` parameter the tuning may set."""

    name: str  # glibc's macro name, as in <malloc.h>
    param: int  # the mallopt parameter number
    value: int  # bytes
    env: str  # the environment variable through which a user sets it instead
    tunable: str  # its GLIBC_TUNABLES name


def _settings(mmap_threshold: int, trim_threshold: int) -> tuple[Setting, Setting]:
    return (
        Setting(
            "M_MMAP_THRESHOLD",
            M_MMAP_THRESHOLD,
            mmap_threshold,
            "MALLOC_MMAP_THRESHOLD_",
            "glibc.malloc.mmap_threshold",
        ),
        Setting(
            "M_TRIM_THRESHOLD",
            M_TRIM_THRESHOLD,
            trim_threshold,
            "MALLOC_TRIM_THRESHOLD_",
            "glibc.malloc.trim_threshold",
        ),
    )


SETTINGS = _settings(MMAP_THRESHOLD, TRIM_THRESHOLD)  # stages that free memory while they train (2-3)
STEADY_SETTINGS = _settings(STEADY_MMAP_THRESHOLD, TRIM_THRESHOLD)  # stages that free nothing (0-1)


class AllocatorState(NamedTuple):
    """What :func:`tune_cpu_allocator` did in this process."""

    applied: dict[str, int]  # mallopt parameter name -> bytes set
    skipped: dict[str, str]  # mallopt parameter name -> why it was left alone
    reason: str  # why nothing was applied; "" when something was
    frees: bool = True  # which setting: for a stage that frees memory while it trains (2-3), or not


_state: AllocatorState | None = None  # this process's tuning, once done (a forked child inherits it)


def tune_cpu_allocator(
    mode: str = "tuned", *, device_type: str = "cpu", frees: bool = True
) -> AllocatorState:
    """Apply the CPU allocator setting of [Note: why the CPU allocator is tuned], once per process
    and kind of stage.

    Args:
        mode: ``"tuned"`` applies it; ``"default"`` leaves glibc's defaults.
        device_type: the device the strategy trains on; anything but ``"cpu"`` changes nothing.
        frees: whether the stage frees memory while it trains (stages 2-3: freed blocks of 4 MiB
            and more go back to the system) or not (stages 0-1: glibc's ceiling, fixed).

    Returns:
        What was set, what was left to the user's environment, or why nothing was done. A second
        call of the same kind in the same process returns the first call's state and changes
        nothing; a call of the other kind applies its own setting.
    """
    global _state
    if mode not in CPU_ALLOCATOR_MODES:
        raise ValueError(f"cpu_allocator must be one of {list(CPU_ALLOCATOR_MODES)}, got {mode!r}")
    if _state is not None and _state.frees == frees:
        return _state
    reason = _why_not(mode, device_type)
    if reason:
        return AllocatorState({}, {}, reason, frees)  # nothing done: a later call on CPU may still tune
    _state = _apply(ctypes.CDLL(None), os.environ, SETTINGS if frees else STEADY_SETTINGS)._replace(
        frees=frees
    )
    return _state


def _why_not(mode: str, device_type: str) -> str:
    if mode == "default":
        return "cpu_allocator='default'"
    if device_type != "cpu":
        return f"training on {device_type}, not on the CPU"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if glibc_version() is None:
        return "the C library is not glibc"
    return ""


def _apply(
    libc: ctypes.CDLL, environ: Mapping[str, str], settings: tuple[Setting, ...] = SETTINGS
) -> AllocatorState:
    """Call ``mallopt`` for every one of ``settings`` the user did not make in ``environ``."""
    applied: dict[str, int] = {}
    skipped: dict[str, str] = {}
    tunables = environ.get("GLIBC_TUNABLES", "")
    for setting in settings:
        if setting.env in environ or f"{setting.tunable}=" in tunables:
            skipped[setting.name] = f"set by the environment ({setting.env} or GLIBC_TUNABLES)"
        elif libc.mallopt(ctypes.c_int(setting.param), ctypes.c_int(setting.value)) == 1:
            applied[setting.name] = setting.value
        else:
            skipped[setting.name] = "mallopt refused it"
    return AllocatorState(applied, skipped, "" if applied else "every setting was left alone")


def glibc_version() -> str | None:
    """glibc's version (``"2.36"``) when this process runs on glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return version().decode()


def cpu_allocator_state() -> AllocatorState | None:
    """The tuning done in this process (or inherited from the process it was forked from), if any."""
    return _state
