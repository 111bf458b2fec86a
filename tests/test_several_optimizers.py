"""Several optimizers under one watch (``observe(model, [muon, adamw])``): each parameter is read around
the step of the optimizer that steps it, the learning rates are numbered across them, the opt-in metrics
see every optimizer's step, training is untouched. Every value is checked against the tensors torch
holds at that moment (``assert_row``), or the optimizers' own state."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey, StepRecord
from tests.test_observe_battery import assert_row
from tests.training import same_weights

Snapshot = dict[str, torch.Tensor]
CADENCE = {"param": 1, "update": 1, "param_grad": 1}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 5))


def _muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's recipe for Muon: the hidden weight matrices by Muon, the embedding, biases and the rest by
    AdamW (``torch.optim.Muon`` takes 2-D parameters only)."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("0.")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and not n.startswith("0."))]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randint(0, 20, (6, 3), generator=g), torch.randint(0, 5, (6,), generator=g)


def _clone(model: nn.Module, grads: bool = False) -> Snapshot:
    return {
        n: (p.grad if grads else p).detach().clone()
        for n, p in model.named_parameters()
        if not grads or p.grad is not None
    }


def _key(kind: str, qualified: str) -> SeriesKey:
    layer, _, name = qualified.rpartition(".")
    return SeriesKey("train", layer, kind, name)


def _train(
    steps: int,
    watch_with: Callable[[nn.Module, list[torch.optim.Optimizer]], sw.Watch] | None,
    skip: Callable[[int], bool] = lambda k: False,
) -> tuple[nn.Module, list[tuple[Snapshot, Snapshot, Snapshot, set[str]]], list[list[float]]]:
    """Muon with AdamW (its rate halved every 2 steps) for ``steps`` steps, AdamW's step left out where
    ``skip(k)``; per step the gradients applied, the weights before and after the optimizers' steps, the
    parameters stepped, and the learning rates at ``watch.step()``."""
    model = _model()
    optimizers = _muon_and_adamw(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizers[1], step_size=2, gamma=0.5)
    watch = None if watch_with is None else watch_with(model, optimizers)
    seen, lrs = [], []
    for k in range(steps):
        x, y = _batch(k)
        for opt in optimizers:
            opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads, before = _clone(model, grads=True), _clone(model)
        stepped = optimizers[:1] if skip(k) else optimizers
        for opt in stepped:
            opt.step()
        if not skip(k):
            scheduler.step()
        ids = {id(p) for opt in stepped for group in opt.param_groups for p in group["params"]}
        seen.append((grads, before, _clone(model), {n for n, p in model.named_parameters() if id(p) in ids}))
        lrs.append([group["lr"] for opt in optimizers for group in opt.param_groups])
        if watch is not None:
            watch.step(loss=loss)
    if watch is not None:
        watch.close()
    return model, seen, lrs


def test_muon_with_adamw_every_parameter_is_read_around_its_own_optimizers_step() -> None:
    """Every gradient, update and weight equals torch's, updates for both optimizers' parameters (with
    one observed, AdamW's had none); learning rates ``lr/0`` (Muon) and ``lr/1`` (AdamW, decayed by its
    scheduler); training bit for bit as unobserved."""
    records = sw.sinks.collect()
    plain, _, _ = _train(5, None)
    model, seen, lrs = _train(5, lambda m, o: sw.observe(m, o, every=1, cadence=CADENCE, sinks=[records]))
    assert same_weights(plain, model)
    assert [r.step for r in records.items] == [0, 1, 2, 3, 4]
    assert lrs == [[0.02, 3e-3], [0.02, 1.5e-3], [0.02, 1.5e-3], [0.02, 7.5e-4], [0.02, 7.5e-4]]
    for record, (grads, before, after, stepped), want in zip(records.items, seen, lrs, strict=True):
        assert [record.scalars["lr/0"], record.scalars["lr/1"]] == want
        assert "lr/2" not in record.scalars
        _assert_rows(record, grads, before, after, stepped)


def _assert_rows(
    record: StepRecord, grads: Snapshot, before: Snapshot, after: Snapshot, stepped: set[str]
) -> None:
    assert {record.keys[i] for i in record.rows("param_grad")} == {_key("param_grad", n) for n in grads}
    for name, grad in grads.items():
        assert_row(record, _key("param_grad", name), grad)
    assert {record.keys[i] for i in record.rows("update")} == {_key("update", n) for n in stepped}
    for name in stepped:
        assert_row(record, _key("update", name), after[name] - before[name])
    assert {record.keys[i] for i in record.rows("param")} == {_key("param", n) for n in after}
    for name, weight in after.items():
        assert_row(record, _key("param", name), weight)


def test_a_step_one_optimizer_skips_has_its_parameters_read_at_the_steps_end() -> None:
    """AdamW left out on odd steps (a GAN's generator every other step): its parameters have no update
    row then, their gradients and weights are read at ``watch.step()``; Muon's are read at its hooks."""
    records = sw.sinks.collect()
    skip = lambda k: k % 2 == 1  # noqa: E731
    _, seen, _ = _train(4, lambda m, o: sw.observe(m, o, every=1, cadence=CADENCE, sinks=[records]), skip)
    assert [len(stepped) for *_, stepped in seen] == [5, 2, 5, 2]
    for record, (grads, before, after, stepped) in zip(records.items, seen, strict=True):
        _assert_rows(record, grads, before, after, stepped)


def test_a_gans_halves_each_read_at_their_own_step() -> None:
    """The discriminator steps first; the generator's backward then adds to the discriminator's gradients
    (as in most GAN loops). Each half's gradient row is the one its own optimizer applied, each update
    its own step's Δ, and training is bit for bit as unobserved."""

    def gan(observe: bool) -> tuple[nn.Module, list[tuple[Snapshot, Snapshot, Snapshot]], list[StepRecord]]:
        torch.manual_seed(0)
        model = nn.ModuleDict(
            {
                "G": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6)),
                "D": nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)),
            }
        )
        opt_g = torch.optim.Adam(model["G"].parameters(), lr=1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(model["D"].parameters(), lr=1e-3, betas=(0.5, 0.999))
        records = sw.sinks.collect()
        watch = (
            sw.observe(model, [opt_d, opt_g], every=1, cadence=CADENCE, sinks=[records]) if observe else None
        )
        seen = []
        for k in range(3):
            g = torch.Generator().manual_seed(k)
            z, real = torch.randn(5, 4, generator=g), torch.randn(5, 6, generator=g)
            opt_d.zero_grad()
            fake = model["G"](z)
            loss_d = F.softplus(-model["D"](real)).mean() + F.softplus(model["D"](fake.detach())).mean()
            loss_d.backward()
            grads, before = _clone(model["D"], grads=True), _clone(model)
            opt_d.step()
            opt_g.zero_grad()
            loss_g = F.softplus(-model["D"](fake)).mean()
            loss_g.backward()
            grads_g = _clone(model["G"], grads=True)
            opt_g.step()
            grads = {**{f"D.{n}": t for n, t in grads.items()}, **{f"G.{n}": t for n, t in grads_g.items()}}
            seen.append((grads, before, _clone(model)))
            if watch is not None:
                watch.step(loss=loss_g)
        if watch is not None:
            watch.close()
        return model, seen, records.items

    plain, _, _ = gan(False)
    model, seen, items = gan(True)
    assert same_weights(plain, model)
    assert len(items) == 3
    for record, (grads, before, after) in zip(items, seen, strict=True):
        _assert_rows(record, grads, before, after, set(after))
        assert record.scalars["lr/0"] == record.scalars["lr/1"] == 1e-3


def test_the_opt_in_metrics_see_every_optimizers_step() -> None:
    """``OptimizerState`` reads each parameter's state from the optimizer that holds it (Muon's momentum
    buffer, AdamW's moments); ``GradientCosine(of="update")`` compares whole steps' updates, Muon's and
    AdamW's together (called per optimizer it would have read half of each step's Δ as 0)."""
    records = sw.sinks.collect()
    metrics = [sw.metrics.OptimizerState(), sw.metrics.GradientCosine(of="update")]
    references: list[dict[tuple[str, str], float]] = []
    deltas: list[Snapshot] = []

    def observe(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> sw.Watch:
        return sw.observe(model, optimizers, every=1, metrics=metrics, sinks=[records])

    model = _model()
    optimizers = _muon_and_adamw(model)
    watch = observe(model, optimizers)
    for k in range(4):
        x, y = _batch(k)
        for opt in optimizers:
            opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = _clone(model)
        for opt in optimizers:
            opt.step()
        deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
        ref = {}
        for name, p in model.named_parameters():
            state = next(o.state[p] for o in optimizers if p in o.state)
            for moment in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if moment in state:
                    ref[(name, f"{moment}_norm")] = float(state[moment].double().norm())
                    ref[(name, f"{moment}_max")] = float(state[moment].double().abs().max())
        references.append(ref)
        watch.step()
    watch.close()
    for step, record in enumerate(records.items):
        got = {
            (f"{key.layer}.{key.name}", stat): float(np.asarray(v).item())
            for (key, stat), v in record.extras.items()
        }
        want = dict(references[step])
        if step:
            for name, delta in deltas[step].items():
                previous = deltas[step - 1][name].double().flatten()
                want[(name, "cosine")] = float(F.cosine_similarity(delta.double().flatten(), previous, dim=0))
        assert got.keys() == want.keys(), step
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    stats = {stat for record in records.items for (_, stat) in record.extras}
    assert {"momentum_buffer_norm", "exp_avg_sq_max", "cosine"} <= stats


def test_under_the_governor_every_steps_learning_rates_come_from_both() -> None:
    """The quiet steps' log (no hooks in) reads every optimizer's rates as well: one entry per step."""
    records = sw.sinks.collect()
    _, _, lrs = _train(30, lambda m, o: sw.observe(m, o, sinks=[records]))
    steps = [s for r in records.items for s in r.every_step()]
    assert [s.step for s in steps] == list(range(30))
    assert [[s.scalars["lr/0"], s.scalars["lr/1"]] for s in steps] == lrs
    assert sum(1 for r in records.items if r.keys) < 30  # (most steps were quiet)


def test_a_list_that_is_not_optimizers_is_refused_saying_where() -> None:
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"`optimizer\[1\]` to be a torch.optim.Optimizer, got None"):
        sw.observe(model, [adamw, None])
    with pytest.raises(TypeError, match=r"`optimizer\[0\]`: Expected .* got a str: 'adam'"):
        sw.observe(model, ["adam"])
    with pytest.raises(ValueError, match=r"`optimizer\[1\]` \(AdamW\) is in the list twice"):
        sw.observe(model, (adamw, adamw))
    with pytest.raises(TypeError, match=r"got a dict: \{'lr': 0.1\}"):
        sw.observe(model, {"lr": 0.1})
    for refused in ([adamw, None], (adamw, adamw)):
        with pytest.raises((TypeError, ValueError)):
            sw.observe(model, refused)
    with sw.observe(model, [adamw]) as watch:  # nothing left attached by the refusals
        watch.step()


def test_an_optimizer_of_another_model_in_the_list_is_warned_about_by_position() -> None:
    model = _model()
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"`optimizer\[1\]` \(SGD, 2 parameters\) steps none of"):
        watch = sw.observe(model, [torch.optim.AdamW(model.parameters()), other])
    watch.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw.observe(model, [torch.optim.AdamW(model.parameters())]).close()


def test_lightning_optimizers_in_the_list_are_read_when_the_optimizers_they_wrap_step() -> None:
    """``self.optimizers()`` in a LightningModule gives ``LightningOptimizer``s, which share the wrapped
    optimizer's state (its hook tables too) but are other objects: a list of them observes the steps the
    loop makes on the optimizers inside."""
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    records = sw.sinks.collect()

    def observe(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> sw.Watch:
        wrapped = [LightningOptimizer(opt) for opt in optimizers]
        return sw.observe(model, wrapped, every=1, cadence=CADENCE, sinks=[records])

    _, seen, lrs = _train(3, observe)
    for record, (grads, before, after, stepped), want in zip(records.items, seen, lrs, strict=True):
        _assert_rows(record, grads, before, after, stepped)
        assert [record.scalars["lr/0"], record.scalars["lr/1"]] == want


def _swap_run(
    every: int | None, swap: bool, second: bool = False, foreign_model: bool = False
) -> tuple[list[warnings.WarningMessage], dict[str, int], list[StepRecord], nn.Module]:
    """12 steps of SGD under a watch; with ``swap`` the loop makes an Adam at step 4 and steps only it
    from then on; with ``second`` a second SGD, not observed, steps the last layer too; with
    ``foreign_model`` an optimizer of another model steps alongside."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model[0].parameters() if second else model.parameters(), lr=0.1)
    other = torch.optim.SGD(model[2].parameters(), lr=0.1) if second else None
    elsewhere = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1) if foreign_model else None
    records = sw.sinks.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sw.observe(model, opt, every=every, cadence={"update": 1}, sinks=[records]) as watch:
            for k in range(12):
                if swap and k == 4:
                    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                g = torch.Generator().manual_seed(k)
                model.zero_grad()
                model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
                for each in (opt, other, elsewhere):
                    if each is not None:
                        each.step()
                watch.step()
    ours = [w for w in caught if "streamwatch" in str(w.message)]
    return ours, dict(watch.statistics().skipped), records.items, model


@pytest.mark.parametrize("every", [1, None], ids=["every1", "governor"])
def test_an_optimizer_made_mid_run_is_warned_about_once_and_counted(every: int | None) -> None:
    """The loop replaces its optimizer at step 4: the watch still reads the old one's learning rate, and
    no update is recorded. That is warned about once, at the user's ``watch.step()`` line, and each
    sampled step after it is counted; training is as unobserved."""
    caught, skipped, records, model = _swap_run(every, swap=True)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "does not observe (Adam) stepped the model's parameters and the observed one(s) (SGD)" in str(
        caught[0].message
    )
    assert caught[0].filename == __file__
    assert caught[0].category is RuntimeWarning
    sampled_after = [r.step for r in records if r.keys and r.step >= 4]
    assert skipped["unobserved_optimizer"] == len(sampled_after) >= 1
    if every == 1:
        assert skipped["unobserved_optimizer"] == 8
    assert not any(r.rows("update") for r in records if r.step >= 4)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt: torch.optim.Optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for k in range(12):
        if k == 4:
            opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
        plain.zero_grad()
        plain(torch.randn(5, 4, generator=torch.Generator().manual_seed(k))).pow(2).mean().backward()
        opt.step()
    assert same_weights(plain, model)


def test_a_second_optimizer_not_passed_is_counted_not_warned_and_another_models_is_neither() -> None:
    """A second optimizer stepping the model alongside the observed one (documented: its parameters have
    no update rows) is counted on each sampled step, not warned about; an optimizer of another model is
    not counted at all, and neither is anything without an observed optimizer."""
    caught, skipped, _, _ = _swap_run(1, swap=False, second=True)
    assert caught == []
    assert skipped["unobserved_optimizer"] == 12
    caught, skipped, _, _ = _swap_run(1, swap=False, foreign_model=True)
    assert caught == []
    assert "unobserved_optimizer" not in skipped
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, every=1) as watch:
        for _ in range(3):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            watch.step()
    assert "unobserved_optimizer" not in watch.statistics().skipped


def test_fused_optimizers_under_a_grad_scaler_a_step_either_skipped_has_no_update_rows() -> None:
    """Two fused Adams under one ``GradScaler``; at step 1 only the first one's gradients hold an inf, so
    the scaler skips its step inside the kernel (its weights do not move) and the second steps. That
    step's update rows are dropped, all of them (the flags stay on the device: which rows are whose is not
    read there): the first optimizer's Δ of 0 is no update. Steps 0 and 2 have every update row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    first = torch.optim.Adam(model[0].parameters(), lr=1e-2, fused=True)
    second = torch.optim.Adam(model[2].parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    records = sw.sinks.collect()
    moved = []
    with sw.observe(model, [first, second], every=1, cadence=CADENCE, sinks=[records]) as watch:
        for k in range(3):
            model.zero_grad()
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(k))
            scaler.scale(model(x).pow(2).mean()).backward()
            if k == 1:
                model[0].weight.grad[0, 0] = float("inf")
            before = _clone(model)
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            moved.append({n for n, p in model.named_parameters() if not torch.equal(p, before[n])})
            watch.step()
    every = {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert moved == [every, {"2.weight", "2.bias"}, every]
    updates = [{f"{k.layer}.{k.name}" for k in r.keys if k.kind == "update"} for r in records.items]
    assert updates == [moved[0], set(), moved[2]]


def test_no_hook_is_left_on_the_optimizers_or_torchs_global_table() -> None:
    """The global pre-step hook (an unobserved optimizer) is in only on the steps whose hooks are in,
    and ``close()`` takes it and every optimizer's hooks out: nothing keeps the watch alive or runs."""
    from torch.optim.optimizer import _global_optimizer_post_hooks as global_post_hooks
    from torch.optim.optimizer import _global_optimizer_pre_hooks as global_hooks

    before, before_post = len(global_hooks), len(global_post_hooks)
    model = nn.Linear(3, 2)
    first, second = torch.optim.SGD([model.weight], lr=0.1), torch.optim.Adam([model.bias])
    watch = sw.observe(model, [first, second], every=3)
    inside = []
    for _ in range(4):
        inside.append(len(global_hooks) - before)
        assert (
            len(global_post_hooks) - before_post == inside[-1]
        )  # (the stand-in's end: _any_optimizer_stepped)
        model(torch.ones(2, 3)).sum().backward()
        first.step()
        second.step()
        watch.step()
    watch.close()
    assert inside == [1, 0, 0, 1]  # (steps 0 and 3 are sampled)
    assert len(global_hooks) == before
    assert len(global_post_hooks) == before_post
    for opt in (first, second):
        assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 0


@pytest.mark.parametrize("every", [1, None])
def test_a_param_group_added_mid_run_is_read_from_then_on(every: int | None) -> None:
    """Progressive unfreezing: the embedding frozen and left out of AdamW, then unfrozen and handed to it
    with ``add_param_group`` at step 3 (as gradual-unfreezing recipes do). From then on its gradient,
    update and weight rows equal torch's, its group's rate is ``lr/1`` on every step (the quiet ones
    too), and training is bit for bit as unobserved."""

    def run(
        observe: bool,
    ) -> tuple[nn.Module, list[tuple[Snapshot, Snapshot, Snapshot, set[str]]], list[StepRecord]]:
        model = _model()
        model[0].requires_grad_(False)
        opt = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("0.")], lr=3e-3)
        records = sw.sinks.collect()
        watch = sw.observe(model, opt, every=every, cadence=CADENCE, sinks=[records]) if observe else None
        seen = []
        for k in range(6):
            if k == 3:
                model[0].requires_grad_(True)
                opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
            x, y = _batch(k)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            grads, before = _clone(model, grads=True), _clone(model)
            opt.step()
            stepped = {
                n
                for n, p in model.named_parameters()
                if any(p is q for g in opt.param_groups for q in g["params"])
            }
            seen.append((grads, before, _clone(model), stepped))
            if watch is not None:
                watch.step(loss=loss)
        if watch is not None:
            watch.close()
        return model, seen, records.items

    plain, _, _ = run(False)
    model, seen, items = run(True)
    assert same_weights(plain, model)
    assert [len(stepped) for *_, stepped in seen] == [4, 4, 4, 5, 5, 5]
    steps = [s for r in items for s in r.every_step()]
    assert [s.step for s in steps] == list(range(6))
    assert [sorted(k for k in s.scalars if k.startswith("lr/")) for s in steps] == [["lr/0"]] * 3 + [
        ["lr/0", "lr/1"]
    ] * 3
    assert [s.scalars.get("lr/1") for s in steps] == [None] * 3 + [1e-3] * 3
    for record in items:
        if record.keys:  # (a sampled step)
            _assert_rows(record, *seen[record.step])


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as its reference implementation (davda54/sam) writes it: a wrapper
    sharing its ``base_optimizer``'s param groups, stepped as ``first_step`` (to the worst nearby point)
    and ``second_step`` (back, then the base optimizer's step with the gradient taken there), or as
    ``step(closure)``. ``seen`` keeps the gradients and weights just before the base step."""

    def __init__(
        self, params: Any, base: type[torch.optim.Optimizer], rho: float = 0.05, **kwargs: Any
    ) -> None:
        super().__init__(params, {"rho": rho, **kwargs})
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.seen: list[tuple[Snapshot, Snapshot]] = []
        self.model: nn.Module | None = None

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * (group["rho"] / (norm + 1e-12)))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        assert self.model is not None
        self.seen.append((_clone(self.model, grads=True), _clone(self.model)))
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        with torch.enable_grad():
            self.first_step(zero_grad=True)
            closure()
        self.second_step()


@pytest.mark.parametrize("usage", ["two_steps", "closure"])
def test_sams_base_optimizer_stands_in_for_it_when_it_steps_outside_sams_step(usage: str) -> None:
    """SAM's ``first_step``/``second_step`` never call SAM's own ``step``: observed as given, its
    parameter gradients and updates were not recorded, silently (its base optimizer shares its groups,
    so it was not counted as another optimizer either). Now the base optimizer's step stands in for it:
    the gradient it applies (taken at the perturbed point) and its update are recorded, equal to torch's.
    With ``step(closure)`` SAM's own hooks read the step as a whole, the gradient after it as with any
    closure: the same values. Training is bit for bit as unobserved."""

    def run(observe: bool) -> tuple[nn.Module, _SAM, list[StepRecord]]:
        model = _model()
        opt = _SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        opt.model = model
        records = sw.sinks.collect()
        watch = sw.observe(model, opt, every=1, cadence=CADENCE, sinks=[records]) if observe else None
        for k in range(3):
            x, y = _batch(k)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if usage == "two_steps":
                opt.first_step(zero_grad=True)
                F.cross_entropy(model(x), y).backward()
                opt.second_step(zero_grad=True)
            else:
                opt.step(lambda x=x, y=y: F.cross_entropy(model(x), y).backward())
                opt.zero_grad()
            if watch is not None:
                watch.step(loss=loss)
        if watch is not None:
            watch.close()
            assert watch.statistics().skipped == {}
        return model, opt, records.items

    plain, _, _ = run(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt, items = run(True)
    assert same_weights(plain, model)
    assert [r.step for r in items] == [0, 1, 2]
    afters = [before for _, before in opt.seen[1:]] + [_clone(model)]
    for record, (grads, before), after in zip(items, opt.seen, afters, strict=True):
        _assert_rows(record, grads, before, after, set(after))


class _Sharded(torch.optim.Optimizer):
    """Built as ``ZeroRedundancyOptimizer`` is: its step steps a local optimizer of its own param groups
    (the rank's shard; here every parameter)."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        super().__init__(params, {})
        self.local = torch.optim.Adam(params, lr=1e-3)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.local.step()


def test_an_optimizer_stepped_inside_the_observed_ones_step_is_part_of_it() -> None:
    """ZeroRedundancyOptimizer steps a local optimizer inside its own step, over param groups of its
    own: that one was counted as an optimizer the watch does not observe on every sampled step. It is
    part of the observed step; the rows are read at the observed optimizer's hooks, equal to torch's."""
    model = _model()
    opt = _Sharded(model.parameters())
    _check_wrapped(model, opt, observed=opt, steps=3)


def _check_wrapped(
    model: nn.Module, opt: torch.optim.Optimizer, observed: torch.optim.Optimizer, steps: int
) -> None:
    """Train ``steps`` steps with ``opt`` stepped and ``observed`` given to the watch, nothing warned:
    nothing skipped, and each step's rows those of the whole ``opt.step()`` (torch's tensors)."""
    records = sw.sinks.collect()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sw.observe(model, observed, every=1, cadence=CADENCE, sinks=[records]) as watch:
            for k in range(steps):
                x, y = _batch(k)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                grads, before = _clone(model, grads=True), _clone(model)
                opt.step()
                seen.append((grads, before, _clone(model), set(grads)))
                watch.step()
    assert watch.statistics().skipped == {}
    for record, rows in zip(records.items, seen, strict=True):
        _assert_rows(record, *rows)


class _Lookahead(torch.optim.Optimizer):
    """Lookahead as torch-optimizer writes it: a wrapper sharing its inner optimizer's param groups that
    steps the inner one inside its own step, then pulls the weights toward slow copies every ``k``."""

    def __init__(self, inner: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        super().__init__(inner.param_groups, {})
        self.inner, self.k, self.alpha, self.steps = inner, k, alpha, 0
        self.param_groups = inner.param_groups
        self.slow = [p.detach().clone() for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()
        self.steps += 1
        if self.steps % self.k == 0:
            params = [p for group in self.param_groups for p in group["params"]]
            for p, slow in zip(params, self.slow, strict=True):
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)


@pytest.mark.parametrize("observed", ["wrapper", "inner"])
def test_a_wrapper_stepping_the_observed_inner_optimizer_is_read_once_around_its_whole_step(
    observed: str,
) -> None:
    """Lookahead observed, or its inner optimizer observed while the loop steps Lookahead: either way
    each step is read once (not the inner step's rows beside the wrapper's), its update the whole
    step's Δ, slow-weight pull included, equal to torch's."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = _Lookahead(inner)
    _check_wrapped(model, opt, observed=opt if observed == "wrapper" else inner, steps=4)
