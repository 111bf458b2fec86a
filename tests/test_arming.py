"""Hook arming: the per-module and per-parameter hooks are installed only for the steps (and evaluation
passes) that need them, so an unsampled step runs the model without a Python call per module or
parameter. Under ``torch.compile`` they stay in for good (no recompilation per sampled step)."""

from __future__ import annotations

import copy
import functools
import pickle
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import streamwatch as sw
import streamwatch._cadence
import streamwatch._taps
import streamwatch._torchhooks
from tests.test_observe_compile import batch, make_model
from tests.training import root_seen


def module_hooks(model: nn.Module) -> int:
    """Forward and pre-forward hooks on every module but the root (its own are counted apart)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in list(model.modules())[1:])


def param_hooks(model: nn.Module) -> int:
    """The taps' post-accumulate hooks (not the one that drains compiled code's rows: counted apart)."""
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) - drain_hooks(model)


def drain_hooks(model: nn.Module) -> int:
    """Hooks that move rows made by compiled code out of the graph after a backward (``TapState.drain``)."""
    return sum(
        getattr(hook, "__func__", None) is streamwatch._taps.TapSet._drain
        for p in model.parameters()
        for hook in (p._post_accumulate_grad_hooks or {}).values()
    )


def train_step(
    model: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, watch: sw.Watch
) -> None:
    """One training step of ``model`` (the module, or a compiled one) on the fixed batch."""
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    watch.step(loss=loss)


def test_hooks_are_in_only_on_sampled_steps() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[int, int]] = []
    with sw.observe(model, opt, every=3) as watch:
        for _ in range(6):
            seen.append((module_hooks(model), param_hooks(model)))
            train_step(model, opt, watch)
    # three modules with a forward hook each; the parameters' gradients are read at the optimizer's
    # pre-step hook, so no parameter ever gets a hook: torch's backward never dispatches one (an emptied
    # post-accumulate hook table still costs a call per parameter in every backward)
    assert seen == [(3, 0), (0, 0), (0, 0), (3, 0), (0, 0), (0, 0)]
    # The drain hook is in for the first step only (a model compiled before it runs its first micro-batches
    # then), out from the first boundary of an eager model on, its table gone with it.
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    assert (module_hooks(model), param_hooks(model)) == (0, 0)
    assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == (0, 0)


def test_without_an_optimizer_gradient_hooks_are_in_only_on_sampled_steps() -> None:
    """``observe(model)`` alone has no optimizer pre-step to read gradients at: each parameter gets a
    post-accumulate hook, installed only for the sampled steps."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[int, int]] = []
    records = sw.sinks.collect()
    with sw.observe(model, every=3, sinks=[records]) as watch:
        for _ in range(6):
            seen.append((module_hooks(model), param_hooks(model)))
            train_step(model, opt, watch)
        watch.flush()
    # three modules with a forward hook each, four parameters with a post-accumulate hook
    assert seen == [(3, 4), (0, 0), (0, 0), (3, 4), (0, 0), (0, 0)]
    assert (module_hooks(model), param_hooks(model)) == (0, 0)
    # the sampled steps 0 and 3, then close()'s final record of step 5 (its scalars, no rows)
    assert [(r.step, len(r.rows("param_grad"))) for r in records.items] == [(0, 4), (3, 4), (5, 0)]


def test_an_unsampled_step_keeps_only_the_root_module_seen() -> None:
    """The root module's forward hook and the optimizer's pre/post hooks time a sampled step's parts and
    take weights and updates: they are out on unsampled steps, with the per-layer hooks."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[int, int, int, int]] = []
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=3, sinks=[records]) as watch:
        for _ in range(6):
            seen.append(
                (
                    int(root_seen(model)),
                    len(model._forward_pre_hooks),
                    len(model._forward_hooks),
                    len(opt._optimizer_step_pre_hooks),
                    len(opt._optimizer_step_post_hooks),
                )
            )
            train_step(model, opt, watch)
        watch.flush()
    assert seen == [(1, 0, 1, 1, 1), (1, 0, 0, 0, 0), (1, 0, 0, 0, 0)] * 2  # (seen through its call slot)
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (0, 0)
    # the sampled steps still time every part of the step
    assert [r.step for r in records.items] == [0, 3, 5]  # (5: close()'s final record, its scalars only)
    for record in records.items[:2]:
        parts = {name for name in record.scalars if name.startswith("part/")}
        assert parts == {"part/data_wait", "part/forward", "part/backward", "part/optimizer"} - (
            {"part/data_wait"} if record.step == 0 else set()
        )
        # each part is this step's own (no boundary left over from an earlier sampled step)
        assert 0 < sum(record.scalars[name] for name in parts) <= record.scalars["step_seconds"]


def test_a_cadence_arms_only_the_groups_its_step_samples() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    cadence = {"activation": 2, "output_grad": 2, "param_grad": 1}
    records = sw.sinks.collect()
    with sw.observe(
        model,
        opt,
        taps=("activation", "output_grad", "param_grad"),
        cadence=cadence,
        every=1,
        sinks=[records],
    ) as watch:
        for _ in range(4):
            seen.append((module_hooks(model), param_hooks(model)))
            train_step(model, opt, watch)
        watch.flush()
    assert seen == [(3, 0), (0, 0), (3, 0), (0, 0)]  # gradients: at the optimizer's pre-step, no hooks
    assert [(len(r.rows("activation")), len(r.rows("param_grad"))) for r in records.items] == [
        (3, 4),
        (0, 4),
        (3, 4),
        (0, 4),
    ]


@pytest.mark.parametrize("cycle_max", [4096, 1], ids=["flags-by-phase", "flags-by-pattern"])
def test_each_kind_is_sampled_on_its_cadence_whether_the_phases_are_tabled_or_not(
    cycle_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampled step's flags come from a table of the cadences' phases (their lcm is short) or are
    built from the pattern (lcm over ``_CYCLE_MAX``): the same kinds either way."""
    monkeypatch.setattr(streamwatch._cadence, "_CYCLE_MAX", cycle_max)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cadence = {"activation": 2, "output_grad": 3, "param_grad": 1}
    records = sw.sinks.collect()
    with sw.observe(model, opt, taps=tuple(cadence), cadence=cadence, every=1, sinks=[records]) as watch:
        assert len(watch._boundary._cadence._cycle) == (6 if cycle_max == 4096 else 0)
        for _ in range(8):
            train_step(model, opt, watch)
        watch.flush()
    got = [tuple(bool(r.rows(kind)) for kind in cadence) for r in records.items]
    assert got == [tuple(k % n == 0 for n in cadence.values()) for k in range(8)]


def test_an_evaluation_pass_on_an_unsampled_step_is_summarised_and_disarmed_after() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    x, _ = batch()
    with sw.observe(model, opt, every=100, sinks=[records]) as watch:
        train_step(model, opt, watch)  # step 0: sampled
        assert module_hooks(model) == 0  # step 1 is not
        model.eval()
        with torch.no_grad():
            expected = model[0](x)
            model(x)
        model.train()
        assert module_hooks(model) == 3  # the next training forward's root call takes them out
        train_step(model, opt, watch)
        assert module_hooks(model) == 0
        watch.flush()
    eval_record = records.items[-1]
    assert eval_record.step == 1
    assert not [name for name in eval_record.scalars if name.startswith("part/")]  # not timed, none stale
    rows = eval_record.rows(kind="activation", phase="eval")
    assert [eval_record.keys[i].layer for i in rows] == ["0", "1", "2"]
    first = rows[0]
    assert eval_record.column("count")[first] == expected.numel()
    torch.testing.assert_close(eval_record.stat("mean")[first], expected.double().mean().item())


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_run(static_from_start: bool) -> tuple[list[tuple[int, int]], int]:
    """Six steps of a compiled model, every other one sampled: hooks seen after each, graphs compiled."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    seen = []
    with sw.observe(model, opt, every=2, taps=("activation", "param_grad")) as watch:
        if static_from_start:  # what every release before arming did: the hooks never move
            watch._taps.static = True
            watch._taps.arm()
        for _ in range(6):
            train_step(compiled, opt, watch)
            seen.append((module_hooks(model), param_hooks(model)))
    return seen, counters["stats"]["unique_graphs"]


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_model_keeps_every_hook_and_compiles_no_more_than_with_fixed_hooks() -> None:
    seen, graphs = compiled_run(static_from_start=False)
    assert seen == [(3, 0)] * 6  # static from the first compiled forward on (gradients: no hooks)
    _, fixed = compiled_run(static_from_start=True)
    # the sampled and unsampled flags are guarded on either way (one graph each, plus the first step's)
    assert graphs == fixed <= 3


class _OwnCall(nn.Sequential):
    """A model whose class defines ``__call__``: torch's call slot is never read."""

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return super().__call__(*args, **kwargs)


def _own_call_model() -> nn.Module:
    model = make_model()
    return _OwnCall(*model)


@pytest.mark.parametrize(
    ("variant", "slot"),
    [("plain", True), ("own __call__", False), ("compiled before", False), ("compiled after", False)],
)
def test_the_root_module_is_seen_through_its_call_slot_or_a_pre_hook(
    fresh_dynamo: None, variant: str, slot: bool
) -> None:
    """An evaluation pass on an unsampled step is summarised however the root's calls are seen: its call
    slot where free, else a forward pre-hook (a class with its own ``__call__``, ``model.compile()``
    before ``observe()``, or after it: the next boundary sees the slot taken)."""
    model = _own_call_model() if variant == "own __call__" else make_model()
    if variant == "compiled before":
        model.compile(backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    x, _ = batch()
    with sw.observe(model, opt, every=100, sinks=[records]) as watch:
        if variant == "compiled after":
            assert "_compiled_call_impl" in model.__dict__
            assert not model._forward_pre_hooks
            model.compile(backend="eager")
        train_step(model, opt, watch)
        train_step(model, opt, watch)  # (step 1, unsampled)
        assert ("_compiled_call_impl" in model.__dict__ and not model._forward_pre_hooks) == slot
        assert len(model._forward_pre_hooks) == (0 if slot else 1)
        model.eval()
        with torch.no_grad():
            expected = model[0](x)
            model(x)
        model.train()
        train_step(model, opt, watch)
        watch.flush()
        assert watch.statistics().hook_errors == 0
    assert ("_compiled_call_impl" in model.__dict__) == variant.startswith("compiled")  # (ours out)
    assert not model._forward_pre_hooks
    eval_record = records.items[-1]
    assert eval_record.step == 2
    rows = eval_record.rows(kind="activation", phase="eval")
    assert [eval_record.keys[i].layer for i in rows] == ["0", "1", "2"]
    torch.testing.assert_close(eval_record.stat("mean")[rows[0]], expected.double().mean().item())


def test_a_frozen_batchnorm_in_a_training_forward_is_recorded_as_training() -> None:
    """``model.train(); bn.eval()`` (a frozen BatchNorm, as fine-tuning does): the layer runs in the
    training step, so its rows are ``train`` and its output gradient is summarised; it was labelled as
    an evaluation pass, without gradients. A real evaluation pass is still ``eval``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    x, y = batch()
    grads: list[torch.Tensor] = []
    model[1].register_full_backward_hook(lambda m, gi, go: grads.append(go[0].detach().clone()))
    with sw.observe(model, opt, every=1, sinks=[records]) as watch:
        model.train()
        model[1].eval()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(loss=loss)
        model.eval()
        with torch.no_grad():
            model(x)
        watch.step()
    train_record, eval_record = records.items
    tapped = ("activation", "output_grad")
    bn = {(k.phase, k.kind) for k in train_record.keys if k.layer == "1" and k.kind in tapped}
    assert bn == {("train", "activation"), ("train", "output_grad")}
    row = train_record.keys.index(sw.SeriesKey("train", "1", "output_grad", ""))
    assert train_record.column("sumsq")[row] == pytest.approx(float(grads[0].double().pow(2).sum()), rel=1e-6)
    assert {k.phase for k in eval_record.keys if k.layer == "1" and k.kind in tapped} == {"eval"}


@pytest.mark.parametrize("every", [1, None], ids=["every=1", "governor"])
def test_a_copy_made_while_the_hooks_are_in_is_inert_and_saves(every: int | None) -> None:
    """Right after observe() (the first step is sampled: every hook is in) an EMA copy is the usual
    thing to make. Its hooks were the Watch's: deepcopy failed on the kernel's C pointers, or the copy
    summarised its own forwards into the original's step; pickling failed on the closures. A copy's
    hooks are inert now."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    x, _ = batch()
    with sw.observe(model, opt, every=every, sinks=[records]) as watch:
        assert model[0]._forward_hooks  # armed for step 0
        twins = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        for twin in twins:
            for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
                assert torch.equal(mine, theirs)
            twin(x).sum().backward()  # a training-mode forward and backward of the copy: not ours
        train_step(model, opt, watch)
        watch.flush()
    (record,) = [r for r in records.items if r.step == 0]
    row = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    assert record.column("count")[row] == x.shape[0] * model[0].out_features  # one forward's, not three
    for twin in twins:  # the copies' hooks stay, inert, after close
        twin(x)


def test_a_copy_of_an_observed_model_pickles_and_is_not_observed() -> None:
    """The call slot stays out of ``pickle``, ``copy`` and ``deepcopy`` (torch leaves it out of a module's
    state): an EMA copy or a saved model carries nothing of the Watch."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    x, _ = batch()
    with sw.observe(model, opt, every=100, sinks=[records]) as watch:
        train_step(model, opt, watch)
        twins = [copy.deepcopy(model), copy.copy(model), pickle.loads(pickle.dumps(model))]
        for twin in twins:
            assert "_compiled_call_impl" not in twin.__dict__
            assert not twin._forward_pre_hooks
            for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
                assert torch.equal(mine, theirs)
            twin.eval()
            with torch.no_grad():
                twin(x)  # an evaluation pass of a copy: not the observed model's
        model.eval()
        with torch.no_grad():
            expected = model[0](x)
            model(x)  # one of the observed model's
        model.train()
        train_step(model, opt, watch)
        watch.flush()
    assert [r.step for r in records.items] == [0, 1]
    rows = records.items[1].rows(kind="activation", phase="eval")
    assert [records.items[1].keys[i].layer for i in rows] == ["0", "1", "2"]
    assert records.items[1].column("count")[rows[0]] == expected.numel()  # (one pass counted, not four)
    torch.testing.assert_close(records.items[1].stat("mean")[rows[0]], expected.double().mean().item())


class _KeepsItsDict(nn.Sequential):
    """A module whose pickling keeps its whole ``__dict__`` (as ``LightningModule.__getstate__`` does)."""

    def __getstate__(self) -> dict[str, object]:
        return self.__dict__.copy()


def test_a_copy_of_a_module_that_pickles_its_whole_dict_runs_its_own_weights() -> None:
    """A LightningModule copies its whole ``__dict__`` when copied or pickled, the call slot with it: an
    EMA or teacher copy ran the original module's forward (silently: the student's outputs), and
    ``torch.save(module)`` failed on the slot's closure. Such a module is seen with a pre-hook."""
    torch.manual_seed(0)
    model = _KeepsItsDict(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    x = torch.randn(5, 4)
    with sw.observe(model, opt, every=1, sinks=[records]) as watch:
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            watch.step(loss=1.0)
        twins = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        for twin in twins:
            with torch.no_grad():
                for p in twin.parameters():
                    p.zero_()
            assert torch.equal(twin(x), torch.zeros(5, 2))  # its own (zeroed) weights, not the original's
        watch.flush()
    assert [r.step for r in records.items] == [0, 1]
    for record in records.items:  # the original is still seen: one forward of 5 rows per step
        row = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
        assert record.column("count")[row] == 5 * 3


def test_a_failure_where_the_root_call_is_seen_is_counted_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken(*args: object) -> None:
        raise RuntimeError("broke")

    monkeypatch.setattr(streamwatch._taps.TapSet, "_root_forward_start", broken)
    watch = sw.observe(model, opt, every=1)
    x, _ = batch()
    out = model(x)  # (the root's call is seen as its forward starts)
    torch.testing.assert_close(out, model[2](model[1](model[0](x))))  # the forward ran in full
    assert watch.statistics().hook_errors == 1
    with pytest.raises(sw.PipelineError, match="1 hook call failed on the training thread"):
        watch.close()


def test_switched_hooks_go_back_in_after_the_users_and_run_as_registered_ones() -> None:
    """A group's hooks are registered once, then put back into torch's own hook dicts and taken out of
    them: they run after a hook the user registered in between (as a new registration would), with
    the same keyword flags, and each sampled step is summarised as with hooks registered anew."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = next(m for m in model.modules() if len(list(m.children())) == 0)
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=2, taps=("activation", "input"), sinks=[records]) as watch:
        train_step(model, opt, watch)  # sampled; its boundary takes the hooks out for step 1
        assert module_hooks(model) == 0
        first.register_forward_hook(lambda *args: None)  # the user's, registered in between
        hooks = watch._taps._groups["forward"]
        assert hooks.entries is not None
        assert hooks.handles == []
        original = hooks.registrations[0]
        hooks.registrations[0] = lambda: pytest.fail("a switched group registers only once")
        try:
            for _ in range(5):  # steps 1-5: the hooks back in for 2 and 4, and for 6 at the end
                train_step(model, opt, watch)
        finally:
            hooks.registrations[0] = original
        # the activation hook (and the input pre-hook, with its with_kwargs flag) are back in order
        keys = list(first._forward_hooks)
        assert len(keys) == 2
        assert keys[-1] in {key for _, key, _ in hooks.entries}
        assert list(first._forward_pre_hooks_with_kwargs) == list(first._forward_pre_hooks)
    assert (module_hooks(model) - 1, len(first._forward_pre_hooks_with_kwargs)) == (0, 0)  # (the user's)
    steps = [r.step for r in records.items if r.keys]
    assert steps == [0, 2, 4]
    kinds = [
        {(key.layer, key.kind) for key in r.keys if key.kind in ("activation", "input")}
        for r in records.items
        if r.keys
    ]
    assert kinds[0] == kinds[1] == kinds[2]
    assert len(kinds[0]) == 6


def test_hooks_whose_handles_hide_their_dicts_are_registered_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch's handles do not show the dicts their hooks live in, each sampled step registers its
    hooks again and removes them after, as before switching existed."""
    monkeypatch.setattr(streamwatch._torchhooks, "entries_of", lambda handles: None)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with sw.observe(model, opt, every=2) as watch:
        for _ in range(4):
            seen.append(module_hooks(model))
            train_step(model, opt, watch)
        assert watch._taps._groups["forward"].entries is None
    assert seen == [3, 0, 3, 0]
    assert module_hooks(model) == 0


def test_a_group_torch_refuses_half_way_leaves_none_of_its_hooks_in() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    calls = [functools.partial(model[0].register_forward_hook, lambda *a: None), _refused]
    group = streamwatch._torchhooks.HookGroup(calls, switched=True)
    with pytest.raises(RuntimeError, match="refused"):
        group.set(True)
    assert (len(model[0]._forward_hooks), group.on, group.entries) == (0, False, None)


def _refused() -> None:
    raise RuntimeError("refused")


@pytest.mark.parametrize("call", ["model(x)", "model.forward(x)"])
def test_a_forward_no_hook_saw_is_counted_and_warned_about_once(call: str) -> None:
    """``model.forward(x)`` skips the model's own hooks (a container's children still run theirs): on a
    one-module model the sampled steps whose optimizer steps such a forward's gradients are counted
    (``skipped["unseen_forward"]``) and warned about once, never a silent step without activations. An
    optimizer step with no gradient at all (no forward) is not."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=2, sinks=[records]) as watch:
        opt.step()  # (no forward, no gradient: nothing was missed)
        watch.step()
        for _ in range(4):
            outputs = model(x) if call == "model(x)" else model.forward(x)
            nn.functional.cross_entropy(outputs, y).backward()
            opt.step()
            opt.zero_grad()
            if call == "model.forward(x)" and watch.statistics().steps == 2:  # (judged at the step's end)
                with pytest.warns(RuntimeWarning, match=r"called as model.forward\(x\)") as said:
                    watch.step()
                assert said[0].filename == __file__
            else:
                watch.step()
        skipped = watch.statistics().skipped.get("unseen_forward", 0)
    activations = [any(k.kind == "activation" for k in r.keys) for r in records.items]
    if call == "model(x)":
        assert (skipped, activations) == (0, [False, True, True])
    else:  # (steps 2 and 4 are sampled: every=2)
        assert (skipped, activations) == (2, [False, False, False])
