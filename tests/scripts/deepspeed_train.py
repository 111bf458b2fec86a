"""A real DeepSpeed ZeRO training run on gloo (CPU accelerator), observed by streamwatch on every rank, with
the whole parameters' values the test compares the ranks' rows with.

Started by ``tests/test_deepspeed.py`` as ``torchrun --nproc_per_node=N deepspeed_train.py --stage S --out
DIR``: each rank trains the same small MLP (sizes that split unevenly over the ranks: a parameter spans two
ranks' partitions under stages 1–2, and stage 3 pads the last rank's share) through
``deepspeed.initialize``, on its own batches, with ``observe(engine, optimizer, every=1)``. At each step it
records, from DeepSpeed's own full-tensor accessors (collectives every rank calls at the same point):

* ``grad``: each parameter's whole float32 gradient, averaged over the ranks, just before the step;
* ``param``: its whole float32 master weight after the step; ``update``: that minus the one before.

It writes ``DIR/ref-<rank>.json`` (float64 sums of squares, sums and element counts per step, kind and
parameter) and ``DIR/rows-<rank>.json`` (the same columns of streamwatch's rows, by the layer and
parameter names it gave them).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import streamwatch as sw

STEPS = 3


def _columns(t: torch.Tensor) -> dict[str, float]:
    x = t.detach().double().reshape(-1)
    return {"count": float(x.numel()), "sum": float(x.sum()), "sumsq": float(x.pow(2).sum())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 5))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10_000,
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    records = sw.sinks.collect()
    watch = sw.observe(engine, optimizer, every=1, cadence={"param": 1, "update": 1}, sinks=[records])
    names = [(*qualified.rsplit(".", 1), p) for qualified, p in model.named_parameters()]
    reference: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches: the average matters
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        step: dict[str, Any] = {}
        before = {}
        for layer, pname, p in names:
            step[f"param_grad/{layer}/{pname}"] = _columns(safe_get_full_grad(p))
            before[(layer, pname)] = safe_get_full_fp32_param(p).detach().clone()
        engine.step()
        for layer, pname, p in names:
            after = safe_get_full_fp32_param(p).detach().clone()
            step[f"param/{layer}/{pname}"] = _columns(after)
            step[f"update/{layer}/{pname}"] = _columns(after - before[(layer, pname)])
        reference.append(step)
        watch.step(loss=loss)
    watch.close()
    rows: list[dict[str, Any]] = []
    for record in records.items:
        got = {}
        for i, key in enumerate(record.keys):
            if key.kind in ("param", "param_grad", "update"):
                columns = ("count", "sum", "sumsq")
                got[f"{key.kind}/{key.layer}/{key.name}"] = {c: float(record.column(c)[i]) for c in columns}
        rows.append(got)
    stats = watch.statistics()
    result = {"rows": rows, "skipped": dict(stats.skipped), "hook_errors": stats.hook_errors}
    (args.out / f"rows-{rank}.json").write_text(json.dumps(result))
    (args.out / f"ref-{rank}.json").write_text(json.dumps(reference))


if __name__ == "__main__":
    main()
