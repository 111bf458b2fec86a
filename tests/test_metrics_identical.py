"""Every opt-in metric leaves training bit-identical: a small model with Dropout and BatchNorm (one of them
frozen with ``.eval()`` inside a model in training mode) trains 50 steps once without streamwatch and once
observed with one opt-in metric sampled several times, from the same seeds; afterwards every parameter,
buffer and ``.grad``, every module's ``training`` flag and the global RNG states (torch CPU, CUDA when
present, python ``random``, numpy) must be the same bits.

The metrics that run user code (an evaluation function, a loss closure) get functions that do what users
do: switch the model to ``eval()``, iterate a shuffling ``DataLoader`` (which draws from the global torch
RNG), draw from python's and numpy's generators, run the model in training mode (dropout masks, batch-norm
statistics) and even call ``backward()``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import streamwatch as sw

STEPS = 50
FEATURES, CLASSES, BATCH = 8, 4, 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny matrices on shared cores: two intra-op threads only wait for each other (~20× slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 24),
        nn.BatchNorm1d(24),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(24, 24),
        nn.BatchNorm1d(24),  # frozen below: its statistics must never move
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(24, CLASSES),
    )
    model.train()
    model[5].eval()
    return model


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


BATCHES = [_data(100 + k, BATCH) for k in range(STEPS)]
PROBE, _ = _data(7, 240)  # ≥ 10× the widest layer compared
X_EVAL, Y_EVAL = _data(8, 64)


# -- what users pass to the metrics that run their code ------------------------------------------------


def loss_in_eval_mode(m: nn.Module) -> torch.Tensor:
    """HessianMaxEig's loss as its docstring advises: eval mode, a fixed batch."""
    m.eval()
    return F.cross_entropy(m(X_EVAL), Y_EVAL)


def loss_in_train_mode(m: nn.Module) -> torch.Tensor:
    """A careless loss: dropout draws random masks, batch norm updates its running statistics."""
    return F.cross_entropy(m(X_EVAL), Y_EVAL)


def evaluate(m: nn.Module) -> dict[str, Any]:
    """TestAccuracy's function: eval mode, a shuffling DataLoader, python and numpy draws."""
    m.eval()
    random.random()
    np.random.rand()
    correct, total, loss = 0.0, 0, torch.zeros(())
    loader = DataLoader(TensorDataset(X_EVAL, Y_EVAL), batch_size=32, shuffle=True)
    with torch.no_grad():
        for x, y in loader:
            out = m(x)
            correct += float((out.argmax(-1) == y).sum())
            total += len(y)
            loss = loss + F.cross_entropy(out, y, reduction="sum")
    return {"accuracy": correct / total, "loss": loss / total}


def evaluate_carelessly(m: nn.Module) -> float:
    """An evaluation that stays in training mode and even back-propagates into ``.grad``."""
    out = m(X_EVAL)
    F.cross_entropy(out, Y_EVAL).backward()
    return float((out.argmax(-1) == Y_EVAL).float().mean())


# -- the cases --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    make: Callable[[], sw.metrics.Metric]
    produces: tuple[str, ...]  # extras' stat names or step scalars' names it writes


CASES: dict[str, Case] = {
    "GradientCosine": Case(lambda: sw.metrics.GradientCosine(every=7), ("cosine",)),
    "GradientCosine-update": Case(lambda: sw.metrics.GradientCosine(of="update", every=7), ("cosine",)),
    "SpectralNorm": Case(lambda: sw.metrics.SpectralNorm(every=7), ("spectral_norm",)),
    "ConditionNumber": Case(lambda: sw.metrics.ConditionNumber(every=7), ("condition_number",)),
    "Histogram": Case(
        lambda: sw.metrics.Histogram(kinds=("param_grad", "activation"), every=7), ("histogram",)
    ),
    "PNorm": Case(lambda: sw.metrics.PNorm(p=1, kinds=("activation",), every=7), ("norm_p1",)),
    "OptimizerState": Case(
        lambda: sw.metrics.OptimizerState(every=7), ("momentum_buffer_norm", "momentum_buffer_max")
    ),
    "ActivationSimilarity": Case(
        lambda: sw.metrics.ActivationSimilarity(PROBE, layers=["2", "6"], every=7), ("cca_similarity",)
    ),
    "HessianMaxEig": Case(
        lambda: sw.metrics.HessianMaxEig(loss_in_eval_mode, every=7, iterations=3), ("hessian_max_eig",)
    ),
    "HessianMaxEig-train-mode": Case(
        lambda: sw.metrics.HessianMaxEig(loss_in_train_mode, every=7, iterations=3), ("hessian_max_eig",)
    ),
    "TestAccuracy": Case(lambda: sw.metrics.TestAccuracy(evaluate, every=7), ("eval/accuracy", "eval/loss")),
    "TestAccuracy-careless": Case(
        lambda: sw.metrics.TestAccuracy(evaluate_carelessly, every=7), ("eval/accuracy",)
    ),
}


def test_every_opt_in_metric_has_a_case() -> None:
    opt_in = {
        name
        for name in sw.metrics.__all__
        if isinstance(getattr(sw.metrics, name), type)
        and issubclass(getattr(sw.metrics, name), sw.metrics.Metric)
        and name != "Metric"
    }
    assert opt_in <= {name.split("-")[0] for name in CASES}


# -- the harness ------------------------------------------------------------------------------------------


@dataclass
class State:
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    training: dict[str, bool]
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor]
    python_rng: Any
    numpy_rng: Any


def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def _train(metrics: Sequence[sw.metrics.Metric] | None) -> tuple[State, list[sw.StepRecord]]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    records = sw.sinks.collect()
    watch = (
        None
        if metrics is None
        else sw.observe(model, optimizer, metrics=list(metrics), sinks=[records], every=1)
    )
    _seed()
    for x, y in BATCHES:
        optimizer.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
        if watch is not None:
            watch.step(loss=loss, outputs=out, targets=y, batch_size=len(y))
    if watch is not None:
        watch.close()
        assert watch.statistics().hook_errors == 0
    state = State(
        params={name: p.detach().clone() for name, p in model.named_parameters()},
        buffers={name: b.clone() for name, b in model.named_buffers()},
        grads={n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        training={name: m.training for name, m in model.named_modules()},
        torch_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        python_rng=random.getstate(),
        numpy_rng=np.random.get_state(),
    )
    return state, list(records.items)


@functools.cache
def baseline() -> State:
    return _train(None)[0]


# every=7 samples steps 0, 7, ..., 49: the last step too, so the final ``.grad`` went through each metric


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_identical(got: State, want: State) -> None:
    assert got.training == want.training
    for field in ("params", "buffers", "grads"):
        mine, theirs = getattr(got, field), getattr(want, field)
        assert mine.keys() == theirs.keys()
        differ = [name for name in theirs if not same_bits(mine[name], theirs[name])]
        assert not differ, f"{field} differ: {differ}"
    assert torch.equal(got.torch_rng, want.torch_rng), "the torch CPU RNG state differs"
    assert len(got.cuda_rng) == len(want.cuda_rng)
    assert all(torch.equal(a, b) for a, b in zip(got.cuda_rng, want.cuda_rng, strict=True))
    assert got.python_rng == want.python_rng, "python's random state differs"
    assert all(np.array_equal(a, b) for a, b in zip(got.numpy_rng, want.numpy_rng, strict=True))


def _sampled_steps(records: list[sw.StepRecord], names: tuple[str, ...]) -> set[int]:
    return {
        r.step for r in records if any(stat in names for _, stat in r.extras) or set(names) & set(r.scalars)
    }


def test_the_baseline_is_deterministic() -> None:
    assert_identical(_train(None)[0], baseline())


def test_the_frozen_batch_norm_stays_frozen_without_streamwatch() -> None:
    state = baseline()
    assert state.training["5"] is False
    assert state.training["1"] is True
    assert int(state.buffers["5.num_batches_tracked"]) == 0
    assert int(state.buffers["1.num_batches_tracked"]) == STEPS


@pytest.mark.parametrize("name", list(CASES))
def test_training_is_bit_identical_with_the_metric(name: str) -> None:
    case = CASES[name]
    state, records = _train([case.make()])
    assert len(_sampled_steps(records, case.produces)) >= 3, f"{name} produced too few values"
    assert_identical(state, baseline())


def test_training_is_bit_identical_with_every_metric_together() -> None:
    state, records = _train([case.make() for case in CASES.values()])
    for name, case in CASES.items():
        assert len(_sampled_steps(records, case.produces)) >= 3, f"{name} produced too few values"
    assert_identical(state, baseline())
