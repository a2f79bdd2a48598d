"""A model with every kind of state_dict entry rackmend does not synchronise, importable
by ``rackmend export --model _export_model:make_tied_model`` (PYTHONPATH=tests): a tied
output head (one tensor, two names), a frozen layer, BatchNorm (floating running
statistics that travel, an integer ``num_batches_tracked`` that does not) and a
non-persistent buffer (not in the state dict at all)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 13


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.norm = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, T, C); BatchNorm1d wants (B, C, T)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        h = torch.tanh(self.mix(h) + self.frozen(h) * self.scale)
        return self.head(h)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x).reshape(-1, VOCAB), y.reshape(-1))


def make_tied_model() -> TiedLM:
    torch.manual_seed(3)
    return TiedLM()


def tied_batch(lid: str, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(100 * int(lid.lstrip("l") or 0) + step)
    x = torch.randint(0, VOCAB, (4, 5), generator=g)
    return x, (x * 2 + 1) % VOCAB, x.numel()
