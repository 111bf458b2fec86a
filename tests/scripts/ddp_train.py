"""A real 2-rank (or N-rank) DDP training run on gloo, observed by streamwatch and served per local rank.

Started by ``tests/test_torchrun.py`` as ``torchrun --nproc_per_node=2 ddp_train.py --port P --out DIR``:
each rank trains, exposes /metrics on ``P + LOCAL_RANK``, writes its final snapshot (and
``watch.statistics().first_nonfinite``) to ``DIR/snapshot-<rank>.json`` and keeps serving until ``DIR/done``
exists (so Prometheus can scrape the final values), then closes and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import streamwatch as sw
from tests.torchrun import linger, write_json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--slow-rank", type=int, default=-1, help="this rank sleeps in its forward (straggler)"
    )
    parser.add_argument("--nan-rank", type=int, default=-1, help="this rank's gradients become NaN halfway")
    parser.add_argument(
        "--nan-forward-rank", type=int, default=-1, help="on this rank, layer 1 outputs a NaN at --nan-step"
    )
    parser.add_argument("--nan-step", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    fault_now = [False]
    if rank == args.nan_forward_rank:  # the injected fault: registered before observe(), so seen by it
        model[1].register_forward_hook(
            lambda module, inputs, output: output * float("nan") if fault_now[0] else None
        )
    ddp = DistributedDataParallel(model)  # the observed model is the inner module; DDP calls it
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    watch = sw.observe(model, opt, every=1)
    exporter = watch.expose(port=args.port, run="ddp")
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for step in range(args.steps):
        fault_now[0] = step == args.nan_step
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
        if rank == args.slow_rank:
            time.sleep(0.05)  # the injected straggler: slow compute on this rank only
        out = ddp(x)
        loss = F.cross_entropy(out, y)
        if rank == args.nan_rank and step >= args.steps // 2:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(loss=loss, outputs=out, targets=y, batch_size=32)
    watch.flush()
    snapshot = [{"name": s.name, "labels": dict(s.labels), "value": s.value} for s in watch.snapshot()]
    first = watch.statistics().first_nonfinite
    write_json(
        args.out / f"snapshot-{rank}.json",
        {
            "port": exporter.port,
            "samples": snapshot,
            "first_nonfinite": None if first is None else dataclasses.asdict(first),
        },
    )
    linger(watch, args.out)


if __name__ == "__main__":
    main()
