"""Real text with no download: the Python sources of the installed torch, and a tokenizer for them.

The capstone's notebook and ``train.py`` both import this module (it sits next to them),
so they train on exactly the same tokens.

* :func:`read_torch_sources` reads the ``.py`` files under torch's package folder in a
  fixed, shuffled order, up to a character budget, separated by an end-of-file mark.
* :class:`Tokenizer` is built offline from that text. The text is cut into *pieces*
  (identifiers, numbers, runs of spaces, runs of newlines, runs of punctuation, any
  other single character). The vocabulary is the 256 bytes, then the ``n_words`` most
  frequent pieces longer than one byte, then one end-of-file token: ``257 + n_words``
  entries, a size that is not a multiple of anything nice (GPT-2's 50257 is
  50000 merges + 256 bytes + 1 end-of-text token; ``n_words=8000`` gives 8257).
  A piece outside the vocabulary is spelled out as its UTF-8 bytes, so every text
  round-trips exactly.
* :class:`Corpus` holds the token stream and cuts training batches from it: step
  ``i``'s batch is a pure function of ``(seed, i)``, so every rung of the ladder, and
  every run of ``train.py``, sees the same data in the same order.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["PIECE", "read_torch_sources", "Tokenizer", "Corpus", "build_corpus"]

#: How text is cut into pieces; every character belongs to exactly one piece.
PIECE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+| +|\n+|[^\sA-Za-z0-9_]+|\s")
EOF_MARK = "\x00"  # separates files in the text; it becomes the end-of-file token


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def read_torch_sources(max_chars: int, seed: int = 0) -> str:
    """Up to ``max_chars`` characters of the installed torch's own ``.py`` files.

    Files are taken in a shuffled order (``random.Random(seed)`` over the sorted paths)
    so that the text mixes many parts of the library, and joined with an end-of-file
    mark. The same torch install and seed give the same text.

    Raises:
        ValueError: ``max_chars`` is not a positive int.
        FileNotFoundError: torch's package folder holds no ``.py`` files (a zipped install).
    """
    _positive("max_chars", max_chars)
    root = Path(torch.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: this torch install has no "
                                "readable sources to train on")
    random.Random(seed).shuffle(files)
    parts: list[str] = []
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        text = text.replace(EOF_MARK, "")
        parts.append(text)
        total += len(text) + 1
        if total >= max_chars:
            break
    return EOF_MARK.join(parts)[:max_chars]


@dataclass(frozen=True)
class Tokenizer:
    """Bytes plus the most frequent pieces of a training text, plus an end-of-file token.

    Token ids: ``0..255`` the bytes, then ``words`` in order, then the end-of-file token.
    """

    words: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(set(self.words)) != len(self.words):
            raise ValueError("the words of a tokenizer must be unique")
        bad = [w for w in self.words if len(w.encode("utf-8")) < 2 or EOF_MARK in w]
        if bad:
            raise ValueError(f"words must be pieces of two or more bytes without the "
                             f"end-of-file mark, got {bad[:3]}")
        object.__setattr__(self, "_ids", {w: 256 + i for i, w in enumerate(self.words)})

    @classmethod
    def train(cls, text: str, n_words: int) -> "Tokenizer":
        """The ``n_words`` most frequent pieces of ``text`` (ties broken alphabetically).

        Raises:
            ValueError: ``n_words`` is not a positive int, or the text has fewer
                distinct multi-byte pieces than that.
        """
        _positive("n_words", n_words)
        counts = Counter(p for p in PIECE.findall(text.replace(EOF_MARK, "\n"))
                         if len(p.encode("utf-8")) >= 2)
        if len(counts) < n_words:
            raise ValueError(f"the text has only {len(counts)} distinct pieces of two or more "
                             f"bytes, fewer than n_words={n_words}: use more text or fewer words")
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n_words]
        return cls(tuple(w for w, _ in ranked))

    @property
    def eof_id(self) -> int:
        return 256 + len(self.words)

    @property
    def vocab_size(self) -> int:
        """256 bytes + the words + the end-of-file token."""
        return 257 + len(self.words)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (the end-of-file mark becomes :attr:`eof_id`)."""
        ids: list[int] = []
        get = self._ids.get  # type: ignore[attr-defined]
        for doc_i, doc in enumerate(text.split(EOF_MARK)):
            if doc_i:
                ids.append(self.eof_id)
            for piece in PIECE.findall(doc):
                tid = get(piece)
                if tid is None:
                    ids.extend(piece.encode("utf-8"))
                else:
                    ids.append(tid)
        return ids

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """The text of token ids; the end-of-file token becomes the end-of-file mark.

        Raises:
            ValueError: an id outside the vocabulary (e.g. a padded row's id).
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = bytearray()
        for tid in ids:
            if 0 <= tid < 256:
                out.append(tid)
            elif 256 <= tid < self.eof_id:
                out.extend(self.words[tid - 256].encode("utf-8"))
            elif tid == self.eof_id:
                out.extend(EOF_MARK.encode("utf-8"))
            else:
                raise ValueError(f"token id {tid} is outside the vocabulary of "
                                 f"{self.vocab_size} (ids 0..{self.vocab_size - 1})")
        return out.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    """A token stream and the batches cut from it."""

    tokenizer: Tokenizer
    tokens: torch.Tensor  # int32, 1-D
    n_chars: int

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s batch: ``batch_size`` windows of ``seq_len + 1`` tokens.

        The window starts are drawn from ``torch.Generator().manual_seed(seed * 1_000_003
        + step)``. Returns ``(inputs, targets)``, int64 ``(batch_size, seq_len)``,
        each its own row-major tensor, targets shifted by one token.

        Raises:
            ValueError: bad sizes, or a window longer than the stream.
        """
        _positive("batch_size", batch_size)
        _positive("seq_len", seq_len)
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        n = self.tokens.numel()
        if seq_len + 1 >= n:
            raise ValueError(f"seq_len {seq_len} needs more than {n} tokens: build the corpus "
                             "from more text")
        starts = self.starts(step, batch_size, seq_len, seed)
        windows = self.tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
        fresh = torch.contiguous_format
        return (windows[:, :-1].clone(memory_format=fresh).to(device),
                windows[:, 1:].clone(memory_format=fresh).to(device))

    def starts(self, step: int, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
        """Where step ``step``'s windows start in the stream (int64, on the CPU)."""
        n = self.tokens.numel()
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return torch.randint(n - seq_len - 1, (batch_size,), generator=g)

    def on_device(self, device: str | torch.device, steps: int, batch_size: int, seq_len: int,
                  seed: int = 0) -> "DeviceBatches":
        """The batches of steps ``0 .. steps - 1``, cut on ``device`` with no copy per step.

        The token stream and every step's window starts go to the device once, here; a step's
        batch is then an indexing on the device. :meth:`batch` copies each batch from the host
        instead, and on a GPU the training loop waits for that copy every step.
        """
        _positive("steps", steps)
        _positive("batch_size", batch_size)
        _positive("seq_len", seq_len)
        if seq_len + 1 >= self.tokens.numel():
            raise ValueError(f"seq_len {seq_len} needs more than {self.tokens.numel()} tokens")
        dev = torch.device(device)
        starts = torch.stack([self.starts(s, batch_size, seq_len, seed) for s in range(steps)])
        return DeviceBatches(self.tokens.to(dev), starts.to(dev),
                             torch.arange(seq_len + 1, device=dev))


@dataclass(frozen=True)
class DeviceBatches:
    """Batches cut from a token stream that lives on the device (:meth:`Corpus.on_device`).

    ``batches(step)`` gives the same ``(inputs, targets)`` as ``corpus.batch(step, ...)``,
    with no host-to-device copy.
    """

    tokens: torch.Tensor   # the stream, on the device
    starts: torch.Tensor   # (steps, batch_size) window starts, on the device
    offsets: torch.Tensor  # 0 .. seq_len, on the device

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= step < self.starts.shape[0]:
            raise IndexError(f"step {step} is outside the {self.starts.shape[0]} steps prepared")
        windows = self.tokens[self.starts[step][:, None] + self.offsets].long()
        fresh = torch.contiguous_format
        return (windows[:, :-1].clone(memory_format=fresh),
                windows[:, 1:].clone(memory_format=fresh))


def build_corpus(max_chars: int, n_words: int, seed: int = 0) -> Corpus:
    """Read ``max_chars`` of torch's sources, train a tokenizer of ``257 + n_words``
    entries on them, and encode them."""
    text = read_torch_sources(max_chars, seed)
    tok = Tokenizer.train(text, n_words)
    tokens = torch.tensor(tok.encode(text), dtype=torch.int32)
    return Corpus(tokenizer=tok, tokens=tokens, n_chars=len(text))


@dataclass(frozen=True)
class RandomTokens:
    """Uniform random token ids over ``vocab_size``, for measuring speed at a vocabulary the
    corpus cannot give (GPT-2's 50,257 needs far more distinct words than torch's sources
    hold). Nothing is learnable in it; the loss stays near ``log(vocab_size)``.

    It offers :meth:`on_device` like :class:`Corpus`: every step's batch is drawn on the device
    from a generator seeded by ``seed`` and the step, with no copy from the host.
    """

    vocab_size: int
    seed: int = 0

    def on_device(self, device: str | torch.device, steps: int, batch_size: int, seq_len: int,
                  seed: int | None = None) -> "RandomBatches":
        _positive("vocab_size", self.vocab_size)
        _positive("steps", steps)
        _positive("batch_size", batch_size)
        _positive("seq_len", seq_len)
        return RandomBatches(torch.device(device), self.vocab_size, steps, batch_size, seq_len,
                             self.seed if seed is None else seed)


@dataclass(frozen=True)
class RandomBatches:
    """The batches of :class:`RandomTokens`: ``batches(step)`` -> ``(inputs, targets)``."""

    device: torch.device
    vocab_size: int
    steps: int
    batch_size: int
    seq_len: int
    seed: int

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} is outside the {self.steps} steps prepared")
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + step)
        windows = torch.randint(self.vocab_size, (self.batch_size, self.seq_len + 1),
                                generator=g, device=self.device)
        fresh = torch.contiguous_format
        return (windows[:, :-1].clone(memory_format=fresh),
                windows[:, 1:].clone(memory_format=fresh))

