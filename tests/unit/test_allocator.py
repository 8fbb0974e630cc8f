"""The CPU allocator setting: what it sets, when it does nothing, and that it returns freed memory."""

import subprocess
import sys
import textwrap

import pytest

from lightning_zero import ZeroConfig
from lightning_zero.allocator import (
    MMAP_THRESHOLD,
    SETTINGS,
    STEADY_SETTINGS,
    TRIM_THRESHOLD,
    _apply,
    _why_not,
    glibc_version,
)

ON_GLIBC = sys.platform.startswith("linux") and glibc_version() is not None


class FakeLibc:
    """Records mallopt calls; ``refuse`` names parameters it answers 0 to."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def mallopt(self, param, value) -> int:
        self.calls.append((param.value, value.value))
        return 0 if param.value in self.refuse else 1


def test_sets_a_fixed_mmap_and_trim_threshold():
    libc = FakeLibc()
    state = _apply(libc, {})
    assert libc.calls == [
        (-3, 4 * 2**20),
        (-1, 64 * 2**20),
    ]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD of <malloc.h>
    assert state.applied == {"M_MMAP_THRESHOLD": MMAP_THRESHOLD, "M_TRIM_THRESHOLD": TRIM_THRESHOLD}
    assert state.skipped == {} and state.reason == ""


def test_stages_that_free_nothing_fix_glibcs_ceiling():
    """Stages 0-1: the 32 MiB mmap threshold glibc's dynamic adjustment climbs to, and twice that
    as the trim threshold, from the start."""
    libc = FakeLibc()
    state = _apply(libc, {}, STEADY_SETTINGS)
    assert libc.calls == [(-3, 32 * 2**20), (-1, 64 * 2**20)]
    assert state.applied == {"M_MMAP_THRESHOLD": 32 * 2**20, "M_TRIM_THRESHOLD": 64 * 2**20}


@pytest.mark.parametrize(
    "environ",
    [{"MALLOC_MMAP_THRESHOLD_": "1048576"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}],
)
def test_a_setting_the_user_made_is_kept(environ):
    libc = FakeLibc()
    state = _apply(libc, environ)
    assert libc.calls == [(-1, TRIM_THRESHOLD)]
    assert "M_MMAP_THRESHOLD" in state.skipped and "environment" in state.skipped["M_MMAP_THRESHOLD"]


def test_a_refused_setting_is_reported():
    state = _apply(FakeLibc(refuse=(-3, -1)), {})
    assert state.applied == {} and set(state.skipped) == {s.name for s in SETTINGS}
    assert state.reason == "every setting was left alone"


def test_does_nothing_off_the_cpu_or_when_turned_off(monkeypatch):
    assert _why_not("default", "cpu") == "cpu_allocator='default'"
    assert "cuda" in _why_not("tuned", "cuda")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert "not Linux" in _why_not("tuned", "cpu")


def test_config_field():
    assert ZeroConfig().cpu_allocator == "tuned"
    assert ZeroConfig(cpu_allocator="default").cpu_allocator == "default"
    with pytest.raises(ValueError, match=r"cpu_allocator must be one of \['tuned', 'default'\], got 'off'"):
        ZeroConfig(cpu_allocator="off")


# A fresh interpreter: frees 64 tensors of 8 MiB in an order that leaves the heap's top in use
# (every other tensor kept, then the last one allocated kept), and prints how much of the freed
# 256 MiB stayed resident. With glibc's defaults the first freed blocks raise the mmap threshold,
# the rest come from the heap, and a freed block below the top stays resident.
_PROBE = textwrap.dedent(
    """
    import sys, torch
    from lightning_zero.allocator import tune_cpu_allocator, cpu_allocator_state

    def rss():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

    if sys.argv[1] == "tuned":
        first = tune_cpu_allocator("tuned", device_type="cpu")
        assert tune_cpu_allocator("tuned", device_type="cpu") is first  # once per process
        assert cpu_allocator_state() is first
    warm = [torch.ones(4 * 2**20) for _ in range(2)]  # 16 MiB blocks freed: glibc raises its threshold
    del warm
    before = rss()
    blocks = [torch.ones(2 * 2**20) for _ in range(64)]  # 512 MiB
    top = torch.ones(2 * 2**20)
    del blocks[::2]  # 256 MiB freed, below a live block
    print(rss() - before)
    """
)


@pytest.mark.skipif(not ON_GLIBC, reason="glibc's mallopt only exists on Linux with glibc")
def test_tuned_allocator_returns_freed_tensors_to_the_system():
    def kept(mode: str) -> float:
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.split()[-1])

    default, tuned = kept("default"), kept("tuned")
    assert default > 400, f"glibc's defaults should keep the freed blocks resident, kept {default:.0f} MiB"
    assert tuned < 300, f"tuned: only the 256 MiB still live should be resident, kept {tuned:.0f} MiB"


@pytest.mark.skipif(not ON_GLIBC, reason="glibc's mallopt only exists on Linux with glibc")
def test_each_kind_of_stage_applies_its_own_setting_once(monkeypatch):
    """A fit at stage 0 then one at stage 3 in one process: each applies its setting, and a second
    fit of the same kind changes nothing."""
    from lightning_zero import allocator

    applied = []

    def fake_apply(libc, environ, settings=SETTINGS):
        applied.append(settings)
        return allocator.AllocatorState({s.name: s.value for s in settings}, {}, "")

    monkeypatch.setattr(allocator, "_state", None)
    monkeypatch.setattr(allocator, "_apply", fake_apply)
    steady = allocator.tune_cpu_allocator("tuned", device_type="cpu", frees=False)
    assert allocator.tune_cpu_allocator("tuned", device_type="cpu", frees=False) is steady
    freeing = allocator.tune_cpu_allocator("tuned", device_type="cpu", frees=True)
    assert applied == [STEADY_SETTINGS, SETTINGS] and (steady.frees, freeing.frees) == (False, True)
    assert allocator.cpu_allocator_state() is freeing
    assert allocator.tune_cpu_allocator("default", device_type="cpu", frees=False).applied == {}
    assert allocator.cpu_allocator_state() is freeing  # "default" changes nothing
