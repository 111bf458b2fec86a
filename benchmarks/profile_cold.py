"""What small pieces of a sampled ``watch.step()`` cost when the caches are cold, as after a training step.

A sampled ``watch.step()`` takes 53-70 µs after the demo MLP's step and 114-160 µs after the MLP's,
the CNN's or the transformer's (``benchmarks/profile_worker.py``): those steps stream tens of megabytes
through the caches, and the boundary's code and data are evicted by the time it runs. This script times
pieces of that boundary in isolation, each call after writing a 48 MB buffer (which evicts the 1 MiB
L2 and most of the 32 MiB L3 of the development VM), against the same call with warm caches. It is not
a test and not part of ``make bench``: it prints a table.

Usage::

    python benchmarks/profile_cold.py            # 400 calls per piece
    python benchmarks/profile_cold.py --calls 1000

Each line: the piece, its median cold and warm, in µs. The pieces are what a sampled step of the
benchmark models does: one call into an empty lambda (the floor of any call), one torch attribute
(``tensor.shape``), one small torch op (``tensor.sum()`` on a 128 × 10 batch of scores), the accuracy
layout lookup (``_layout``'s cache), the compiled accuracy count, and ``watch.step()``'s argument
checks with and without accuracy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from streamwatch._accuracy import TrainAccuracy
from streamwatch._step_args import check_step

EVICT_BYTES = 48 * 2**20


def timed(call: Callable[[], object], calls: int, evict: np.ndarray | None) -> float:
    """The median time of ``call`` in µs, each call after writing all of ``evict`` (None: warm)."""
    times = []
    for _ in range(calls):
        if evict is not None:
            np.add(evict, 1.0, out=evict)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def pieces() -> dict[str, Callable[[], object]]:
    """The calls timed, by name, on a batch like the MLP benchmark's (128 samples, 10 classes)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(128, 10, generator=gen)
    labels = torch.randint(0, 10, (128,), generator=gen)
    loss = torch.tensor(1.0)
    scoring = TrainAccuracy()
    found = check_step(None, scores, labels, None, scoring).accuracy
    assert found is not None
    scorer, outputs, targets, _ = found
    return {
        "empty call": lambda: None,
        "tensor.shape": lambda: scores.shape,
        "tensor.sum()": lambda: scores.sum(),
        "accuracy layout lookup": lambda: scoring.layout(scores, labels),
        "accuracy count (compiled)": lambda: scorer(outputs, targets),
        "step checks, loss only": lambda: check_step(loss, None, None, 128, scoring),
        "step checks with accuracy": lambda: check_step(loss, scores, labels, 128, scoring),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per piece and cache state")
    args = parser.parse_args()
    torch.set_num_threads(2)
    evict = np.zeros(EVICT_BYTES // 8)
    print(f"{'piece':<28}{'cold µs':>9}{'warm µs':>9}")
    for name, call in pieces().items():
        cold = timed(call, args.calls, evict)
        warm = timed(call, args.calls, None)
        print(f"{name:<28}{cold:>9.1f}{warm:>9.1f}")


if __name__ == "__main__":
    main()
