"""Small real workloads for demos, tests and benchmarks: a byte-level GPT and a corpus
that every Python install carries (``pydoc_data``), so nothing is downloaded."""

from rackmend.workloads.corpus import ByteCorpus, evaluate
from rackmend.workloads.gpt import GPT, GPTConfig

__all__ = ["ByteCorpus", "GPT", "GPTConfig", "evaluate"]
