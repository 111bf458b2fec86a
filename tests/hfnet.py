"""A model the Hugging Face Trainer takes: a forward of ``x`` (and ``labels``) returning a dict with
``logits`` (and ``loss``), reading no Python state that changes (dynamo would guard on it when the
Trainer compiles the model). Imported by the trainer tests.

>>> import torch
>>> out = HFNet()(torch.zeros(2, 6), labels=torch.tensor([0, 1]))
>>> sorted(out), out["logits"].shape
(['logits', 'loss'], torch.Size([2, 3]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HFNet(nn.Module):
    """Linear(6, 16), ReLU, Linear(16, 3); cross-entropy against ``labels`` when they are given."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}
