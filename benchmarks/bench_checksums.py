"""What checkpoint checksums cost: save and load of a ~500 MB checkpoint with and without them.

    python benchmarks/bench_checksums.py                 # 500 MB, full and sharded forms, 3 repeats
    python benchmarks/bench_checksums.py --mb 100 --repeats 1

One process, CPU, the checkpoint written to a temporary folder (``--dir``, default: the system's
temporary folder). "save" is ``save_full`` / ``save_sharded`` (the checksums computed before or
after writing), "load" is ``read`` with ``verify`` on or off (the full form: ``torch.load`` of the
whole file; the sharded form: the structural checks and, with verify, the chunks' CRC32s; DCP's
own read into the model happens later and is the same either way). Medians of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero import checkpoint as C
from lightning_zero.checkpoint import writer
from lightning_zero.comm import Communicator

IO = TorchCheckpointIO()


def model_and_optimizer(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers of 1 M parameters each, AdamW stepped once: 12 bytes per parameter saved."""
    layers = max(1, round(mb * 2**20 / 12 / 2**20))
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def without_checksums() -> Callable[[], None]:
    """Switch the save-side checksums off; returns what switches them back on."""
    saved = (writer.add_full_checksums, writer.shard_checksums, writer.sharded_record)
    writer.add_full_checksums = lambda checkpoint: None
    writer.shard_checksums = lambda directory, metadata, files: {}
    writer.sharded_record = lambda directory, chunks: None

    def restore() -> None:
        writer.add_full_checksums, writer.shard_checksums, writer.sharded_record = saved

    return restore


def save_full(model, optimizer, path: Path) -> None:
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "epoch": 0}
    C.save_full(checkpoint, str(path), Communicator(), IO, keep_previous=False)


def save_sharded(model, optimizer, path: Path) -> None:
    checkpoint = {
        "state_dict": C.sharded_model_state(model, None),
        "optimizer_states": [C.sharded_optimizer_state(model, None, optimizer, 0)],
        "epoch": 0,
    }
    C.save_sharded(checkpoint, path, Communicator(), C.layout_of(model, None, 0, 1), keep_previous=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=500, help="checkpoint size, MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer(args.mb)
    raw = torch.cat([t.reshape(-1) for t in model.state_dict().values()])
    start = time.perf_counter()
    zlib.crc32(raw.numpy())
    speed = raw.numel() * 4 / (time.perf_counter() - start) / 2**30
    print(f"zlib.crc32 on this CPU: {speed:.2f} GiB/s ({zlib.ZLIB_RUNTIME_VERSION})")
    print(
        "| form | size MB | save s, no checksums | save s, checksums | load s, unchecked | load s, verified |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for form, save in (("full", save_full), ("sharded", save_sharded)):
            print(measure(form, save, model, optimizer, Path(tmp) / f"{form}.ckpt", args.repeats))


def measure(form: str, save: Callable, model, optimizer, path: Path, repeats: int) -> str:
    """One table row: save without and with checksums, load unchecked and verified."""
    restore = without_checksums()
    plain_save = timed(lambda: save(model, optimizer, path), repeats)
    restore()
    checked_save = timed(lambda: save(model, optimizer, path), repeats)
    size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.iterdir())) / 1e6
    plain_load = timed(lambda: C.read(path, IO, verify=False), repeats)
    checked_load = timed(lambda: C.read(path, IO, verify=True), repeats)
    times = (plain_save, checked_save, plain_load, checked_load)
    return "| " + " | ".join((form, f"{size:.0f}", *(f"{t:.2f}" for t in times))) + " |"


if __name__ == "__main__":
    main()
