"""A small GPT and a character corpus built from the Python standard library's own sources.

No downloads: the corpus is the ``.py`` files under ``os.path.dirname(os.__file__)``, read in
sorted order, bytes folded to 7-bit ASCII (vocabulary 128). Batches come from a seeded
generator, so every run and every rank (with its own seed) sees the same data.

    model = GPT(GPTConfig(n_layer=2, n_embd=64))       # ~0.11M parameters, tied lm_head
    data = CharCorpus(max_bytes=2_000_000)
    x, y = data.batch(batch_size=8, block_size=64, generator=torch.Generator().manual_seed(rank))
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    tie_weights: bool = True


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.out = nn.Linear(4 * c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        shape = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, lm_head tied to
    the token embedding (a shared parameter owned by two modules)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class CharCorpus:
    """The standard library's ``.py`` sources as one 7-bit byte stream (uint8 tensor)."""

    def __init__(self, max_bytes: int = 2_000_000, root: str | None = None) -> None:
        root = root or os.path.dirname(os.__file__)
        chunks, total = [], 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                try:
                    with open(os.path.join(dirpath, fn), "rb") as f:
                        b = f.read()
                except OSError:
                    continue
                chunks.append(b)
                total += len(b)
                if total >= max_bytes:
                    break
            if total >= max_bytes:
                break
        if not chunks:
            raise RuntimeError(f"CharCorpus: no .py files under {root}")
        data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)
        self.data = (data & 0x7F).long()

    def batch(self, batch_size: int, block_size: int, generator: torch.Generator):
        ix = torch.randint(len(self.data) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([self.data[i:i + block_size] for i in ix.tolist()])
        y = torch.stack([self.data[i + 1:i + 1 + block_size] for i in ix.tolist()])
        return x, y
