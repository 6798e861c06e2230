"""Synthetic data that needs no download, importable by DataLoader workers.

Every item is a pure function of ``(seed, index)``, so results repeat across
runs and across worker processes. Datasets live here (not in a notebook cell)
because worker processes started with ``spawn`` (macOS, Windows) must import
them.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from .env import pick_device

__all__ = [
    "SyntheticImages",
    "SyntheticTokens",
    "MarkovTokens",
    "CPUHeavyImages",
    "CUDAPrefetcher",
    "worker_init",
    "stack_batches",
]


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class SyntheticImages(Dataset):
    """Random ``C x H x W`` float images with labels; class ``k`` is brighter in channel ``k % C``.

    The label is learnable (a model can beat chance), so loss curves mean something.
    """

    def __init__(self, n: int = 1024, image_size: int = 32, channels: int = 3,
                 num_classes: int = 10, seed: int = 0) -> None:
        _check_positive(n=n, image_size=image_size, channels=channels, num_classes=num_classes)
        self.n, self.image_size, self.channels = n, image_size, channels
        self.num_classes, self.seed = num_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        g = _generator(self.seed, index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        x = torch.randn(self.channels, self.image_size, self.image_size, generator=g)
        x[label % self.channels] += 0.5 + label / self.num_classes
        return x, label


class SyntheticTokens(Dataset):
    """Token sequences from a noisy repeating pattern; items are ``(x, y)`` with ``y`` shifted by one."""

    def __init__(self, n: int = 1024, seq_len: int = 128, vocab_size: int = 512,
                 seed: int = 0) -> None:
        _check_positive(n=n, seq_len=seq_len, vocab_size=vocab_size)
        self.n, self.seq_len, self.vocab_size, self.seed = n, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        g = _generator(self.seed, index)
        period = int(torch.randint(2, 17, (1,), generator=g))
        motif = torch.randint(self.vocab_size, (period,), generator=g)
        seq = motif.repeat(self.seq_len // period + 2)[: self.seq_len + 1].clone()
        noise = torch.rand(self.seq_len + 1, generator=g) < 0.1
        seq[noise] = torch.randint(self.vocab_size, (int(noise.sum()),), generator=g)
        return seq[:-1], seq[1:]


class MarkovTokens(Dataset):
    """Token sequences a language model can learn in a short run: a fixed random Markov chain.

    Every token ``v`` has ``branching`` successors, drawn once from the vocabulary (the chain's
    table, fixed by ``table_seed``); the next token is successor ``j`` with probability
    proportional to ``2**-j``. A model that learns the table predicts the next token with a
    cross-entropy of :attr:`entropy_nats` (about 1.14 nats for 4 successors), far below the
    ``log(vocab_size)`` of a model that knows nothing (9.0 nats at 8192 tokens), and it can
    learn it fast: one token of context is enough. :class:`SyntheticTokens` (random motifs)
    is learnable only by copying from the context, which a small model learns slowly; a
    claim about how close one run's final loss comes to another's needs a loss that falls.

    Items are ``(x, y)`` with ``y`` shifted by one, a pure function of ``(seed, index)``.
    """

    def __init__(self, n: int = 1024, seq_len: int = 128, vocab_size: int = 512,
                 branching: int = 4, seed: int = 0, table_seed: int = 0) -> None:
        _check_positive(n=n, seq_len=seq_len, vocab_size=vocab_size, branching=branching)
        if branching > vocab_size:
            raise ValueError(f"branching ({branching}) cannot exceed vocab_size ({vocab_size})")
        self.n, self.seq_len, self.vocab_size, self.seed = n, seq_len, vocab_size, seed
        self.branching = branching
        g = torch.Generator().manual_seed(1_000_003 * table_seed + 17)
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=g)
        w = torch.tensor([2.0**-j for j in range(branching)], dtype=torch.float64)
        self.probs = (w / w.sum()).to(torch.float32)
        self._table = self.successors.tolist()

    @property
    def entropy_nats(self) -> float:
        """The cross-entropy of a model that knows the chain: the loss floor (nats per token)."""
        p = self.probs.double()
        return float(-(p * p.log()).sum())

    @property
    def uniform_nats(self) -> float:
        """The cross-entropy of a model that knows nothing (uniform over the vocabulary)."""
        return math.log(self.vocab_size)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        g = _generator(self.seed, index)
        tok = int(torch.randint(self.vocab_size, (1,), generator=g))
        choices = torch.multinomial(self.probs, self.seq_len, replacement=True,
                                    generator=g).tolist()
        seq = [tok]
        for j in choices:
            tok = self._table[tok][j]
            seq.append(tok)
        t = torch.tensor(seq, dtype=torch.long)
        return t[:-1].clone(), t[1:].clone()


class CPUHeavyImages(SyntheticImages):
    """Images whose loading costs real CPU time, like JPEG decoding plus augmentation.

    Each item is generated at ``source_size``, blurred ``work`` times with a 5x5
    kernel (the stand-in for decoding), randomly cropped and flipped, and resized
    to ``image_size``. Raise ``work`` to make the loader the bottleneck.
    """

    def __init__(self, n: int = 1024, image_size: int = 32, channels: int = 3,
                 num_classes: int = 10, seed: int = 0, source_size: int = 96,
                 work: int = 4) -> None:
        super().__init__(n, image_size, channels, num_classes, seed)
        _check_positive(source_size=source_size)
        if not isinstance(work, int) or work < 0:
            raise ValueError(f"work must be a non-negative int, got {work!r}")
        if source_size < image_size:
            raise ValueError("source_size must be at least image_size")
        self.source_size, self.work = source_size, work
        self._kernel = torch.full((channels, 1, 5, 5), 1 / 25)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        g = _generator(self.seed, index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        s = self.source_size
        img = torch.rand(1, self.channels, s, s, generator=g)
        for _ in range(self.work):  # "decode": real arithmetic, on this process's CPU
            img = F.conv2d(img, self._kernel, padding=2, groups=self.channels)
        crop = int(s * 0.8)
        top, left = (int(v) for v in torch.randint(s - crop + 1, (2,), generator=g))
        img = img[:, :, top: top + crop, left: left + crop]
        if bool(torch.rand(1, generator=g) < 0.5):
            img = img.flip(-1)
        img = F.interpolate(img, size=(self.image_size, self.image_size), mode="bilinear",
                            align_corners=False)[0]
        img = (img - img.mean()) / (img.std() + 1e-6)
        img[label % self.channels] += 0.5 + label / self.num_classes
        return img.contiguous(), label


def worker_init(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: one intra-op thread per worker, said out loud.

    PyTorch's worker loop already sets one thread and seeds each worker; this
    makes the setting explicit in the code a learner reads, and is the place to
    cap other libraries' thread pools (e.g. ``cv2.setNumThreads(0)``), which
    PyTorch does not touch. ``N`` workers each using every core would fight
    over them.
    """
    torch.set_num_threads(1)


class CUDAPrefetcher:
    """Iterate a DataLoader while the next batch is copied to the GPU on a side stream.

    The copy of batch ``i+1`` overlaps with the compute on batch ``i``. It only
    overlaps when the loader pins memory (``pin_memory=True``): a copy from
    pageable memory is synchronous. On a non-CUDA device batches are moved to
    it as they come.
    """

    def __init__(self, loader: DataLoader | Any, device: str | torch.device) -> None:
        self.loader = loader
        self.device = pick_device(device)  # an indexed device: the stream is made on it
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.loader)

    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        return batch

    def _record(self, batch: Any) -> None:
        # Tell the caching allocator these tensors are used on the main stream too.
        if isinstance(batch, torch.Tensor):
            batch.record_stream(torch.cuda.current_stream(self.device))
        elif isinstance(batch, (list, tuple)):
            for b in batch:
                self._record(b)
        elif isinstance(batch, dict):
            for b in batch.values():
                self._record(b)

    def __iter__(self) -> Iterator[Any]:
        if self.stream is None:
            for batch in self.loader:
                yield self._to_device(batch)
            return
        it = iter(self.loader)
        nxt = None
        try:
            with torch.cuda.stream(self.stream):
                nxt = self._to_device(next(it))
        except StopIteration:
            return
        while nxt is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            batch = nxt
            self._record(batch)
            try:
                with torch.cuda.stream(self.stream):
                    nxt = self._to_device(next(it))
            except StopIteration:
                nxt = None
            yield batch


def stack_batches(dataset: Dataset, n_batches: int, batch: int,
                  device: str | torch.device | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n_batches * batch`` items of a dataset as ``n_batches`` ``(x, y)`` batches,
    on ``device``, each batch with its own storage.

    For training runs that must see the same batches in the same order (one run per
    precision, say): the batches are built once, before any run, so no run pays for them.
    Each batch owns its storage (not a view of one big tensor), so a memory probe that
    counts storages sees one batch. Targets may be ints (class labels) or tensors.

    Raises:
        ValueError: ``n_batches`` or ``batch`` not a positive int, or a dataset shorter than
            ``n_batches * batch`` items.
    """
    _check_positive(n_batches=n_batches, batch=batch)
    need = n_batches * batch
    if len(dataset) < need:
        raise ValueError(f"the dataset has {len(dataset)} items; {n_batches} batches of {batch} "
                         f"need {need}")
    dev = pick_device(device)
    items = [dataset[i] for i in range(need)]
    out = []
    for b in range(n_batches):
        xs, ys = zip(*items[b * batch:(b + 1) * batch])
        y = torch.as_tensor(ys) if not isinstance(ys[0], torch.Tensor) else torch.stack(ys)
        out.append((torch.stack(xs).to(dev), y.to(dev)))
    return out
