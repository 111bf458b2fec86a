"""What an unsampled step costs (the governor's floor), segment by segment, on the demo's small MLP.

Run (after ``make env``)::

    .venv/bin/python benchmarks/profile_floor.py            # 40 rounds of 100 steps per variant
    .venv/bin/python benchmarks/profile_floor.py --rounds 20

Identical copies of the demo MLP (20-128³-10, batch 64, SGD, one torch thread) train side by side in
interleaved rounds, each as its own variant:

* ``plain``, ``plain2``: unmonitored (``plain2`` shows the noise between two identical loops);
* ``pre-hook``: unmonitored with a no-op forward pre-hook on the root module (torch's hook dispatch:
  what seeing the root module's calls through its call slot instead saves);
* ``default``: ``observe(model, opt)`` (the governor at 2 %), ``watch.step(loss, outputs, targets,
  batch_size)``;
* ``never``: ``observe(model, opt, every=10**9)``, the same ``watch.step()``: unsampled steps only;
* ``never, loss only``: the same with ``watch.step(loss)`` (no accuracy, no batch size).

Each step is timed in segments (forward with ``zero_grad``, loss and backward, ``optimizer.step()``,
``watch.step()``); the table shows each segment's median minus the ``plain`` loop's, in µs, and the
total. Not a test and not part of ``make bench``: it prints a table. Numbers move by ±5 µs between runs
on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import streamwatch as sw

SEGMENTS = ("forward", "backward", "optimizer", "watch.step", "total")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(20, 128), nn.ReLU()]
    for _ in range(2):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


def _variant(kind: str) -> tuple[Callable[[], None], list[list[float]], sw.Watch | None]:
    """One training loop: a function running one timed step, its segment times, its watch (if any)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 20), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()
    watch = None
    if kind == "pre-hook":
        model.register_forward_pre_hook(lambda *args: None)
    elif kind == "default":
        watch = sw.observe(model, opt)
    elif kind.startswith("never"):
        watch = sw.observe(model, opt, every=10**9)
    full = not kind.endswith("loss only")
    times: list[list[float]] = [[] for _ in SEGMENTS]
    clock = time.perf_counter

    def step() -> None:
        t0 = clock()
        opt.zero_grad()
        out = model(x)
        t1 = clock()
        loss = loss_fn(out, y)
        loss.backward()
        t2 = clock()
        opt.step()
        t3 = clock()
        if watch is not None:
            if full:
                watch.step(loss, outputs=out, targets=y, batch_size=64)
            else:
                watch.step(loss)
        t4 = clock()
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t0, t4))):
            times[i].append(b - a)

    return step, times, watch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds of 100 steps each")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = ("plain", "plain2", "pre-hook", "default", "never", "never, loss only")
    variants = {kind: _variant(kind) for kind in kinds}
    for _ in range(300):  # warm-up, and the governor's calibration
        for step, _, _ in variants.values():
            step()
    for _, times, _ in variants.values():
        for segment in times:
            segment.clear()
    for _ in range(args.rounds):
        for step, _, _ in variants.values():
            for _ in range(100):
                step()
    base = [statistics.median(segment) for segment in variants["plain"][1]]
    print(f"{'µs over plain':18s}" + "".join(f"{name:>12s}" for name in SEGMENTS))
    for kind, (_, times, watch) in variants.items():
        medians = [statistics.median(segment) for segment in times]
        deltas = "".join(f"{(m - b) * 1e6:12.1f}" for m, b in zip(medians, base, strict=True))
        print(f"{kind:18s}{deltas}   (step {medians[-1] * 1e3:.3f} ms)")
        if watch is not None:
            watch.close()


if __name__ == "__main__":
    main()
