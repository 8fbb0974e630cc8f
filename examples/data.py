"""Character-level data that needs no download: the text of Python's own help topics.

The corpus is ``pydoc_data.topics.topics`` (the pages behind ``help("if")`` and friends, shipped
with CPython), joined in sorted key order: about 465k characters of English prose and Python code.
The vocabulary is the sorted set of its characters. The first 90% is the training split, the rest
validation.

    python examples/train.py data.batch_size=16 data.num_train_samples=4096
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def corpus_text() -> str:
    """The bundled corpus: every pydoc help topic, in sorted key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class RandomWindows(Dataset):
    """``num_samples`` windows of ``block_size + 1`` tokens at seeded random offsets.

    Item i is (x, y) with y = x shifted by one position: both (block_size,) int64. The offsets
    are drawn once, so the dataset has a fixed length and the same items on every rank.
    """

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int, seed: int) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(
                f"split of {data.numel()} tokens is shorter than block_size + 1 = {block_size + 1}"
            )
        generator = torch.Generator().manual_seed(seed)
        high = data.numel() - block_size  # last valid start + 1
        self.data = data  # 1D int64, the split's token ids
        self.block_size = block_size  # T
        self.starts = torch.randint(0, high, (num_samples,), generator=generator)  # (num_samples,)

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.block_size + 1]  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


class StridedWindows(Dataset):
    """Non-overlapping windows covering a split from its start: the validation set."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data  # 1D int64, the split's token ids
        self.block_size = block_size  # T

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.block_size
        chunk = self.data[s : s + self.block_size + 1]  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


class CharDataModule(L.LightningDataModule):
    """Next-character prediction on the bundled corpus.

    The vocabulary is built in ``__init__`` so that ``vocab_size`` is known before the model is.
    No sampler is set here: under a data-parallel strategy Lightning inserts a DistributedSampler.

    Args:
        block_size: context length T of a sample; match the model's ``block_size``.
        batch_size: samples per batch on each rank.
        num_train_samples: windows in one training epoch (across all ranks).
        train_fraction: leading fraction of the corpus used for training; the rest validates.
        seed: seed of the training window offsets.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        *,
        block_size: int = 64,
        batch_size: int = 32,
        num_train_samples: int = 16384,
        train_fraction: float = 0.9,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
        self.save_hyperparameters()
        text = corpus_text()
        self.chars = sorted(set(text))  # the vocabulary, index = token id
        self._stoi = {c: i for i, c in enumerate(self.chars)}  # char -> token id
        self.data = torch.tensor(self.encode(text), dtype=torch.long)  # 1D, the whole corpus
        n_train = int(train_fraction * self.data.numel())
        self.train_data = self.data[:n_train]  # 1D, first 90%
        self.val_data = self.data[n_train:]  # 1D, last 10%
        self.train_set: RandomWindows | None = None
        self.val_set: StridedWindows | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self._stoi.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown!r}")
        return [self._stoi[c] for c in text]

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(self.chars[i] for i in ids)

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        self.train_set = RandomWindows(self.train_data, hp.block_size, hp.num_train_samples, hp.seed)
        self.val_set = StridedWindows(self.val_data, hp.block_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: Dataset | None, *, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,  # equal-sized training batches on every rank
            num_workers=self.hparams.num_workers,
        )
