"""The CUDA path: side-stream copy into pinned slots, zero host syncs on the training thread.

Skipped without a GPU (marked ``cuda``). Run on a GPU machine with ``make test PYTEST_ARGS="-m cuda"``.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from syncs import no_host_sync

import streamwatch as sw

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


FIRST_SIX = ("count", "sum", "sumsq", "min", "max", "zeros")
"""The columns the references below compute."""


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, watch: sw.Watch, x, y) -> torch.Tensor:
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    watch.step(loss=loss, outputs=logits, targets=y, batch_size=x.shape[0])
    return loss


def test_a_monitored_training_step_makes_no_host_sync() -> None:
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    records = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[records], cadence={"param": 1, "update": 1}, every=1)
    train_step(model, opt, watch, x, y)  # warm-up: lazy CUDA init, stream and pinned slots
    with no_host_sync():
        for _ in range(3):
            train_step(model, opt, watch, x, y)
    watch.close()
    assert watch.statistics().hook_errors == 0
    assert [r.step for r in records.items] == [0, 1, 2, 3]
    kinds = {key.kind for key in records.items[-1].keys}
    assert {"activation", "output_grad", "param", "param_grad", "update"} <= kinds


def test_values_copied_off_the_device_match_a_reference() -> None:
    model, opt = make()
    captured: dict[str, torch.Tensor] = {}
    model[0].register_forward_hook(lambda m, a, out: captured.__setitem__("h", out.detach().clone()))
    records = sw.sinks.collect()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    with sw.observe(model, opt, sinks=[records], every=1) as watch:
        train_step(model, opt, watch, x, y)
    record = records.items[0]
    row = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    h = captured["h"].double().cpu().numpy()
    expected = [h.size, h.sum(), (h * h).sum(), h.min(), h.max(), np.sum(h == 0)]
    np.testing.assert_allclose([record.column(c)[row] for c in FIRST_SIX], expected, rtol=1e-5)


def test_slots_are_reused_only_after_the_worker_released_them() -> None:
    model, opt = make()
    release = threading.Event()
    seen = sw.sinks.collect()
    x = torch.randn(8, 64, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    watch = sw.observe(model, opt, capacity=1, overflow="drop_newest", sinks=[seen], every=1)
    watch.pipe(sw.source() | sw.ops.map(lambda r: release.wait(10) and r) | sw.sinks.collect())
    for _ in range(8):
        train_step(model, opt, watch, x, y)
    stats = watch.statistics()
    release.set()
    watch.close()
    # capacity 1 + 2 spare pinned slots: later steps are dropped and counted, never overwrite a slot in use
    assert stats.slots_exhausted + stats.dropped_newest > 0
    assert len(seen.items) + watch.statistics().dropped_newest + watch.statistics().slots_exhausted == 8


def test_opt_in_tensor_metrics_make_no_host_sync_and_reach_the_worker() -> None:
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    records = sw.sinks.collect()
    metrics = [
        sw.metrics.GradientCosine(),
        sw.metrics.GradientCosine(of="update"),
        sw.metrics.SpectralNorm(),
        sw.metrics.Histogram(kinds=("activation", "param_grad")),
        sw.metrics.PNorm(p=1, kinds=("param_grad",)),
    ]
    watch = sw.observe(model, opt, sinks=[records], metrics=[*sw.DEFAULT_METRICS, *metrics], every=1)
    train_step(model, opt, watch, x, y)  # warm-up
    with no_host_sync():
        for _ in range(3):
            train_step(model, opt, watch, x, y)
    watch.close()
    assert watch.statistics().hook_errors == 0
    last = records.items[-1]
    stats = {stat for _, stat in last.extras}
    assert stats == {"cosine", "spectral_norm", "histogram", "norm_p1"}
    weight = model[2].weight.detach()
    spectral = last.extras[(sw.SeriesKey("train", "2", "param", "weight"), "spectral_norm")][0]
    assert spectral == pytest.approx(float(torch.linalg.matrix_norm(weight, ord=2)), rel=1e-2)
    histogram = last.extras[(sw.SeriesKey("train", "1", "activation", ""), "histogram")]
    assert histogram.sum() == 32 * 128


def test_the_nonfinite_sentinel_makes_no_host_sync_and_reports_the_step_later() -> None:
    """The loss of step 3 is NaN on the device: the sentinel checks its probes in batches, copies the
    flags without blocking into a pinned slot and reads them once its event completed, so the trip (and
    the escalation) is known some steps later, on a training thread that never waited for the device."""
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    watch = sw.observe(model, opt, every=50, escalate=4, on_nonfinite=lambda value: None)
    train_step(model, opt, watch, x, y)  # warm-up: lazy CUDA init, the sentinel's pinned ring and events
    with no_host_sync():
        for step in range(1, 21):  # (more than a batch: its check has been queued)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y) * (float("nan") if step == 3 else 1.0)
            watch.step(loss=loss)  # no backward: the weights stay finite
    torch.cuda.synchronize()
    logits = model(x)
    watch.step(loss=torch.nn.functional.cross_entropy(logits, y))  # the copies are done: read them
    stats = watch.statistics()
    watch.close()
    assert stats.sentinel_trips == 1
    assert stats.escalations == 1
    assert stats.hook_errors == 0


def test_a_nonfinite_loss_in_the_last_steps_is_read_at_close(caplog: pytest.LogCaptureFixture) -> None:
    """The last batch of device checks is not full when training ends: close() reads it, waiting."""
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    watch = sw.observe(model, opt, every=1000)
    train_step(model, opt, watch, x, y)
    with no_host_sync():
        for step in range(1, 4):
            loss = torch.nn.functional.cross_entropy(model(x), y) * (float("nan") if step == 2 else 1.0)
            watch.step(loss=loss)
    watch.close()
    assert watch.statistics().sentinel_trips == 1
    assert "non-finite loss at step 2 (sentinel" in caplog.text  # (at close(), or a step after it)


def test_the_default_overhead_governor_makes_no_host_sync() -> None:
    """The default watch (the governor: quiet steps with a scalar record, sampled steps, the loss every
    second) never waits for the device, from its very first step on."""
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    records = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[records])
    with no_host_sync():
        for _ in range(300):
            train_step(model, opt, watch, x, y)
    watch.close()
    stats = watch.statistics()
    assert stats.hook_errors == 0
    assert stats.steps == 300
    assert stats.sampling_interval >= 1
    assert stats.sampled >= 1
    sampled = [r for r in records.items if r.keys]
    assert sampled
    assert sampled[0].step == 0
    losses = [r.scalars["loss"] for r in records.items if "loss" in r.scalars]
    assert losses
    assert all(np.isfinite(losses))


def test_a_fused_adam_step_a_grad_scaler_skipped_has_no_update_rows_and_no_host_sync() -> None:
    """fp16 autocast, ``GradScaler`` and a fused Adam: the scaler's ``found_inf`` goes to the worker on
    the device; the step it skipped (a first scale of 2**40 overflows) records no update, the next does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    records = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[records], cadence={"param": 1, "update": 1}, every=1)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        watch.step(loss=loss)

    before = [p.detach().clone() for p in model.parameters()]
    with no_host_sync():
        step()  # step 0: 2**40 overflows in fp16, the optimizer skips it
    torch.cuda.synchronize()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    for _ in range(40):  # the scale halves each overflowing step until the step is taken
        with no_host_sync():
            step()
    watch.close()
    assert watch.statistics().hook_errors == 0
    kinds = [{key.kind for key in r.keys} for r in records.items]
    assert "update" not in kinds[0]
    assert any("update" in k for k in kinds[1:])
    taken = next(r for r in records.items if "update" in {key.kind for key in r.keys})
    rows = [i for i, key in enumerate(taken.keys) if key.kind == "update"]
    assert all(taken.column("sumsq")[i] > 0 for i in rows)  # a real step: a nonzero sum of squares


def test_bf16_autocast_activations_match_a_reference() -> None:
    model, opt = make()
    captured: dict[str, torch.Tensor] = {}
    model[1].register_forward_hook(lambda m, a, out: captured.__setitem__("h", out.detach().clone()))
    records = sw.sinks.collect()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    with sw.observe(model, opt, sinks=[records], every=1) as watch:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(loss=loss)
    assert captured["h"].dtype == torch.bfloat16
    record = records.items[0]
    row = record.keys.index(sw.SeriesKey("train", "1", "activation", ""))
    h = captured["h"].double().cpu().numpy()
    expected = [h.size, h.sum(), (h * h).sum(), h.min(), h.max(), np.sum(h == 0)]
    np.testing.assert_allclose([record.column(c)[row] for c in FIRST_SIX], expected, rtol=1e-4)
    assert record.scalars["loss"] == pytest.approx(float(loss.detach().float()), rel=1e-6)


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.BatchNorm2d(32),
            torch.nn.GELU(),
        )
        self.encoder = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.1)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x).flatten(2).transpose(1, 2)  # (batch, 64 positions, 32 channels)
        return self.head(self.encoder(h).mean(1))


def test_every_tap_kind_on_convolutions_norms_and_attention_makes_no_host_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every kind, every step, with dead units and exact non-finite counts, on convolutions, batch norm
    (buffers), dropout and attention; the training itself is bit-identical to an unwatched copy's. Under
    torch's deterministic algorithms (cuDNN's and attention's default backward kernels are not), which
    streamwatch's own summaries must also run under."""
    from streamwatch._taps import KINDS

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.use_deterministic_algorithms(True)

    def run(watched: bool) -> tuple[list[torch.Tensor], list[sw.StepRecord]]:
        torch.manual_seed(0)
        model = _ConvNet().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(16, 3, 16, 16, device="cuda")
        y = torch.randint(0, 10, (16,), device="cuda")
        records = sw.sinks.collect()
        watch = (
            sw.observe(
                model,
                opt,
                sinks=[records],
                taps=KINDS,
                cadence=dict.fromkeys(KINDS, 1),
                stats=("dead", "nonfinite"),
                every=1,
            )
            if watched
            else None
        )

        def steps() -> None:
            for _ in range(4):
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if watch is not None:
                    watch.step(loss=loss, outputs=logits, targets=y, batch_size=16)

        torch.manual_seed(1)
        torch.cuda.manual_seed(1)
        if watch is not None:
            with no_host_sync():
                steps()
            watch.close()
            assert watch.statistics().hook_errors == 0
        else:
            steps()
        state = [*model.state_dict().values(), torch.cuda.get_rng_state()]
        return state, records.items

    try:
        plain, _ = run(False)
        again, _ = run(False)
        watched, items = run(True)
    finally:
        torch.use_deterministic_algorithms(False)

    def differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
        return [i for i, (u, v) in enumerate(zip(a, b, strict=True)) if not torch.equal(u.cpu(), v.cpu())]

    assert differing(plain, again) == []  # (the comparison means something: training is deterministic)
    assert differing(plain, watched) == []
    assert [r.step for r in items] == [0, 1, 2, 3]
    kinds = {key.kind for key in items[-1].keys}
    assert set(KINDS) <= kinds
    assert all(np.isfinite([r.column(c) for c in FIRST_SIX]).all() for r in items)


@pytest.mark.parametrize("case", ["mlp", "transformer bf16"])
def test_a_sampled_step_keeps_the_launch_budget_on_the_gpu(case: str) -> None:
    """The launch counts of docs/performance.md#launch-counts, counted on the GPU itself: within the CPU
    budget plus the pinned copy's few ops, and no ``stack``/``cat`` of mixed dtypes (host syncs: the
    tests above)."""
    from tests.test_launches import BUDGET, COUNT_OPS

    plain, observed, _ = COUNT_OPS.count_case(case, device="cuda")
    assert observed.total - plain.total <= BUDGET[case] + 8, sorted((observed.ops - plain.ops).items())
    assert observed.mixed == 0


def test_unsampled_steps_keep_their_device_loss_and_logged_values_without_a_sync() -> None:
    """An unsampled step's device loss and a device value given to ``watch.log`` wait in the step log
    (no sync) and are read with the next record's one copy: every step's loss comes back. A logged device
    tensor the loop updates in place (a running count) is copied when logged: each step has its own."""
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    records = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[records], every=4)
    losses = [train_step(model, opt, watch, x, y).detach().clone()]  # warm-up (step 0, sampled)
    count = torch.zeros((), device="cuda")
    with no_host_sync():
        for _ in range(9):
            count += 1  # (in place)
            watch.log(count=count)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.log(double=loss.detach() * 2)
            watch.step(loss=loss)
            losses.append(loss.detach().clone())
    watch.close()
    steps = [s for r in records.items for s in r.every_step()]
    assert [s.step for s in steps] == list(range(10))
    for s, loss in zip(steps, losses, strict=True):
        assert s.scalars["loss"] == pytest.approx(loss.item(), rel=1e-6)
        if s.step:
            assert s.scalars["log/double"] == pytest.approx(2 * loss.item(), rel=1e-6)
            assert s.scalars["log/count"] == s.step


def test_a_device_loss_past_the_spike_line_is_sent_within_a_sentinel_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA loss is never read on the training thread, so LossSpike's line meets it when the sentinel
    reads its batch (16 steps or 50 ms, then the copy): the step log goes out in a scalar record then,
    LossSpike fires on the spike and sampling escalates — long before the next sampled step (100; the
    record of step 50, judged by the flush at 55, posted the line)."""
    import streamwatch._boundary as boundary
    from tests.test_detectors import batches, mlp
    from tests.test_spike_line import Arrivals

    monkeypatch.setattr(boundary, "SCALAR_SECONDS", 1e9)  # (no once-a-second record: only the line's)
    spike = 60
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arrivals = Arrivals()
    with sw.observe(model, opt, every=50) as watch:
        watch.pipe(sw.source() | sw.sinks.callback(arrivals))
        for i, (x, y) in enumerate(batches(100, spike_at=spike)):
            loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss)
            if i == 55:
                watch.flush()  # (the record of step 50's log judged: LossSpike's line posted)
    carrying = [step for step, carried, rows in arrivals.records if spike in carried and not rows]
    assert len(carrying) == 1, arrivals.records
    assert spike < carrying[0] <= spike + 16 + 4, arrivals.records
    assert watch.statistics().escalations >= 1
    assert [s for s, _, rows in arrivals.records if rows and spike < s < 100]  # (escalated: sampled)


# Importing inductor imports torch.utils.mkldnn, which uses the deprecated torch.jit.script_method.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:streamwatch.*CUDA graphs:RuntimeWarning")
def test_cuda_graphs_with_gradient_accumulation_and_the_loss_in_the_graph_lose_nothing_uncounted() -> None:
    """``torch.compile(mode="reduce-overhead")`` over the forward and the loss, two micro-batches a step,
    every fourth step sampled: CUDA graphs hand each pass's memory to the next, so the first micro-batch's
    rows and the earlier steps' losses are overwritten before the step's end unless streamwatch copied
    them (``streamwatch/_cudagraphs.py``). Training runs on, no step fails, every step's loss comes back,
    and each sampled step's activation rows hold both micro-batches, but for the first, whose first
    micro-batch's rows may have been overwritten (dropped and counted in ``skipped["cuda_graphs"]``)."""
    model, opt = make()
    generator = torch.Generator(device="cuda").manual_seed(0)
    data = [
        (
            torch.randn(32, 64, device="cuda", generator=generator),
            torch.randint(0, 10, (32,), device="cuda", generator=generator),
        )
        for _ in range(2)
    ]
    records = sw.sinks.collect()
    losses: list[float] = []
    with sw.observe(model, opt, sinks=[records], every=4) as watch:

        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(x), y)

        compiled = torch.compile(forward_loss, mode="reduce-overhead")
        for _ in range(12):
            for x, y in data:
                loss = compiled(x, y)
                loss.backward()
            losses.append(float(loss.detach().clone()))  # (the last micro-batch's: what watch.step gets)
            opt.step()
            opt.zero_grad()
            watch.step(loss=loss)
        stats = watch.statistics()
    assert stats.hook_errors == 0
    assert stats.failed_steps == 0
    steps = [s for r in records.items for s in r.every_step()]
    assert [s.step for s in steps] == list(range(12))
    missing = [s.step for s in steps if "loss" not in s.scalars]
    assert len(missing) <= stats.skipped.get("cuda_graphs", 0)
    for s in steps:
        if "loss" in s.scalars:
            assert s.scalars["loss"] == pytest.approx(losses[s.step], rel=1e-5)
    sampled = [r for r in records.items if any(k.kind == "activation" for k in r.keys)]
    assert [r.step for r in sampled] == [0, 4, 8]
    counts = [r.column("count")[r.keys.index(sw.SeriesKey("train", "0", "activation", ""))] for r in sampled]
    # a step whose first pass was overwritten holds the last pass only (its three activation rows dropped
    # and counted); after the first such step every pass's rows are copied in time, so at most the first
    assert all(count in (32 * 128, 2 * 32 * 128) for count in counts[:1])
    assert all(count == 2 * 32 * 128 for count in counts[1:])
    assert stats.skipped.get("cuda_graphs", 0) >= len(missing) + 3 * (counts[0] == 32 * 128)


def test_output_gradients_of_a_compiled_model_are_recorded_as_eager_ones_are_without_a_sync() -> None:
    """Inductor on CUDA: each output gradient is summarised inside the compiled backward and handed out
    as the probe's sink gradient (``_gradprobe``), with no host sync in the compiled steps; its rows equal
    eager mode's, and the weights train bit for bit as the unobserved compiled model's."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 64, device="cuda", generator=generator)
    y = torch.randint(0, 10, (32,), device="cuda", generator=generator)

    def train(observed: bool, compiled: bool) -> tuple[list[sw.StepRecord], list[torch.Tensor]]:
        model, opt = make()
        records = sw.sinks.collect()
        watch = sw.observe(model, opt, sinks=[records], every=1) if observed else None
        run = torch.compile(model, fullgraph=True) if compiled else model
        for step in range(4):
            with no_host_sync() if step >= 2 and compiled and observed else contextlib.nullcontext():
                for _ in range(2):
                    torch.nn.functional.cross_entropy(run(x), y).backward()
                opt.step()
                opt.zero_grad()
                if watch is not None:
                    watch.step()
        if watch is not None:
            watch.close()
            assert watch.statistics().hook_errors == 0
            assert "compiled_grad_hook" not in watch.statistics().skipped
        return records.items, [p.detach().clone() for p in model.parameters()]

    torch._dynamo.reset()
    compiled, weights = train(observed=True, compiled=True)
    torch._dynamo.reset()
    _, unobserved = train(observed=False, compiled=True)
    torch._dynamo.reset()
    eager, _ = train(observed=True, compiled=False)
    assert all(torch.equal(a, b) for a, b in zip(weights, unobserved, strict=True))
    for got, want in zip(compiled, eager, strict=True):
        for layer in ("0", "1", "2"):
            key = sw.SeriesKey("train", layer, "output_grad", "")
            i, j = got.keys.index(key), want.keys.index(key)
            for name in ("count", "sumsq", "min", "max", "sumabs"):
                assert got.column(name)[i] == pytest.approx(want.column(name)[j], rel=1e-4), (layer, name)


def test_a_gradient_penaltys_pass_is_skipped_on_the_device_thread_too() -> None:
    """WGAN-GP on the GPU: the hooks run on autograd's device thread, where grad mode and the running
    backward are that thread's; the penalty's ``create_graph`` pass is told apart there as well."""
    from tests.test_gradient_penalty import check_penalty_pass

    check_penalty_pass("cuda")


def test_a_model_moved_to_the_gpu_after_observe_takes_the_gpus_summaries() -> None:
    """``observe(model, opt)`` before ``model.cuda()`` (or ``accelerator.prepare()``, ``fabric.setup()``):
    the first boundary on the GPU loads what a model observed on the GPU from the start gets (the Triton
    kernels, where Triton loads), the values match a reference, and no step syncs the host."""
    torch.manual_seed(0)
    moved = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(moved.parameters(), lr=0.1)
    captured: dict[str, torch.Tensor] = {}
    moved[0].register_forward_hook(lambda m, a, out: captured.__setitem__("h", out.detach().clone()))
    records = sw.sinks.collect()
    watch = sw.observe(moved, opt, sinks=[records], every=1)
    assert watch.statistics().kernel.startswith(("fused", "torch"))
    moved.cuda()  # (the parameters keep their identity: the optimizer and the hooks still hold them)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    train_step(moved, opt, watch, x, y)  # (the boundary after it sees the GPU)
    with no_host_sync():
        train_step(moved, opt, watch, x, y)
    watch.close()
    born, _ = make()
    with sw.observe(born, every=1) as on_the_gpu:
        assert watch.statistics().kernel == on_the_gpu.statistics().kernel
    record = records.items[-1]
    row = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    h = captured["h"].double().cpu().numpy()
    expected = [h.size, h.sum(), (h * h).sum(), h.min(), h.max(), np.sum(h == 0)]
    np.testing.assert_allclose([record.column(c)[row] for c in FIRST_SIX], expected, rtol=1e-5)


def test_a_sparse_embedding_gradient_is_summarised_without_a_host_sync() -> None:
    """``nn.Embedding(sparse=True)`` on the GPU: its gradient's row is the dense gradient's (duplicated
    tokens summed, the rows never looked up counted as zeros), read without waiting for the device
    (``_sparse``: no ``coalesce()``). No optimizer step: torch's own sparse update is not ours to test."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, 32, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8 * 32, 4)
    ).cuda()
    grads: list[torch.Tensor] = []

    def step(watch: sw.Watch | None) -> None:
        tokens = torch.randint(0, 50, (16, 8), device="cuda")  # (tokens repeat: entries to sum)
        model.zero_grad()
        loss = model(tokens).pow(2).mean()
        loss.backward()
        grads.append(model[0].weight.grad.detach().clone())  # type: ignore[union-attr]
        if watch is not None:
            watch.step(loss=loss)

    step(None)
    try:
        with no_host_sync():
            step(None)
    except RuntimeError as exc:
        pytest.skip(f"this torch syncs in a sparse embedding's own backward: {exc}")
    grads.clear()
    records = sw.sinks.collect()
    watch = sw.observe(model, sinks=[records], every=1)
    step(watch)
    with no_host_sync():
        for _ in range(3):
            step(watch)
    watch.close()
    assert "sparse" not in watch.statistics().skipped
    key = sw.SeriesKey("train", "0", "param_grad", "weight")
    for record, grad in zip(records.items, grads, strict=True):
        g = grad.to_dense().double().cpu().numpy()
        expected = [g.size, g.sum(), (g * g).sum(), g.min(), g.max(), np.sum(g == 0)]
        row = record.keys.index(key)
        np.testing.assert_allclose([record.column(c)[row] for c in FIRST_SIX], expected, rtol=1e-5, atol=1e-7)
