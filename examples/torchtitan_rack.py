"""Two torchtitan jobs training one model as two racks of a ``rackmend syncer``.

Runbook (one syncer; then each rack, here rackA and rackB, is a torchrun job of FSDP2 ranks):

    rackmend syncer --bind tcp://127.0.0.1:5555 --learners rackA,rackB --overlap 1
    torchrun --nproc-per-node 2 examples/torchtitan_rack.py --rackmend.endpoint tcp://127.0.0.1:5555 \
        --rackmend.learner-id rackA --hf-assets-path TOKENIZER_DIR \
        --dataloader.load-dataset-kwargs.data-files CHAT.jsonl

TOKENIZER_DIR holds a Hugging Face tokenizer (``tokenizer.json``, and a
``tokenizer_config.json`` with bos/eos tokens and a chat template); CHAT.jsonl has one
``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`` per line (torchtitan's
``ChatDataLoader``: prompt tokens and padding are masked, so a step's valid tokens are
the answers' tokens). Every torchtitan option works as usual (``--training.steps``,
``--checkpoint.enable``, ``--parallelism.tensor-parallel-degree``...), and rackmend's
settings are ``--rackmend.config.*`` (``--help`` lists them). The rack is the whole
torchrun job; rackmend's part is only ``with_rackmend`` below.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import ChatDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

from rackmend import RackmendConfig, ScheduleConfig
from rackmend.learner.titan import RackmendSection, RackmendTrainer, with_rackmend


def messages(sample: dict[str, Any]) -> list[dict[str, str]]:
    return sample["messages"]


def rack() -> RackmendTrainer.Config:
    """torchtitan's llama3 debug model cut to 2 layers, sharded by FSDP2 over the job's ranks."""
    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    config = Trainer.Config(
        model_spec=spec,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=2, seq_len=128, steps=40, dtype="float32"),
        dataloader=ChatDataLoader.Config(dataset_path="json", sample_processor=messages,
                                         load_dataset_kwargs={"data_files": "chat.jsonl", "split": "train"}),
        metrics=MetricsProcessor.Config(log_freq=4),
        # Parameters as DTensors on the parallel axes (FSDP2's classic path), which is how
        # rackmend finds each rank's blocks; torchtitan's default spmd_types fails in its
        # parallelize on torch 2.13.
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
    )
    return with_rackmend(config, RackmendSection(
        config=RackmendConfig(schedule=ScheduleConfig(sync_every=8, num_fragments=4, overlap=1))))


if __name__ == "__main__":
    from torchtitan.train import main

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # torchtitan imports this file as --module
    sys.argv[1:1] = ["--module", Path(__file__).stem, "--config", "rack"]
    main()
