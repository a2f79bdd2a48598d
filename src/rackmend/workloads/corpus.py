"""A byte corpus from the Python documentation strings in ``pydoc_data`` (about 460 kB,
shipped with CPython), split into train and held-out parts."""

from __future__ import annotations

import torch

__all__ = ["ByteCorpus", "evaluate"]


class ByteCorpus:
    """Bytes of the pydoc topics; the last ``held_out`` share is kept for evaluation."""

    def __init__(self, held_out: float = 0.1) -> None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        split = int(len(data) * (1 - held_out))
        self.train = data[:split]
        self.held_out = data[split:]

    def batch(self, generator: torch.Generator, batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random training windows: inputs and next-byte targets."""
        starts = torch.randint(0, len(self.train) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([self.train[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([self.train[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        return x, y

    def eval_batches(self, n_batches: int, batch_size: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of held-out windows, evenly spaced (same for every caller)."""
        total = n_batches * batch_size
        span = len(self.held_out) - block_size - 1
        starts = [(i * span) // total for i in range(total)]
        out = []
        for b in range(n_batches):
            chunk = starts[b * batch_size : (b + 1) * batch_size]
            x = torch.stack([self.held_out[s : s + block_size] for s in chunk])
            y = torch.stack([self.held_out[s + 1 : s + 1 + block_size] for s in chunk])
            out.append((x, y))
        return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out loss of ``model`` over ``batches``."""
    was_training = model.training
    model.eval()
    total = sum(float(model(x, y)) for x, y in batches) / len(batches)
    model.train(was_training)
    return total
