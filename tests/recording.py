"""A recorded run for tests of run-file consumers (plot, replay): real SGD steps on a fixed batch, every
step sampled with weights and updates, written by the RunFile sink and read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import streamwatch as sw
from streamwatch.sinks import RunData, RunFile, read_run


def record_run(
    path: Path,
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    *,
    lr: float,
    **observe: Any,
) -> RunData:
    """Train ``model`` for ``steps`` steps on ``(x, y)`` under ``observe(..., sinks=[RunFile(path)])``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    observe = {"every": 1} | observe  # every step recorded, unless the caller says otherwise
    with sw.observe(model, opt, sinks=[RunFile(path)], cadence={"param": 1, "update": 1}, **observe) as watch:
        for _ in range(steps):
            opt.zero_grad()
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            watch.step(loss=loss, outputs=out, targets=y)
    return read_run(path)
