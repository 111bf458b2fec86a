"""Backward passes that build a graph (``create_graph=True``): a gradient penalty's
``torch.autograd.grad`` is not the step's backward, and its gradients stay out of the rows.

WGAN-GP and R1 take the gradient of the critic's output with respect to its input with
``torch.autograd.grad(..., create_graph=True)``, then ``loss.backward()`` runs through that graph: torch
fires the critic's output-gradient hooks in both passes. The rows hold the training backward's
gradients only; the penalty pass's are skipped and counted (``skipped["auxiliary_backward"]``). A
``backward(create_graph=True)`` (Hessian-based optimizers) adds to the parameters' gradients and is
recorded as any backward is.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey, StepRecord
from tests.test_observe_battery import assert_row
from tests.training import same_weights

STEPS = 3
LAYERS = ("0", "1", "2")
Outputs = dict[str, list[torch.Tensor]]


def _critic(device: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)


def _keep_outputs(model: nn.Sequential) -> tuple[Outputs, list[object]]:
    """Each layer's outputs of the step, their gradients kept (``retain_grad``), by layer name."""
    outputs: Outputs = {name: [] for name in LAYERS}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            output.retain_grad()
            outputs[name].append(output)

        return hook

    handles = [model[int(name)].register_forward_hook(keep(name)) for name in LAYERS]
    return outputs, handles


def _train(
    step: Callable[[nn.Module, Outputs, int], torch.Tensor],
    observe: bool,
    taps: tuple[str, ...] = (),
    device: str = "cpu",
) -> tuple[nn.Module, list[StepRecord], list[dict[str, torch.Tensor]], sw.Watch | None]:
    """``STEPS`` Adam steps of ``step``; per step each layer's output gradients of the training
    backward (those of the penalty pass set aside by ``step``), concatenated over the layer's calls."""
    model = _critic(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    records = sw.sinks.collect()
    kinds = ("activation", "output_grad", "param_grad", *taps)
    watch = sw.observe(model, opt, every=1, taps=kinds, sinks=[records]) if observe else None
    expected = []
    for k in range(STEPS):
        outputs, handles = _keep_outputs(model)
        opt.zero_grad()
        loss = step(model, outputs, k)
        for handle in handles:
            handle.remove()  # type: ignore[attr-defined]
        opt.step()
        expected.append(
            {
                name: torch.cat([o.grad for o in outs if o.grad is not None])
                for name, outs in outputs.items()
                if any(o.grad is not None for o in outs)
            }
        )
        if watch is not None:
            watch.step(loss=loss)
    if watch is not None:
        watch.close()
    return model, records.items, expected, watch


def _batch(k: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    real, fake, a = (
        torch.randn(5, 6, generator=g),
        torch.randn(5, 6, generator=g),
        torch.rand(5, 1, generator=g),
    )
    real, fake, a = real.to(device), fake.to(device), a.to(device)
    return real, fake, (a * real + (1 - a) * fake).requires_grad_()


def _wgan_gp(model: nn.Module, outputs: Outputs, k: int) -> torch.Tensor:
    """A WGAN-GP critic step: the penalty's gradient at a mix of real and fake samples."""
    real, fake, mix = _batch(k, _device(model))
    (grad,) = torch.autograd.grad(model(mix).sum(), mix, create_graph=True)
    for outs in outputs.values():
        for o in outs:
            o.grad = None  # the reference: the training backward's gradients only
    penalty = (grad.norm(dim=1) - 1).pow(2).mean()
    loss = model(fake).mean() - model(real).mean() + 10 * penalty
    loss.backward()
    return loss


def _hessian_style(model: nn.Module, outputs: Outputs, k: int) -> torch.Tensor:
    """A training backward that builds a graph, as AdaHessian and Sophia-H run it (a Hessian-vector
    product of the gradients follows in those; not here)."""
    real, _, _ = _batch(k)
    loss = model(real).pow(2).mean()
    params = list(model.parameters())
    loss.backward(create_graph=True, inputs=params)
    for p in params:
        p.grad = p.grad.detach()  # (breaks the cycle torch warns of)
    return loss


def _assert_output_grads(records: list[StepRecord], expected: list[dict[str, torch.Tensor]]) -> None:
    assert [r.step for r in records] == list(range(STEPS))
    for record, want in zip(records, expected, strict=True):
        keys = {record.keys[i] for i in record.rows("output_grad")}
        assert keys == {SeriesKey("train", name, "output_grad", "") for name in want}
        for name, grad in want.items():
            assert_row(record, SeriesKey("train", name, "output_grad", ""), grad, unit_dim=1)


def _device(model: nn.Module) -> str:
    return str(next(model.parameters()).device)


def check_penalty_pass(device: str) -> None:
    """Output gradients equal the training backward's alone (with the penalty pass's mixed in, the
    first layer counted 120 elements a step instead of 80); the penalty pass is counted once per
    hooked output it fired; training is bit for bit as unobserved. (``tests/test_cuda.py`` runs it on
    a GPU, where the hooks run on autograd's device thread.)"""
    plain, _, _, _ = _train(_wgan_gp, observe=False, device=device)
    model, records, expected, watch = _train(_wgan_gp, observe=True, device=device)
    assert same_weights(plain, model)
    _assert_output_grads(records, expected)
    # the mix's forward: its last output feeds only the penalty's autograd.grad (no row of the training
    # backward's), its other two outputs are reached by both passes
    assert [len(e["2"]) for e in expected] == [10] * STEPS
    assert [len(e["0"]) for e in expected] == [15] * STEPS
    assert watch is not None
    assert watch.statistics().skipped == {"auxiliary_backward": 3 * STEPS}
    assert watch.statistics().hook_errors == 0


def test_a_gradient_penaltys_pass_is_skipped_and_counted_the_training_backward_recorded() -> None:
    check_penalty_pass("cpu")


def test_an_inputs_gradient_in_the_penalty_pass_is_skipped_too() -> None:
    """With ``input_grad`` on, the mix's gradient (the leaf the penalty differentiates by) is recorded as
    the training backward leaves it, not with the penalty pass's added."""
    mixes: list[torch.Tensor] = []

    def step(model: nn.Module, outputs: Outputs, k: int) -> torch.Tensor:
        real, fake, mix = _batch(k)
        mixes.append(mix)
        (grad,) = torch.autograd.grad(model(mix).sum(), mix, create_graph=True)
        loss = model(fake).mean() - model(real).mean() + 10 * (grad.norm(dim=1) - 1).pow(2).mean()
        loss.backward()
        return loss

    _, records, _, watch = _train(step, observe=True, taps=("input_grad",))
    key = SeriesKey("train", "0", "input_grad", "0")
    for record, mix in zip(records, mixes, strict=True):
        assert mix.grad is not None
        assert_row(record, key, mix.grad)  # (only the mix needs a gradient among the first layer's inputs)
    assert watch is not None
    assert watch.statistics().skipped == {"auxiliary_backward": 6 * STEPS}  # 3 outputs, 3 inputs


@pytest.mark.filterwarnings(
    "ignore:Using backward\\(\\) with create_graph=True:UserWarning"
)  # (torch's, to the loop)
def test_a_training_backward_that_builds_a_graph_is_recorded() -> None:
    """``backward(create_graph=True)`` adds to the parameters' gradients: its output gradients are
    recorded as any backward's, and nothing is skipped."""
    plain, _, _, _ = _train(_hessian_style, observe=False)
    model, records, expected, watch = _train(_hessian_style, observe=True)
    assert same_weights(plain, model)
    _assert_output_grads(records, expected)
    assert watch is not None
    assert watch.statistics().skipped == {}
