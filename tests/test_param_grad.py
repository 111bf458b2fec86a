"""The parameter-gradient tap with an optimizer: every gradient is summarised in one pass at the optimizer's
pre-step hook — the gradient the optimizer applies (accumulated, clipped, unscaled by a GradScaler) —
or, on a sampled step whose optimizer step did not run, at ``watch.step()``. No parameter ever gets a
hook. Each value is checked against the tensor torch holds at that moment."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey
from tests.test_observe_battery import assert_row


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _grads(model: nn.Module) -> dict[SeriesKey, torch.Tensor]:
    out = {}
    for qualified, p in model.named_parameters():
        layer, _, name = qualified.rpartition(".")
        assert p.grad is not None
        out[SeriesKey("train", layer, "param_grad", name)] = p.grad.detach().clone()
    return out


def test_the_gradient_summarised_is_the_clipped_one_the_optimizer_applies() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    applied: list[dict[SeriesKey, torch.Tensor]] = []
    raw_norms = []
    g = torch.Generator().manual_seed(1)
    with sw.observe(model, opt, every=1, sinks=[records]) as watch:
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=g) * 30, torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            raw_norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)))
            applied.append(_grads(model))
            opt.step()
            watch.step(loss=loss)
        assert watch.flush()
    assert min(raw_norms) > 0.01  # clipping changed every step's gradients
    assert [r.step for r in records.items] == [0, 1, 2]
    for record, grads in zip(records.items, applied, strict=True):
        assert {record.keys[i] for i in record.rows("param_grad")} == set(grads)
        for key, grad in grads.items():
            assert_row(record, key, grad)
        total = sum(float(grad.double().pow(2).sum()) for grad in grads.values()) ** 0.5
        assert abs(total - 0.01) < 1e-6  # the clipped norm, not the raw one


def test_a_grad_scaler_step_is_summarised_unscaled_and_a_skipped_one_at_the_boundary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``GradScaler.step`` unscales before ``optimizer.step``: the rows hold the real gradient, not the
    scaled one. A step with an inf is skipped (no optimizer step): its gradients are summarised at
    ``watch.step()`` instead, infs counted, so the sampled step still shows them."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    records = sw.sinks.collect()
    seen: list[dict[SeriesKey, torch.Tensor]] = []
    g = torch.Generator().manual_seed(2)
    with (
        caplog.at_level(logging.WARNING, "streamwatch"),
        sw.observe(model, opt, every=1, stats=("nonfinite",), sinks=[records]) as watch,
    ):
        for step in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if step == 1:
                bias = model[2].bias.grad
                assert bias is not None
                bias[0] = float("inf")  # the scaler finds it and skips this optimizer step
            scaler.step(opt)
            seen.append(_grads(model))  # unscaled in place by the scaler, skipped or not
            scaler.update()
            watch.step(loss=loss)
        assert watch.flush()
        first = watch.statistics().first_nonfinite
    assert first is not None
    assert (first.step, first.layer, first.kind, first.param) == (1, "2", "param_grad", "bias")
    assert scaler.get_scale() == 512.0  # step 1 was skipped (and the scale halved)
    assert "param_grad of layer '2' (param 'bias'" in caplog.text  # warned once, with the origin
    for record, grads in zip(records.items, seen, strict=True):
        for key, grad in grads.items():
            assert_row(record, key, grad, counted=True)
    bad = records.items[1]
    (row,) = [i for i in bad.rows("param_grad") if bad.keys[i].layer == "2" and bad.keys[i].name == "bias"]
    assert bad.column("nonfinite")[row] == 1


def test_gradients_take_their_place_in_the_backward_order() -> None:
    """Summarised together before the optimizer step, each parameter's gradient row is placed where
    autograd produced it: after the gradient w.r.t. its own module's output, before the next one's."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    with sw.observe(
        model, opt, every=1, taps=("activation", "output_grad", "param_grad"), sinks=[records]
    ) as w:
        loss = nn.functional.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,)))
        loss.backward()
        opt.step()
        w.step(loss=loss)
        assert w.flush()
    (record,) = records.items
    ran = [(k.layer, k.kind, k.name) for k in (record.keys[i] for i in record.execution_order().argsort())]
    assert ran == [
        ("0", "activation", ""),
        ("1", "activation", ""),
        ("2", "activation", ""),
        ("2", "output_grad", ""),
        ("2", "param_grad", "bias"),
        ("2", "param_grad", "weight"),
        ("1", "output_grad", ""),
        ("0", "output_grad", ""),
        ("0", "param_grad", "bias"),
        ("0", "param_grad", "weight"),
    ]


@pytest.mark.parametrize("every", [1, 2])
def test_without_an_optimizer_a_layer_frozen_and_unfrozen_mid_run_is_followed(every: int) -> None:
    """Without an optimizer each parameter's gradient is read by its own hook, which torch refuses on a
    tensor that requires none: freezing a layer mid-run (a fine-tuning schedule) made the next step's
    arming raise into ``watch.step()``, and a layer unfrozen later was never recorded."""
    model = _mlp()
    first = model[0].weight
    records = sw.sinks.collect()
    expected: dict[int, dict[SeriesKey, torch.Tensor]] = {}
    g = torch.Generator().manual_seed(3)
    with sw.observe(model, every=every, sinks=[records]) as watch:
        for step in range(8):
            if step == 1:
                first.requires_grad_(False)
                first.grad = None
            if step == 4:
                first.requires_grad_(True)
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            expected[step] = {
                key: grad
                for key, grad in (
                    (SeriesKey("train", q.rpartition(".")[0], "param_grad", q.rpartition(".")[2]), p.grad)
                    for q, p in model.named_parameters()
                )
                if grad is not None
            }
            watch.step(loss=1.0)
        assert watch.flush()
        assert watch.statistics().hook_errors == 0
    weight = SeriesKey("train", "0", "param_grad", "weight")
    sampled = [r for r in records.items if r.rows("param_grad")]
    assert [r.step for r in sampled] == list(range(0, 8, every))
    for record in sampled:
        keys = {record.keys[i] for i in record.rows("param_grad")}
        assert keys <= set(expected[record.step]), record.step
        # unfrozen within this step: its hook may go in only at the step's end (the boundary arms them)
        assert set(expected[record.step]) - keys <= ({weight} if record.step == 4 else set()), record.step
        for key in keys:
            assert_row(record, key, expected[record.step][key])
    assert all(weight in {r.keys[i] for i in r.rows("param_grad")} for r in sampled if r.step > 4)


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def test_a_fused_optimizer_under_a_grad_scaler_is_summarised_unscaled() -> None:
    """A fused optimizer unscales inside its kernel (``GradScaler`` hands it ``grad_scale``): the
    gradients at its pre-step hook are still scaled, and were summarised 1024× too large."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    records = sw.sinks.collect()
    seen: list[dict[SeriesKey, torch.Tensor]] = []
    g = torch.Generator().manual_seed(4)
    with sw.observe(model, opt, every=1, sinks=[records]) as watch:
        for _ in range(2):
            x, y = _batch(g)
            opt.zero_grad()
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            scale = scaler.get_scale()
            seen.append({key: grad / scale for key, grad in _grads(model).items()})
            scaler.step(opt)
            scaler.update()
            watch.step(loss=1.0)
        assert watch.flush()
    assert scale == 1024.0  # no overflow: the scale stayed
    for record, grads in zip(records.items, seen, strict=True):
        assert {record.keys[i] for i in record.rows("param_grad")} == set(grads)
        for key, grad in grads.items():
            assert_row(record, key, grad)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_step_a_grad_scaler_skips_has_no_update_rows(fused: bool) -> None:
    """An overflow: ``GradScaler`` skips the step. A plain optimizer's ``step()`` is then not called (its
    hooks do not run: no update row). A fused one's is, with ``found_inf`` set, and its kernel changes
    nothing: its update rows were 0, so the layers' update/weight ratio read 0 and
    ``update_ratio_out_of_band`` -inf. Steps without an overflow keep their rows, equal to the change
    of the weights."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    overflow = {"on": False}
    model[0].weight.register_hook(lambda grad: grad * math.inf if overflow["on"] else grad)
    records = sw.sinks.collect()
    g = torch.Generator().manual_seed(4)
    changed: list[bool] = []
    with sw.observe(model, opt, every=1, cadence={"update": 1}, sinks=[records]) as watch:
        for step in range(3):
            overflow["on"] = step == 1
            before = [p.detach().clone() for p in model.parameters()]
            x, y = _batch(g)
            opt.zero_grad()
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            changed.append(
                any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            )
            watch.step(loss=1.0)
        assert watch.flush()
    assert changed == [True, False, True]  # the overflow step left every weight as it was
    updates = [len(record.rows("update")) for record in records.items]
    assert updates == [4, 0, 4]
    assert all(key not in records.items[1].scalars for key in ("_skipped_update",))  # (internal only)


def test_an_optimizer_with_a_closure_is_summarised_after_the_closure() -> None:
    """LBFGS computes the gradients inside ``step(closure)``: read at its pre-step hook, the rows held
    the previous step's last gradient (and none at step 0); its updates are there, though no parameter
    had a gradient when the step began."""
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    records = sw.sinks.collect()
    last: list[dict[SeriesKey, torch.Tensor]] = []  # each step's last closure's gradients
    g = torch.Generator().manual_seed(5)
    deltas: list[dict[str, torch.Tensor]] = []
    with sw.observe(model, opt, every=1, cadence={"update": 1}, sinks=[records]) as watch:
        for _ in range(3):
            x, y = _batch(g)
            mine: dict[SeriesKey, torch.Tensor] = {}
            opt.zero_grad(set_to_none=True)  # (no gradient before the step: the closure makes them)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}

            def closure(x: torch.Tensor = x, y: torch.Tensor = y, mine: dict = mine) -> torch.Tensor:  # type: ignore[type-arg]
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                mine.clear()
                mine.update(_grads(model))
                return loss

            opt.step(closure)
            last.append(mine)
            deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
            watch.step(loss=1.0)
        assert watch.flush()
    for record, grads, delta in zip(records.items, last, deltas, strict=True):
        assert {record.keys[i] for i in record.rows("param_grad")} == set(grads)
        for key, grad in grads.items():
            assert_row(record, key, grad)
        assert {f"{record.keys[i].layer}.{record.keys[i].name}" for i in record.rows("update")} == set(delta)
        for i in record.rows("update"):
            assert_row(record, record.keys[i], delta[f"{record.keys[i].layer}.{record.keys[i].name}"])


def test_rows_of_parameters_the_optimizer_does_not_step() -> None:
    """Two optimizers, only the first observed, and a frozen layer in the first's group: updates are
    those of the parameters the observed optimizer steps (a frozen layer's Δ of 0 made its update
    ratio -inf and fired the out-of-band alert; a second optimizer's, read around the first's step,
    a false 0); the other optimizer's weights are read at ``watch.step()``, after its step, and its
    gradients at the observed optimizer's pre-step hook (a loop may zero them before watch.step())."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)  # frozen, in the first optimizer's group all the same (no gradient)
    first = torch.optim.SGD([*model[0].parameters(), *model[2].parameters()], lr=0.1)
    second = torch.optim.SGD(model[4].parameters(), lr=0.1)
    records = sw.sinks.collect()
    steps: list[tuple[dict[SeriesKey, torch.Tensor], dict[SeriesKey, torch.Tensor], dict[str, torch.Tensor]]]
    steps = []
    g = torch.Generator().manual_seed(6)
    cadence = {"param": 1, "update": 1, "param_grad": 1}
    with sw.observe(model, first, every=1, cadence=cadence, sinks=[records]) as watch:
        for _ in range(3):
            x, y = _batch(g)
            first.zero_grad()
            second.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = _grads_present(model)
            first.step()
            second.step()
            steps.append((grads, before, {n: p.detach().clone() for n, p in model.named_parameters()}))
            first.zero_grad()  # (zeroed before watch.step(), as many loops do)
            second.zero_grad()
            watch.step(loss=1.0)
        assert watch.flush()
    for record, (grads, before, after) in zip(records.items, steps, strict=True):
        assert {record.keys[i] for i in record.rows("param_grad")} == set(grads)
        for key, grad in grads.items():
            assert_row(record, key, grad)
        updates = {record.keys[i] for i in record.rows("update")}
        assert {f"{k.layer}.{k.name}" for k in updates} == {"2.weight", "2.bias"}
        for key in updates:
            name = f"{key.layer}.{key.name}"
            assert_row(record, key, after[name] - before[name])
        params = {record.keys[i] for i in record.rows("param")}
        assert {f"{k.layer}.{k.name}" for k in params} == set(after)
        for key in params:
            assert_row(record, key, after[f"{key.layer}.{key.name}"])


def _grads_present(model: nn.Module) -> dict[SeriesKey, torch.Tensor]:
    out = {}
    for qualified, p in model.named_parameters():
        if p.grad is not None:
            layer, _, name = qualified.rpartition(".")
            out[SeriesKey("train", layer, "param_grad", name)] = p.grad.detach().clone()
    return out


def test_a_plain_step_is_read_around_the_step_even_when_a_hook_zeroes_the_gradients_after_it() -> None:
    """torch hands the step hooks the optimizer as their first argument: every step looked like one with
    a closure, so its gradients were read after the step, and a post-step hook (registered before
    observe()) that zeroes them left the step without gradient and update rows."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.register_step_post_hook(lambda o, args, kwargs: o.zero_grad())
    records = sw.sinks.collect()
    seen: list[tuple[dict[SeriesKey, torch.Tensor], dict[str, torch.Tensor]]] = []
    g = torch.Generator().manual_seed(9)
    with sw.observe(model, opt, every=1, cadence={"update": 1}, sinks=[records]) as watch:
        for _ in range(2):
            x, y = _batch(g)
            nn.functional.cross_entropy(model(x), y).backward()
            grads = _grads(model)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            seen.append((grads, {n: p.detach() - before[n] for n, p in model.named_parameters()}))
            watch.step(loss=1.0)
        assert watch.flush()
    for record, (grads, delta) in zip(records.items, seen, strict=True):
        assert {record.keys[i] for i in record.rows("param_grad")} == set(grads)
        for key, grad in grads.items():
            assert_row(record, key, grad)
        assert len(record.rows("update")) == len(delta)
        for i in record.rows("update"):
            assert_row(record, record.keys[i], delta[f"{record.keys[i].layer}.{record.keys[i].name}"])
