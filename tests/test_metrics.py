"""The metric catalogue wired into ``observe``: every value against a plain torch/numpy reference computed
here, on real training; opt-in metrics off by default; failures counted, never raised into training.

The math of the building blocks (power iteration, histogram buckets, SVCCA, Hessian power iteration) is
tested against independent references in ``test_metrics_*.py``; here the references are computed from
the same tensors the model trained with, captured by this test's own clones.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey, ops
from tests.training import Step, Train, layer_mean_reference

EVERY_STEP = {"param": 1, "update": 1}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(n)]


def _extras(
    records: list[sw.StepRecord], stat: str, kind: str
) -> dict[int, dict[tuple[str, str], np.ndarray]]:
    out: dict[int, dict[tuple[str, str], np.ndarray]] = {}
    for record in records:
        out[record.step] = {
            (key.layer, key.name): value
            for (key, s), value in record.extras.items()
            if s == stat and key.kind == kind
        }
    return out


# -- worker-side metrics ---------------------------------------------------------------------------------


def test_update_ratio_and_layer_mean_match_the_trained_tensors(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before: dict[str, torch.Tensor] = {}
    ratios: list[dict[tuple[str, str], float]] = []
    named = dict(model.named_parameters())

    def snap(_: Step) -> None:
        before.update({n: p.detach().clone() for n, p in named.items()})

    def ratio(_: Step) -> None:
        ratios.append(
            {
                tuple(n.split(".")): float((p.detach() - before[n]).norm() / p.detach().norm())  # type: ignore[misc]
                for n, p in named.items()
            }
        )

    records = sw.sinks.collect()
    with sw.observe(model, opt, cadence=EVERY_STEP, sinks=[records], every=1) as watch:
        train(model, opt, watch, data=_batches(3), after_opt_step=ratio, before_opt_step=snap)
    snapshot = watch.snapshot()  # after close(): every record processed
    served = {
        (s.labels["layer"], s.labels["param"]): s.value
        for s in snapshot
        if s.name == "streamwatch_tensor" and s.labels["stat"] == "update_ratio"
    }
    assert served.keys() == ratios[-1].keys()
    for key, want in ratios[-1].items():
        assert served[key] == pytest.approx(want, rel=1e-5)
    last = records.items[-1]
    layer_means = {
        (s.labels["kind"], s.labels["stat"]): s.value for s in snapshot if s.name == "streamwatch_layer_mean"
    }
    rows = last.rows(kind="activation", phase="train")  # one row per layer
    assert len(rows) == 3
    for stat in ("mean", "l2", "rms"):
        assert layer_means[("activation", stat)] == pytest.approx(
            float(np.mean(last.stat(stat)[rows])), rel=1e-12
        )
    # a layer's gradients are its weight's and bias's together: the last step's, still in .grad
    grads = [torch.cat([p.grad.double().flatten() for p in m.parameters()]) for m in (model[0], model[2])]  # type: ignore[union-attr]
    for stat, value in layer_mean_reference(grads).items():
        assert layer_means[("param_grad", stat)] == pytest.approx(value, rel=1e-5), stat


def test_worker_metrics_can_be_switched_off_and_unknown_names_are_refused() -> None:
    model = _model()
    with sw.observe(model, metrics=(), every=1) as watch:
        _ = model(torch.randn(2, 6))
        watch.step()
    assert not [s for s in watch.snapshot() if s.name == "streamwatch_layer_mean"]
    with pytest.raises(ValueError, match=r"Unknown metric 'spectral'.*SpectralNorm\(\)"):
        sw.observe(model, metrics=["spectral"], every=1)
    with pytest.raises(TypeError, match="collection of names"):
        sw.observe(model, metrics="update_ratio", every=1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"reads \['input'\] tensors, which are not tapped; add them to `taps=`"
    ):
        sw.observe(model, metrics=[sw.metrics.Histogram(kinds=("input",))], every=1)
    with pytest.raises(ValueError, match=r"what optimizer.step\(\) does: pass the optimizer"):
        sw.observe(model, metrics=[sw.metrics.GradientCosine(of="update")], every=1)
    with pytest.raises(ValueError, match=r"both bin \['activation'\] tensors into histograms"):
        sw.observe(
            model,
            metrics=[
                sw.metrics.Histogram(kinds=("activation", "param_grad")),
                sw.metrics.Histogram(kinds=("activation",), buckets=sw.metrics.Buckets(lo=-3, hi=0)),
            ],
            every=1,
        )
    sw.observe(model, every=1).close()  # a refused observe attached nothing: observing again works


# -- gradient and update cosines --------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("of", ["param_grad", "update"])
def test_cosine_of_consecutive_gradients_and_updates(of: str, every: int, train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: updates ≠ −lr·grad
    named = dict(model.named_parameters())
    grads: list[dict[str, torch.Tensor]] = []
    updates: list[dict[str, torch.Tensor]] = []
    before: dict[str, torch.Tensor] = {}

    def pre(_: Step) -> None:
        grads.append({n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None})
        before.update({n: p.detach().clone() for n, p in named.items()})

    def post(_: Step) -> None:
        updates.append({n: p.detach() - before[n] for n, p in named.items()})

    records = sw.sinks.collect()
    metric = sw.metrics.GradientCosine(of=of, every=every)
    with sw.observe(model, opt, metrics=[metric], sinks=[records], every=1) as watch:
        train(model, opt, watch, data=_batches(8), after_opt_step=post, before_opt_step=pre)
    series = grads if of == "param_grad" else updates
    got = _extras(records.items, "cosine", of)
    sampled = [s for s in range(8) if s % every == 0 and s > 0]
    for step in range(8):
        if step not in sampled:
            assert not got[step], step
            continue
        want = {
            tuple(n.split(".")): float(
                F.cosine_similarity(series[step][n].flatten(), series[step - 1][n].flatten(), dim=0)
            )
            for n in named
        }
        assert {k: float(v[0]) for k, v in got[step].items()} == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metric.binding is None  # close() unbound it: no copies kept


def test_cosine_without_an_optimizer_runs_at_the_step_boundary() -> None:
    model = _model()
    grads: list[torch.Tensor] = []
    records = sw.sinks.collect()
    with sw.observe(model, metrics=[sw.metrics.GradientCosine()], sinks=[records], every=1) as watch:
        for x, y in _batches(3):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append(model[0].weight.grad.detach().clone())
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            watch.step()
    got = _extras(records.items, "cosine", "param_grad")
    want = float(F.cosine_similarity(grads[2].flatten(), grads[1].flatten(), dim=0))
    assert float(got[2][("0", "weight")][0]) == pytest.approx(want, rel=1e-5)
    assert not got[0]


# -- spectral norm, condition number, histograms, p-norms -------------------------------------------------


def test_spectral_norm_and_condition_number_of_every_weight_matrix(train: Train) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records = sw.sinks.collect()
    metrics = [sw.metrics.SpectralNorm(iterations=2), sw.metrics.ConditionNumber(every=5)]
    with sw.observe(model, opt, metrics=metrics, sinks=[records], every=1) as watch:
        # 40 steps: warm-started power iteration converges over the steps
        train(model, opt, watch, 40, shape=(8, 3, 6, 6), classes=5, seed=3, report_outputs=False)
    last = records.items[-1]
    spectral = {k.layer: float(v[0]) for (k, s), v in last.extras.items() if s == "spectral_norm"}
    assert set(spectral) == {"0", "2"}  # weights only: biases are vectors
    for layer, module in (("0", model[0]), ("2", model[2])):
        matrix = module.weight.detach().reshape(module.weight.shape[0], -1)
        assert spectral[layer] == pytest.approx(float(torch.linalg.matrix_norm(matrix, ord=2)), rel=1e-3)
    conditions = {r.step for r in records.items if any(s == "condition_number" for _, s in r.extras)}
    assert conditions == {0, 5, 10, 15, 20, 25, 30, 35}
    # (the values themselves: test_condition_number_matches_svdvals_at_the_sampled_step)


def test_condition_number_matches_svdvals_at_the_sampled_step(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    singular: list[torch.Tensor] = []
    records = sw.sinks.collect()
    with sw.observe(model, opt, metrics=[sw.metrics.ConditionNumber()], sinks=[records], every=1) as watch:
        train(
            model,
            opt,
            watch,
            data=_batches(2),
            after_opt_step=lambda _: singular.append(torch.linalg.svdvals(model[2].weight.detach())),
        )
    for record, s in zip(records.items, singular, strict=True):
        got = record.extras[(SeriesKey("train", "2", "param", "weight"), "condition_number")][0]
        assert got == pytest.approx(float(s.max() / s.min()), rel=1e-4)


def test_histograms_count_every_element_by_sign_and_magnitude(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buckets = sw.metrics.Buckets(lo=-6, hi=2, per_decade=2)
    acts: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, a, out: acts.append(out.detach().clone()))
    records = sw.sinks.collect()
    metric = sw.metrics.Histogram(kinds=("activation", "param_grad"), buckets=buckets)
    with sw.observe(model, opt, metrics=[metric], sinks=[records], every=1) as watch:
        train(model, opt, watch, data=_batches(2))
    counts = records.items[-1].extras[(SeriesKey("train", "1", "activation", ""), "histogram")]
    x = acts[-1].numpy()
    assert counts.shape == (len(buckets),)
    assert counts.sum() == x.size
    zero = len(buckets) // 2  # non-finite first, then negatives, zero, positives (mirror images)
    assert counts[zero] == np.count_nonzero(x == 0)  # ReLU: many exact zeros
    assert counts[zero + 1 :].sum() == np.count_nonzero(x > 0)
    assert counts[1:zero].sum() == 0  # no negatives after a ReLU
    grad_rows = [k for (k, s) in records.items[-1].extras if s == "histogram" and k.kind == "param_grad"]
    assert len(grad_rows) == 4
    served = [
        s for s in watch.snapshot() if s.name == "streamwatch_tensor_histogram" and s.labels["layer"] == "1"
    ]
    assert sum(s.value for s in served) == x.size


@pytest.mark.parametrize("p", [0.5, 1, 3, math.inf])
def test_p_norms_of_tapped_tensors(p: float, train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[torch.Tensor] = []
    records = sw.sinks.collect()
    metric = sw.metrics.PNorm(p=p, kinds=("param_grad",))
    with sw.observe(model, opt, metrics=[metric], sinks=[records], every=1) as watch:
        train(
            model,
            opt,
            watch,
            data=_batches(2),
            before_opt_step=lambda _: grads.append(model[2].weight.grad.detach().clone()),
        )
    got = records.items[-1].extras[(SeriesKey("train", "2", "param_grad", "weight"), metric.name)][0]
    assert got == pytest.approx(float(torch.linalg.vector_norm(grads[-1].double(), ord=p)), rel=1e-5)
    with pytest.raises(ValueError, match="`p` to be a number > 0"):
        sw.metrics.PNorm(p=0)


# -- metrics that run the model ---------------------------------------------------------------------------


def test_activation_similarity_between_checkpoints_and_training_unchanged(train: Train) -> None:
    from streamwatch.metrics._cca import flatten_samples, svcca

    probe = torch.randn(200, 6, generator=torch.Generator().manual_seed(5))
    batches = _batches(4)
    model = _model()
    reference = train(model, torch.optim.SGD(model.parameters(), lr=0.5), None, data=batches)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen: list[torch.Tensor] = []

    def capture(_: Step) -> None:  # the layer's output on the probe, without calling the (tapped) module
        with torch.no_grad():
            seen.append(F.linear(probe, model[0].weight, model[0].bias).relu())

    records = sw.sinks.collect()
    # the ReLU's output: a Linear layer's is a linear map of the probe, so its CCA is always 1
    metric = sw.metrics.ActivationSimilarity(probe, layers=["1"], every=1, against="first")
    with sw.observe(model, opt, metrics=[metric], sinks=[records], every=1) as watch:
        losses = train(model, opt, watch, data=batches, after_opt_step=capture)
    assert losses == reference  # the probe pass changes nothing in training
    got = {
        r.step: r.extras.get((SeriesKey("eval", "1", "activation", ""), "cca_similarity"))
        for r in records.items
    }
    assert got[0] is None  # the first checkpoint is the reference
    for step in (1, 2, 3):
        want = float(svcca(flatten_samples(seen[0]), flatten_samples(seen[step])))
        assert float(got[step][0]) == pytest.approx(want, rel=1e-9)  # type: ignore[index]
    assert 0.5 < float(got[3][0]) < 0.999  # type: ignore[index]  # training moved the representation
    assert not [r for r in records.items if any(k.phase == "eval" for k in r.keys)]  # probe rows paused


def test_activation_similarity_reads_each_layer_before_in_place_ops_and_tuple_outputs() -> None:
    """The captured output shared memory with the layer's: a ``ReLU(inplace=True)`` after it overwrote
    it, so a Linear (a linear map of the probe: similarity 1) was scored on its ReLU's output. An LSTM
    (a tuple output) gave no value and no word; a named layer the probe never reaches is now said."""
    from streamwatch.metrics._cca import flatten_samples, svcca

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 3))
    lstm = nn.LSTM(3, 5, batch_first=True)
    probe = torch.randn(300, 6, generator=torch.Generator().manual_seed(8))
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    seen: list[torch.Tensor] = []
    records = sw.sinks.collect()
    metric = sw.metrics.ActivationSimilarity(probe, layers=["0"], every=1, keep=1.0, against="first")
    with sw.observe(model, opt, metrics=[metric], sinks=[records], every=1) as watch:
        for _ in range(3):
            with torch.no_grad():
                seen.append(F.linear(probe, model[0].weight, model[0].bias))
            opt.zero_grad()
            F.mse_loss(model(probe[:64]), torch.randn(64, 3) * 5).backward()
            opt.step()
            watch.step()
    key = (SeriesKey("eval", "0", "activation", ""), "cca_similarity")
    got = [float(r.extras[key][0]) for r in records.items if key in r.extras]
    assert len(got) == 2
    for step, value in enumerate(got, start=1):
        want = float(svcca(flatten_samples(seen[0]), flatten_samples(seen[step]), keep=1.0))
        assert value == pytest.approx(want, abs=1e-9)
        assert value == pytest.approx(1.0, abs=1e-9)  # a linear map of the probe
    sequences = torch.randn(64, 7, 3, generator=torch.Generator().manual_seed(9))
    metric = sw.metrics.ActivationSimilarity(sequences, layers=["lstm"], every=1)
    holder = nn.ModuleDict({"lstm": lstm})
    holder.forward = lambda x: holder["lstm"](x)  # type: ignore[method-assign]
    records = sw.sinks.collect()
    with sw.observe(holder, metrics=[metric], sinks=[records], every=1) as watch:
        watch.step()
        watch.step()
    lstm_key = (SeriesKey("eval", "lstm", "activation", ""), "cca_similarity")
    values = [float(r.extras[lstm_key][0]) for r in records.items if lstm_key in r.extras]
    assert values == [pytest.approx(1.0)]
    unreached = sw.metrics.ActivationSimilarity(probe, layers=["0", "2"], every=1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    model.forward = lambda x: model[1](model[0](x))  # type: ignore[method-assign]  # "2" is never called
    watch = sw.observe(model, metrics=[unreached], every=1)
    with pytest.warns(RuntimeWarning, match=r"layers \['2'\] gave no tensor in the probe pass"):
        watch.step()
    with pytest.raises(sw.PipelineError, match=r"layers \['2'\] gave no tensor"):
        watch.close()


def test_hessian_max_eigenvalue_matches_a_direct_eigendecomposition() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(16, 3), torch.randn(16, 1)

    def loss_fn(m: nn.Module) -> torch.Tensor:
        return F.mse_loss(m(x), y)

    records = sw.sinks.collect()
    metric = sw.metrics.HessianMaxEig(loss_fn, every=1, iterations=200)
    with sw.observe(model, metrics=[metric], sinks=[records], every=1) as watch:
        watch.step()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])

    def as_loss(vector: torch.Tensor) -> torch.Tensor:
        tensors, offset = [], 0
        for p in params:
            tensors.append(vector[offset : offset + p.numel()].reshape(p.shape))
            offset += p.numel()
        out = torch.func.functional_call(
            model, dict(zip([n for n, _ in model.named_parameters()], tensors, strict=True)), (x,)
        )
        return F.mse_loss(out, y)

    eigenvalues = torch.linalg.eigvalsh(torch.autograd.functional.hessian(as_loss, flat))
    want = float(eigenvalues[eigenvalues.abs().argmax()])
    assert records.items[0].scalars["hessian_max_eig"] == pytest.approx(want, rel=1e-3)
    assert all(p.grad is None for p in params)  # nothing accumulated into .grad


def test_test_accuracy_every_n_steps_labelled_eval(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x_test, y_test = torch.randn(50, 6), torch.randint(0, 3, (50,))
    expected: dict[int, tuple[float, float]] = {}

    def evaluate(m: nn.Module) -> dict[str, Any]:
        m.eval()
        with torch.no_grad():
            out = m(x_test)
        return {"accuracy": (out.argmax(-1) == y_test).float().mean(), "loss": F.cross_entropy(out, y_test)}

    records = sw.sinks.collect()
    step_counter = iter(range(100))

    def reference(_: Step) -> None:
        step = next(step_counter)
        if step % 2 == 0:
            with torch.no_grad():
                out = model(x_test)
            expected[step] = (
                float((out.argmax(-1) == y_test).float().mean()),
                float(F.cross_entropy(out, y_test)),
            )

    with sw.observe(
        model, opt, metrics=[sw.metrics.TestAccuracy(evaluate, every=2)], sinks=[records], every=1
    ) as watch:
        train(model, opt, watch, data=_batches(5), after_opt_step=reference)
        assert model.training  # the evaluation's eval() was undone
    got = {r.step: (r.scalars.get("eval/accuracy"), r.scalars.get("eval/loss")) for r in records.items}
    for step in range(5):
        if step in expected:
            assert got[step] == pytest.approx(expected[step], rel=1e-6)
            assert any(k.phase == "eval" and k.kind == "activation" for k in records.items[step].keys)
        else:
            assert got[step] == (None, None)
    served = {(s.name, s.labels.get("phase")) for s in watch.snapshot()}
    assert {
        ("streamwatch_accuracy", "eval"),
        ("streamwatch_loss", "eval"),
        ("streamwatch_accuracy", "train"),
    } <= served


# -- failure, binding, serving ----------------------------------------------------------------------------


def test_a_failing_metric_is_counted_and_raised_at_close_never_into_training(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken(m: nn.Module) -> float:
        raise ZeroDivisionError("the evaluation broke")

    batches = _batches(3)
    watch = sw.observe(
        model, opt, metrics=[sw.metrics.TestAccuracy(broken, every=1), sw.metrics.SpectralNorm()], every=1
    )
    with pytest.warns(RuntimeWarning, match="the evaluation broke"):
        train(model, opt, watch, data=batches, flush=True)
    assert watch.statistics().hook_errors == 3
    assert any(s.labels.get("stat") == "spectral_norm" for s in watch.snapshot())  # the others kept going
    with pytest.raises(sw.PipelineError, match="the evaluation broke"):
        watch.close()


def test_a_metric_object_serves_one_watch_at_a_time() -> None:
    metric = sw.metrics.SpectralNorm()
    first = sw.observe(_model(), metrics=[metric], every=1)
    with pytest.raises(RuntimeError, match="already bound"):
        sw.observe(_model(1), metrics=[metric], every=1)
    first.close()
    sw.observe(_model(1), metrics=[metric], every=1).close()  # free again after close()
    with pytest.raises(ValueError, match="`every` to be a positive integer"):
        sw.metrics.SpectralNorm(every=0)


def test_a_z_score_spike_detector_served_next_to_the_built_in_series(train: Train) -> None:
    """docs/metrics.md's example: window + map over the gradient norm, published with watch.serve()."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    key = SeriesKey("train", "2", "param_grad", "weight")
    norms: list[float] = []

    def grad_norm(record: sw.StepRecord) -> float:
        return float(record.stat("l2")[record.keys.index(key)])

    def zscore(window: list[float]) -> float:
        history, latest = np.array(window[:-1]), window[-1]
        return float((latest - history.mean()) / (history.std() + 1e-12))

    with sw.observe(model, opt, every=1) as watch:
        watch.pipe(
            sw.source()
            | ops.map(grad_norm)
            | ops.window(5, step=1)
            | ops.map(zscore)
            | watch.serve("grad_zscore")
        )
        watch.pipe(sw.source() | ops.map(grad_norm) | sw.sinks.callback(norms.append))
        train(model, opt, watch, data=_batches(8))
    served = [s for s in watch.snapshot() if s.name == "streamwatch_grad_zscore"]
    window = norms[-5:]
    assert len(served) == 1
    assert served[0].value == pytest.approx(zscore(window), rel=1e-9)
    with pytest.raises(ValueError, match="metric name"):
        watch.serve("bad name")


def test_zero_weights_a_single_unit_and_nan_inputs_are_measured_not_crashing(train: Train) -> None:
    model = nn.Sequential(nn.Linear(4, 1))  # one unit: a 1×4 weight, one singular value
    with torch.no_grad():
        model[0].weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = [
        sw.metrics.SpectralNorm(),
        sw.metrics.ConditionNumber(),
        sw.metrics.GradientCosine(),
        sw.metrics.Histogram(kinds=("activation",)),
        sw.metrics.PNorm(p=1, kinds=("activation",)),
    ]
    records = sw.sinks.collect()
    inputs = [torch.ones(5, 4), torch.full((5, 4), float("nan"))]
    weights = []

    def keep(_: Step) -> None:
        weights.append(model[0].weight.detach().clone())

    with sw.observe(model, opt, metrics=metrics, sinks=[records], every=1) as watch:
        # no targets: the loss is the outputs' mean square
        train(model, opt, watch, data=[(x, None) for x in inputs], after_opt_step=keep)
        assert watch.statistics().hook_errors == 0
    first, second = records.items
    key = SeriesKey("train", "0", "param", "weight")
    # step 0: the zero weight moved to a nonzero 1×4 row: σmax is its norm, its only σ makes κ = 1
    assert float(first.extras[(key, "spectral_norm")][0]) == pytest.approx(float(weights[0].norm()), rel=1e-5)
    assert float(first.extras[(key, "condition_number")][0]) == pytest.approx(1.0, rel=1e-5)
    assert math.isnan(float(second.extras[(key, "spectral_norm")][0]))  # NaN weights after step 1
    histogram = second.extras[(SeriesKey("train", "0", "activation", ""), "histogram")]
    assert histogram[0] == 5  # every activation non-finite: the non-finite bucket
    assert histogram.sum() == 5
    assert math.isnan(second.extras[(SeriesKey("train", "0", "activation", ""), "norm_p1")][0])
    assert math.isnan(second.extras[(SeriesKey("train", "0", "param_grad", "weight"), "cosine")][0])
    stats = {(s.labels.get("stat"), s.labels.get("kind")) for s in watch.snapshot()}
    assert ("cosine", "param_grad") not in stats  # NaN is absent from the served values, never a NaN


def test_zero_weights_have_spectral_norm_zero_and_infinite_condition_number() -> None:
    model = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    metrics = [sw.metrics.SpectralNorm(), sw.metrics.ConditionNumber()]
    with sw.observe(model, metrics=metrics, every=1) as watch:
        watch.step()
    values = {s.labels["stat"]: s.value for s in watch.snapshot() if s.labels.get("kind") == "param"}
    assert values["spectral_norm"] == 0.0
    assert values["condition_number"] == math.inf
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.5, 0.0]]))
    with sw.observe(
        model, metrics=[sw.metrics.SpectralNorm(iterations=30), sw.metrics.ConditionNumber()], every=1
    ) as watch:
        watch.step()
    values = {s.labels["stat"]: s.value for s in watch.snapshot() if s.labels.get("kind") == "param"}
    assert values["spectral_norm"] == pytest.approx(3.0, rel=1e-5)
    assert values["condition_number"] == pytest.approx(6.0, rel=1e-5)


# -- metrics that run the model leave training as they found it --------------------------------------------


def _frozen_bn_model() -> nn.Module:
    """A training model with a BatchNorm deliberately frozen with ``.eval()`` (fine-tuning style)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)
    ).train()
    model[1].eval()
    return model


def _probe_metric(name: str) -> sw.metrics.Metric:
    probe = torch.randn(200, 6, generator=torch.Generator().manual_seed(5))
    x_test, y_test = torch.randn(40, 6), torch.randint(0, 3, (40,))

    def evaluate(m: nn.Module) -> float:
        m.eval()
        with torch.no_grad():
            return float((m(x_test).argmax(-1) == y_test).float().mean())

    def loss_fn(m: nn.Module) -> torch.Tensor:
        m.eval()  # as HessianMaxEig's docstring advises
        return F.cross_entropy(m(x_test), y_test)

    if name == "ActivationSimilarity":
        return sw.metrics.ActivationSimilarity(probe, layers=["2"], every=1)
    if name == "TestAccuracy":
        return sw.metrics.TestAccuracy(evaluate, every=1)
    return sw.metrics.HessianMaxEig(loss_fn, every=1, iterations=2)


@pytest.mark.parametrize("name", ["ActivationSimilarity", "TestAccuracy", "HessianMaxEig"])
def test_probe_metrics_keep_every_modules_own_training_flag(name: str, train: Train) -> None:
    """Restoring only ``model.train(was_training)`` would unfreeze the frozen BatchNorm (its statistics
    then move on every later step) — or, after an ``eval()`` in a loss closure, leave dropout off."""
    model = _frozen_bn_model()
    modes = {n: m.training for n, m in model.named_modules()}
    stats = [b.clone() for b in model[1].buffers()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, metrics=[_probe_metric(name)], every=1) as watch:
        train(model, opt, watch, data=_batches(3))
        assert watch.statistics().hook_errors == 0
        assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(torch.equal(a, b) for a, b in zip(model[1].buffers(), stats, strict=True))  # still frozen


def test_test_accuracy_puts_back_rng_grads_and_buffers_whatever_the_function_does() -> None:
    """A shuffling DataLoader draws from the global torch RNG; a train-mode pass updates batch-norm
    statistics; a ``backward()`` accumulates into ``.grad``; python and numpy draws advance their states."""
    import random

    from torch.utils.data import DataLoader, TensorDataset

    model = _frozen_bn_model()
    model[1].train()  # a training BatchNorm: a forward in training mode moves its statistics
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))

    def evaluate(m: nn.Module) -> float:
        random.random()
        np.random.rand()
        total = 0.0
        for x, y in DataLoader(data, batch_size=8, shuffle=True):
            F.cross_entropy(m(x), y).backward()
            total += float((m(x).argmax(-1) == y).float().sum())
        return total / len(data)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = sw.observe(model, opt, metrics=[sw.metrics.TestAccuracy(evaluate, every=1)], every=1)
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    model[0].bias.grad = None  # None-ness is kept too
    grads = {n: p.grad for n, p in model.named_parameters()}
    values = {n: None if g is None else g.clone() for n, g in grads.items()}
    buffers = {n: (b, b.clone()) for n, b in model.named_buffers()}
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    watch.step()
    assert watch.statistics().hook_errors == 0
    watch.close()
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), states[2], strict=True))
    for n, p in model.named_parameters():
        assert p.grad is grads[n]  # the same tensor (or None), with the same values
        assert p.grad is None or torch.equal(p.grad, values[n])  # type: ignore[arg-type]
    for n, b in model.named_buffers():
        assert b is buffers[n][0]
        assert torch.equal(b, buffers[n][1])


def test_a_probe_between_forward_and_backward_does_not_break_the_backward() -> None:
    """An eval-mode BatchNorm saves its running statistics for backward; putting them back must not bump
    their version (autograd would refuse to back-propagate)."""
    model = _frozen_bn_model()
    metric = sw.metrics.ActivationSimilarity(torch.randn(200, 6), layers=["2"], every=1)
    with sw.observe(model, metrics=[metric], every=1) as watch:
        for x, y in _batches(2):
            loss = F.cross_entropy(model(x), y)
            watch.step(loss=loss)  # before backward()
            loss.backward()
        assert watch.statistics().hook_errors == 0
    assert all(p.grad is not None for p in model.parameters())


def test_preserved_puts_back_modes_buffers_grads_and_rng() -> None:
    from streamwatch.metrics._base import preserved

    model = _frozen_bn_model()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    grad = model[0].weight.grad
    mean = model[1].running_mean
    before = mean.clone()
    state = torch.get_rng_state()
    seen: list[torch.Tensor | None] = []

    def body() -> None:
        with preserved(model):
            seen.append(model[0].weight.grad)
            model.train()
            model[1].running_mean = torch.full_like(mean, 3.0)  # replaced
            mean.add_(1.0)  # and the original modified in place
            F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        body()
    assert seen == [None]  # the body starts without gradients
    assert model.training
    assert not model[1].training
    assert model[0].weight.grad is grad
    assert torch.equal(grad, torch.ones_like(grad))
    assert model[4].weight.grad is None
    assert model[1].running_mean is mean
    assert torch.equal(mean, before)
    assert torch.equal(torch.get_rng_state(), state)
