"""Training: from gathered trajectory groups to a LoRA update (GRPO-style losses).

`config` (TrainConfig, LossConfig, LoRAConfig: torch-free), `sequences` and `batch` (token records and advantages into a PreparedBatch),
`advantages`, `loss` (LOSSES, compute_loss), `logprobs`, `forward` and `packed_forward`
(the training forward passes), `lora` (attach_lora), `precision` and `trainer` (Trainer).
Lazy: most modules import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports

if TYPE_CHECKING:
    from art_core.training.advantages import group_advantages as group_advantages
    from art_core.training.batch import PreparedBatch as PreparedBatch
    from art_core.training.batch import TrainingExample as TrainingExample
    from art_core.training.batch import prepare_batch as prepare_batch
    from art_core.training.config import LoRAConfig as LoRAConfig
    from art_core.training.config import LossConfig as LossConfig
    from art_core.training.config import TrainConfig as TrainConfig
    from art_core.training.loss import LOSSES as LOSSES
    from art_core.training.loss import compute_loss as compute_loss
    from art_core.training.sequences import NoTrainableTokensError as NoTrainableTokensError
    from art_core.training.trainer import Trainer as Trainer

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "art_core.training.config": ("TrainConfig", "LossConfig", "LoRAConfig"),
        "art_core.training.loss": ("LOSSES", "compute_loss"),
        "art_core.training.trainer": ("Trainer",),
        "art_core.training.batch": ("prepare_batch", "PreparedBatch", "TrainingExample"),
        "art_core.training.advantages": ("group_advantages",),
        "art_core.training.sequences": ("NoTrainableTokensError",),
    },
)
