"""Reference models shared by every module.

Small enough to run at smoke size on a laptop CPU, shaped like the real thing:
an MLP, a CNN for 32x32 images, a GPT-style decoder whose attention is
:func:`torch.nn.functional.scaled_dot_product_attention`, and an LSTM language model
built on :class:`torch.nn.LSTM`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "SmallCNN", "GPTConfig", "TinyGPT", "SmallLSTM", "count_parameters"]


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class MLP(nn.Module):
    """``depth`` Linear+GELU layers of width ``hidden``, then a Linear head."""

    def __init__(self, in_features: int = 784, hidden: int = 512, out_features: int = 10,
                 depth: int = 3) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("hidden", hidden),
                        ("out_features", out_features), ("depth", depth)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    """A ResNet-flavoured CNN for ``3 x 32 x 32`` images (about 0.29 M parameters at width 32)."""

    def __init__(self, num_classes: int = 10, width: int = 32, in_channels: int = 3) -> None:
        super().__init__()
        if width < 1 or num_classes < 1:
            raise ValueError("width and num_classes must be positive")

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            )

        self.features = nn.Sequential(
            block(in_channels, width), nn.MaxPool2d(2),
            block(width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`TinyGPT`."""

    vocab_size: int = 512
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-2-style decoder: token + position embeddings, pre-norm blocks, tied head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits ``(B, T, vocab)``; with ``targets``, ``(logits, loss)``."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time) token ids, got shape {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class SmallLSTM(nn.Module):
    """An LSTM language model: token embedding, a stacked :class:`torch.nn.LSTM`, a linear head.

    The recurrent counterpart of :class:`TinyGPT`, with the same interface: token ids
    ``(B, T)`` in, logits ``(B, T, vocab_size)`` out; with ``targets``, ``(logits, loss)``.
    Each position sees only the tokens before it (the recurrence runs forwards), so it trains
    on next-token targets such as :class:`utils.MarkovTokens`'.

    ``nn.LSTM`` runs as one library kernel per layer (cuDNN on a GPU, oneDNN or a loop of
    cell kernels on a CPU). ``torch.compile`` leaves it to that kernel: Dynamo breaks the
    graph at the LSTM unless ``torch._dynamo.config.allow_rnn`` is set, which unrolls the
    recurrence over time instead (a compile that grows with the sequence length).

    Args:
        vocab_size: tokens in the vocabulary.
        n_embd: width of the token embedding (the LSTM's input).
        hidden: the LSTM's hidden size.
        n_layer: stacked LSTM layers.
        dropout: dropout between LSTM layers (``nn.LSTM``'s; only with ``n_layer > 1``).

    Raises:
        ValueError: a size that is not a positive int, or a dropout outside ``[0, 1)``.
    """

    def __init__(self, vocab_size: int = 512, n_embd: int = 128, hidden: int = 256,
                 n_layer: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("n_embd", n_embd), ("hidden", hidden),
                        ("n_layer", n_layer)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.vocab_size = vocab_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.lstm = nn.LSTM(n_embd, hidden, num_layers=n_layer, batch_first=True,
                            dropout=dropout if n_layer > 1 else 0.0)
        self.head = nn.Linear(hidden, vocab_size)
        nn.init.normal_(self.tok_emb.weight, std=0.1)  # N(0, 1) would saturate the gates

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits ``(B, T, vocab)``; with ``targets``, ``(logits, loss)``."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time) token ids, got shape {tuple(idx.shape)}")
        out, _ = self.lstm(self.tok_emb(idx))
        logits = self.head(out)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss
