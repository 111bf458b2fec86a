"""A training script that does not close its Watch, for ``tests/test_exit.py``:
``python exit_train.py RUN_FILE HOW [every]``.

It trains a small MLP with ``observe(model, opt, sinks=[RunFile(RUN_FILE)])`` (the default governor, or
``every=1``) and prints ``STEP LOSS`` (``float.hex``) after each completed ``watch.step()``. ``HOW``:

- ``end``: 300 steps, then the script ends without ``close()``;
- ``raise``: raises after step 150 completed;
- ``sigterm``: trains until it is sent SIGTERM, with the handler docs/observe.md#close shows;
- ``failing``: 300 steps beside a sink whose ``close()`` raises, then ends without ``close()``.
"""

from __future__ import annotations

import signal
import sys

import torch

import streamwatch as sw


class FailsOnClose(sw.Sink):
    """A sink that takes every record and fails when it is closed."""

    def send(self, item: object) -> None:
        pass

    def close(self) -> None:
        raise OSError("the disk went away")


def main(run_file: str, how: str, every: int | None) -> None:
    if how == "sigterm":  # SIGTERM as SystemExit: Python's exit handlers then run (docs/observe.md#close)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sinks: list[sw.Sink] = [sw.sinks.RunFile(run_file)]
    if how == "failing":
        sinks.append(FailsOnClose())
    watch = sw.observe(model, opt, sinks=sinks, **({} if every is None else {"every": every}))
    steps = 10**9 if how == "sigterm" else 300
    for step in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(loss=loss)
        print(f"{step} {loss.item().hex()}", flush=True)  # (one write: a SIGTERM cannot split the line)
        if how == "raise" and step == 150:
            raise RuntimeError("the training loop failed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
