"""What a training batch is worth in tokens, for the trainer integrations (``hf``,
``lightning``) that count them from the batches they see. Imports no trainer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["count_batch_tokens"]


def count_batch_tokens(batch: Any) -> int | None:
    """Tokens a batch trains on: the sum of ``attention_mask`` (padding does not count),
    else the number of elements of ``input_ids``; None when the batch is not a mapping
    holding either."""
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    return None
