"""Models the auto-parallel tests trace, solve and run: a GPT-2-style decoder, a ResNet-style CNN, and small
versions of both for the two-rank runs. Each factory builds the module on the current default device (the meta
device when traced; `torch.device("meta")` as a context), and each model returns its scalar training loss, so a
solved plan can be run and compared with one process.

Factories take keyword sizes so that `meshplan autoshard tests.autoshard.models:gpt --input-shape ...` and the
executors' workers can rebuild the same module from its name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal multi-head self-attention with separate query, key and value projections."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm GPT-2 block."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2-style decoder: token and position embeddings, `layers` blocks, final norm, untied vocabulary head,
    and the next-token cross-entropy of `labels`."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq_len: int, ffn: int | None = None):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn or 4 * hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class OneBlock(nn.Module):
    """One GPT block whose loss is the mean square of its output (the block alone, for layout tests)."""

    def __init__(self, hidden: int, heads: int, ffn: int | None = None) -> None:
        super().__init__()
        self.block = Block(hidden, heads, ffn or 4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).pow(2).mean()


class Bottleneck(nn.Module):
    """ResNet's bottleneck: 1x1, 3x3 (strided), 1x1 convolutions with batch norm, and a projected shortcut where
    the shape changes."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with bottleneck blocks (`blocks` per stage; (3, 4, 6, 3) with base width 64 is ResNet-50), global
    average pooling, a linear classifier and the cross-entropy of `labels`."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, cin = [], width
        for i, count in enumerate(blocks):
            w = width * 2 ** i
            for j in range(count):
                layers.append(Bottleneck(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = 4 * w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn(self.stem(images))))
        x = F.adaptive_avg_pool2d(self.layers(x), 1).flatten(1)
        return F.cross_entropy(self.fc(x), labels)


class SmallCNN(nn.Module):
    """A CNN small enough to train on two CPU ranks: two convolutions, pooling and a classifier (no batch norm, so
    that a batch split across ranks computes the same loss as one process)."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * 8 * 8, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.cross_entropy(self.fc(x.flatten(1)), labels)


def gpt(layers: int = 24, hidden: int = 1024, heads: int = 16, vocab: int = 50304, seq_len: int = 1024) -> GPT:
    """GPT-2 medium's shape by default (24 layers, hidden 1024)."""
    return GPT(layers, hidden, heads, vocab, seq_len)


def gpt_1_3b(seq_len: int = 2048) -> GPT:
    """GPT-3 XL's shape (1.3 B parameters): 24 layers, hidden 2048, 16 heads."""
    return GPT(24, 2048, 16, 50304, seq_len)


def small_gpt(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, seq_len: int = 32) -> GPT:
    return GPT(layers, hidden, heads, vocab, seq_len)


def gpt_block(hidden: int = 1024, heads: int = 16) -> OneBlock:
    return OneBlock(hidden, heads)


def resnet50(classes: int = 1000) -> ResNet:
    return ResNet((3, 4, 6, 3), 64, classes)


def small_cnn() -> SmallCNN:
    return SmallCNN()
