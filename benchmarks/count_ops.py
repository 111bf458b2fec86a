"""Launch counts: the torch ops one sampled step dispatches, on the torch path (the ops CUDA tensors take).

Runs on a CPU with ``STREAMWATCH_KERNEL=torch`` (``main`` sets it; ``tests/test_launches.py`` imports
this file and sets it itself) and ``_torchpath.FEW_LAUNCHES_ON_CPU``, so every summary takes the ops a
CUDA tensor takes; a counting
``TorchDispatchMode`` records every aten op the training thread dispatches during one step. Each model is
trained twice in lockstep, unobserved and observed with ``every=1`` and every kind's cadence at 1
(weights and updates too), and a sampled step's monitoring ops are the observed step's minus the
unobserved one's. Also counted: the ``stack``/``cat`` calls whose inputs have more than one dtype
(CUDA's ``cat`` copies such inputs one by one).

Not timed (``tests/test_launches.py`` asserts the bounds on these counts). Run::

    python benchmarks/count_ops.py            # the table of docs/performance.md#launch-counts
    python benchmarks/count_ops.py --ops      # and the monitoring ops of each case by name

Columns: ``ops`` every dispatched aten op streamwatch added to the step; ``kernels`` those of them that
are not views or allocations (what launches a kernel on a GPU); ``rows`` the summaries in the step's
record; ``mixed`` the ``stack``/``cat`` calls with mixed input dtypes, and the most inputs one had.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import streamwatch as sw
from streamwatch import _torchpath

__all__ = ["CASES", "Count", "OpCounter", "count_case", "main"]

_FREE = {
    "empty",
    "empty_like",
    "empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "_to_copy_noop",
    "record_stream",
}
"""Ops that launch no kernel besides views: allocations, aliases and the caching allocator's bookkeeping."""


@dataclass
class Count:
    """What a :class:`OpCounter` saw."""

    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    kernels: int = 0
    mixed: int = 0  # stack/cat calls with inputs of more than one dtype
    widest: int = 0  # the most inputs one stack/cat call had
    triton: int = 0  # Triton kernel launches (the Triton route: ``count_case(..., route="triton")``)
    transfers: list[str] = field(default_factory=list)  # copies between host and device, "cuda:0->cpu 37"

    @property
    def launches(self) -> int:
        """Kernels a GPU would launch: the torch ops that are not views or allocations, and Triton's."""
        return self.kernels + self.triton

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched on this thread while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = Count()
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.paused:  # (the Triton interpreter's own copies around a launch: not on a GPU)
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.count.ops[name] += 1
        if not (func.is_view or name in _FREE):
            self.count.kernels += 1
        if name in ("_to_copy", "copy_"):
            self._transfer(name, args, kwargs or {})
        if name in ("stack", "cat"):
            tensors = args[0]
            self.count.widest = max(self.count.widest, len(tensors))
            if len({t.dtype for t in tensors}) > 1:
                self.count.mixed += 1
        return func(*args, **(kwargs or {}))

    def _transfer(self, name: str, args: Any, kwargs: dict[str, Any]) -> None:
        """Note a copy between host and device: ``source->destination elements``."""
        if name == "copy_":
            destination, source = args[0].device, args[1].device
        else:
            source, destination = args[0].device, kwargs.get("device") or args[0].device
        if torch.device(source).type != torch.device(destination).type:
            self.count.transfers.append(f"{source}->{destination} {args[0].numel()}")


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small MLP (3 linear layers), a batch of 16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.randn(16, 32), torch.randint(0, 10, (16,))


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))  # type: ignore[no-any-return]


def transformer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small transformer encoder (2 layers, d=32, 2 heads), a batch of 4 sequences of 8."""
    torch.manual_seed(0)
    return _Transformer(), torch.randn(4, 8, 32), torch.randint(0, 10, (4,))


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]], torch.dtype | None]] = {
    "mlp": (mlp, None),
    "mlp bf16": (mlp, torch.bfloat16),
    "transformer": (transformer, None),
    "transformer bf16": (transformer, torch.bfloat16),
}
"""Model and autocast dtype (None: float32) by case name."""


def _step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast: torch.dtype | None,
    watch: sw.Watch | None,
) -> None:
    with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if watch is not None:
        watch.step(loss=loss)


def count_case(
    name: str, warmup: int = 2, device: str = "cpu", route: str = "torch"
) -> tuple[Count, Count, int]:
    """``(unobserved step, observed sampled step, rows in its record)`` for the case ``name`` on
    ``device`` (``tests/test_cuda.py`` counts on a GPU too), CPU tensors taking the ops CUDA tensors
    take (``_torchpath.FEW_LAUNCHES_ON_CPU``). ``route`` is ``STREAMWATCH_KERNEL`` for the run: ``torch``,
    or ``triton`` (the Triton kernels, each launch counted; on a CPU only under ``TRITON_INTERPRET=1``,
    set before Triton is imported)."""
    was, env = _torchpath.FEW_LAUNCHES_ON_CPU, os.environ.get("STREAMWATCH_KERNEL")
    _torchpath.FEW_LAUNCHES_ON_CPU = True
    os.environ["STREAMWATCH_KERNEL"] = route
    try:
        return _count_case(name, warmup, device)
    finally:
        _torchpath.FEW_LAUNCHES_ON_CPU = was
        if env is None:
            os.environ.pop("STREAMWATCH_KERNEL", None)
        else:
            os.environ["STREAMWATCH_KERNEL"] = env


class _Counted:
    """A Triton kernel whose launches (``kernel[grid](...)``) add to the active :class:`OpCounter`."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter = _active
            if counter is None:
                return launch(*args, **kwargs)
            counter.count.triton += 1
            counter.paused = True
            try:
                return launch(*args, **kwargs)
            finally:
                counter.paused = False

        return counted


_active: OpCounter | None = None


@contextlib.contextmanager
def _counting_triton() -> Iterator[None]:
    """Each Triton kernel of ``streamwatch._triton_kernels`` (if it imports) counted while active."""
    try:
        from streamwatch import _triton_kernels as kernels
    except ImportError:
        yield
        return
    names = ("flat_partials", "tile_partials", "finalize")
    originals = {name: getattr(kernels, name) for name in names}
    for name, kernel in originals.items():
        setattr(kernels, name, _Counted(kernel))
    try:
        yield
    finally:
        for name, kernel in originals.items():
            setattr(kernels, name, kernel)


def _count_case(name: str, warmup: int, device: str) -> tuple[Count, Count, int]:
    make, autocast = CASES[name]
    model, x, y = make()
    model, x, y = model.to(device), x.to(device), y.to(device)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
    records = sw.sinks.collect()
    cadence = dict.fromkeys(("activation", "output_grad", "param", "param_grad", "update"), 1)
    global _active
    with (
        _counting_triton(),
        sw.observe(model, opt, every=1, cadence=cadence, sinks=[records], sentinel=()) as watch,
    ):
        for _ in range(warmup):
            _step(twin, twin_opt, x, y, autocast, None)
            _step(model, opt, x, y, autocast, watch)
        with OpCounter() as plain:
            _step(twin, twin_opt, x, y, autocast, None)
        with OpCounter() as observed:
            _active = observed
            try:
                _step(model, opt, x, y, autocast, watch)
            finally:
                _active = None
        watch.flush()
    rows = len(records.items[-1].keys)
    return plain.count, observed.count, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"of {list(CASES)} (default: all)")
    parser.add_argument("--ops", action="store_true", help="list the monitoring ops of each case by name")
    parser.add_argument("--device", default="cpu", help="where the models run (default: cpu)")
    parser.add_argument(
        "--route",
        choices=("torch", "triton"),
        default="torch",
        help="STREAMWATCH_KERNEL: the torch path, or the Triton kernels (on a CPU: set TRITON_INTERPRET=1)",
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.device}, STREAMWATCH_KERNEL={args.route}")
    print(
        "| case | step ops (unobserved) | + ops (sampled) | + kernels | + Triton launches | rows "
        "| launches / row | mixed-dtype stack/cat (most inputs) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    details = []
    for name in args.cases or CASES:
        plain, observed, rows = count_case(name, device=args.device, route=args.route)
        ops = observed.total - plain.total
        kernels = observed.kernels - plain.kernels
        print(
            f"| {name} | {plain.total} | {ops} | {kernels} | {observed.triton} | {rows} "
            f"| {(kernels + observed.triton) / rows:.2f} "
            f"| {observed.mixed - plain.mixed} ({observed.widest}) |"
        )
        added = observed.ops.copy()
        added.subtract(plain.ops)
        details.append((name, added))
    if args.ops:
        for name, added in details:
            print(f"\n{name}: " + ", ".join(f"{op} {n}" for op, n in added.most_common() if n))


if __name__ == "__main__":
    main()
