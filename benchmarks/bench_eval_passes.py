"""Evaluation passes on every step under the default governor: a reinforcement-learning-style loop.

Each step generates ``GEN`` tokens greedily with the policy (``model.eval()``, ``torch.no_grad()``: one
forward per token) and then takes a training step on a batch. Before the evaluation allowance
(``streamwatch/_allowance.py``) every one of those passes was summarised on every step, a cost the
overhead governor could not sample away. Run (about 2 minutes on a quiet 2-core VM)::

    python -m pytest benchmarks/bench_eval_passes.py -o python_files='bench_*.py' -p no:cacheprovider \\
        --benchmark-only -s

Variants, each its own copy of the model (same initial weights), round-robin in cycles of ``K`` steps, the
order rotating each cycle (the VM's drift hits every variant alike):

* ``baseline``: unmonitored;
* ``default``: ``sw.observe(model, opt)``, the 2 % governor, with the evaluation allowance;
* ``unbudgeted``: the same with the allowance taken away (``watch._taps.eval_allowance = None``): every
  evaluation pass summarised, as before it;
* ``eval_off``: the same with an allowance that never grants (``EvalAllowance(0.0)``): no evaluation
  pass between sampled steps summarised, what the governor costs this loop by itself.

The ratio is each variant's total time over the measured cycles to the baseline's, and the median over
cycles of the per-cycle ratio. The first ``WARMUP`` cycles are not measured. The allowance starts full
and holds ``WINDOW_SECONDS`` (60 s) of its rate, 0.6 s of hook time at the 2 % budget: a run of hours
spends that in its first minutes, this benchmark's 30 s would not. So it measures the steady state with a
window of ``WINDOW`` seconds (``streamwatch._allowance.WINDOW_SECONDS``, set for the run).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

import streamwatch as sw
from streamwatch import _allowance

V, D, T, BATCH = 64, 64, 16, 16
GEN = 8  # tokens generated per step
K = 50  # steps per variant per cycle
CYCLES = 12
WARMUP = 4
WINDOW = 1.0  # seconds of the allowance's rate it holds (the library's 60 s would outlast the run)


class TinyLM(nn.Module):
    """An embedding, four MLP blocks and a head: 14 leaf modules, a step of about 10 ms here."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(4)]
        )
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


class Loop:
    """One variant: its model, optimizer, watch and per-cycle times."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.watch = None if name == "baseline" else sw.observe(self.model, self.opt)
        if self.watch is not None and name == "unbudgeted":
            self.watch._taps.eval_allowance = None
        if self.watch is not None and name == "eval_off":
            self.watch._taps.eval_allowance = _allowance.EvalAllowance(0.0)
        self.generator = torch.Generator().manual_seed(1)
        self.times: list[float] = []

    def run(self, steps: int, record: bool) -> None:
        model, g = self.model, self.generator
        start = time.perf_counter()
        for _ in range(steps):
            model.eval()
            with torch.no_grad():
                seq = torch.randint(0, V, (8, T), generator=g)
                for _ in range(GEN):
                    token = model(seq[:, -T:])[:, -1].argmax(-1, keepdim=True)
                    seq = torch.cat([seq, token], 1)
            model.train()
            x = torch.randint(0, V, (BATCH, T), generator=g)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if self.watch is not None:
                self.watch.step(loss=loss)
        if record:
            self.times.append(time.perf_counter() - start)


def test_eval_passes_every_step(benchmark: Any, bench_report: list[str], monkeypatch: Any) -> None:
    torch.set_num_threads(1)
    monkeypatch.setattr(_allowance, "WINDOW_SECONDS", WINDOW)
    loops = [Loop(name) for name in ("baseline", "default", "unbudgeted", "eval_off")]
    cycles = 0

    def cycle() -> None:
        nonlocal cycles
        shift = cycles % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            loop.run(K, record=cycles >= WARMUP)
        cycles += 1

    benchmark.pedantic(cycle, rounds=CYCLES, iterations=1, warmup_rounds=0)
    base = loops[0].times
    lines = [
        f"eval passes every step ({GEN} tokens a step, {K} steps a cycle): ratio total, median ratio, skipped"
    ]
    for loop in loops[1:]:
        assert loop.watch is not None
        loop.watch.close()
        stats = loop.watch.statistics()
        assert stats.hook_errors == 0
        assert stats.steps == K * CYCLES
        total = sum(loop.times) / sum(base)
        median = statistics.median(t / b for t, b in zip(loop.times, base, strict=True))
        skipped = stats.skipped.get("eval_budget", 0)
        benchmark.extra_info[loop.name] = {"ratio_total": total, "ratio_median": median, "skipped": skipped}
        lines.append(f"  {loop.name:<11} {total:.3f}  {median:.3f}  {skipped} of {K * CYCLES * GEN} passes")
    default = loops[1].watch
    assert default is not None
    assert default.statistics().skipped.get("eval_budget", 0) > 0  # (the allowance did its job)
    bench_report.extend(lines)
