"""A real FSDP2 (``fully_shard``) or DDP training run on gloo, observed by streamwatch on every rank, with
the unsharded reference values the test compares Prometheus' answers with.

Started by ``tests/test_fsdp_norms.py`` as ``torchrun --nproc_per_node=N sharded_train.py --mode fsdp2
--port P --out DIR``: each rank trains the same small MLP (its last layer has 5 outputs, so its rows do
not split evenly over 2 or 4 ranks, and at 4 ranks one rank holds an empty shard of it), exposes
/metrics on ``P + LOCAL_RANK``, and at the last step records, in float64 and from torch alone:

* ``full``: per parameter, the sum of squares and element count of the whole (unsharded) weight after
  the step, of its gradient, and of the step's update (FSDP2: ``DTensor.full_tensor()``, a collective the
  script issues itself; DDP: the replica, identical on every rank);
* ``local``: the same of what this rank holds (FSDP2: its shard, ``to_local()``; DDP: the replica, the
  gradient the one DDP averaged over the ranks, as the optimizer applies it).

It writes them to ``DIR/ref-<rank>.json`` and keeps serving until ``DIR/done`` exists.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from tests.torchrun import linger, write_json


def _sumsq(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).sum())


def _sums(t: torch.Tensor) -> dict[str, float]:
    """The full tensor's sums of powers, in float64: what the ranks' shards must add up to."""
    x = t.detach().double()
    sums = {"sum": x.sum(), "sumsq": x.pow(2).sum(), "sumabs": x.abs().sum(), "sumcube": x.pow(3).sum()}
    sums |= {"sumfourth": x.pow(4).sum(), "abs_cube": x.abs().pow(3).sum()}
    return {name: float(value) for name, value in sums.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 5))


def _policy(name: str) -> object:
    if name == "even":  # a callable policy: every other rank keeps per-layer series
        return lambda rank, local_rank, world_size: rank % 2 == 0
    return name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("fsdp2", "ddp"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="sharded", help="the run label")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--detail", default="all")
    parser.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps before each forward")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _mlp()
    net: nn.Module
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)  # the parameters are now DTensors sharded on dim 0
        net = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)  # observed: the inner module, which DDP calls
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    watch = sw.observe(model, opt, cadence={"param": 1, "update": 1}, detail=_policy(args.detail), every=1)
    watch.expose(port=args.port, run=args.name)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    full: dict[str, dict[str, Any]] = {}
    local: dict[str, dict[str, float]] = {}
    for step in range(args.steps):
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 5, (32,), generator=g)
        last = step == args.steps - 1
        if rank == args.slow_rank:
            # The injected straggler: slow compute on this rank only. 0.25 s, so that the alert's margin
            # (5 % of the median step, which the sleep sets) is ~12 ms: four ranks sharing two cores stall
            # a healthy rank's last sampled step by a few ms now and then (0.05 s fired a second rank once).
            time.sleep(0.25)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        if last:
            params = dict(model.named_parameters())
            before = {n: _full(p.detach()).clone() for n, p in params.items()}
            before_local = {n: _local(p.detach()).clone() for n, p in params.items()}
            for n, p in params.items():
                assert p.grad is not None
                full[n] = {"param_grad": _sumsq(_full(p.grad)), "count": float(p.numel())}
                full[n]["param_grad_sums"] = _sums(_full(p.grad))
                local[n] = {"param_grad": _sumsq(_local(p.grad)), "count": float(_local(p.detach()).numel())}
        opt.step()
        watch.step(loss=loss, batch_size=32)
    for n, p in model.named_parameters():
        after, after_local = _full(p.detach()), _local(p.detach())
        full[n].update(param=_sumsq(after), update=_sumsq(after - before[n]))
        full[n].update(param_sums=_sums(after), update_sums=_sums(after - before[n]))
        local[n].update(param=_sumsq(after_local), update=_sumsq(after_local - before_local[n]))
    watch.flush()
    write_json(args.out / f"ref-{rank}.json", {"full": full, "local": local})
    linger(watch, args.out)


if __name__ == "__main__":
    main()
