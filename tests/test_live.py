"""The live console view (``streamwatch._live.LiveView``) rendered from real training."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import streamwatch as sw

pytest.importorskip("rich")

from rich.console import Console, RenderableType

from streamwatch import _live
from streamwatch._live import LiveView, format_count, format_percent, format_value
from tests.training import Train

URL = "http://127.0.0.1:16400/metrics"
BATCH = (32, 8)  # 32 samples of MLP's 8 features (3 classes)


class MLP(nn.Module):
    """Named layers, so the table's layer names are checkable."""

    def __init__(self, hidden: int = 16, depth: int = 1) -> None:
        super().__init__()
        self.fc_in = nn.Linear(8, hidden)
        self.act = nn.ReLU()
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth - 1))
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc_in(x))
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)  # type: ignore[no-any-return]


def text_of(renderable: RenderableType) -> str:
    console = Console(width=100, record=True, file=io.StringIO(), force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def row(text: str, layer: str) -> list[str]:
    """The cells of the table row for ``layer``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│ \n").split("│")]
        if cells and cells[0] == layer:
            return cells
    raise AssertionError(f"no row for layer {layer!r} in:\n{text}")


def layer_names(text: str) -> list[str]:
    """The first cell of every table row (the header row is drawn with ┃, not │)."""
    return [line.strip("│ ").split("│")[0].strip() for line in text.splitlines() if line.startswith("│")]


def tensor(watch: sw.Watch, layer: str, kind: str, stat: str, param: str = "") -> float:
    for s in watch.snapshot():
        labels = s.labels
        if s.name == "streamwatch_tensor" and (
            labels["layer"],
            labels["kind"],
            labels["param"],
            labels["stat"],
        ) == (layer, kind, param, stat):
            return s.value
    raise AssertionError(f"no {layer}/{kind}/{param}/{stat} in the snapshot")


def scalar(watch: sw.Watch, name: str) -> float:
    return next(s.value for s in watch.snapshot() if s.name == name)


@pytest.fixture
def trained(train: Train) -> Iterator[sw.Watch]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1) as watch:
        train(model, opt, watch, 5, shape=BATCH, flush=True)
        yield watch


def test_render_every_section(trained: sw.Watch) -> None:
    watch = trained
    text = text_of(LiveView(watch, total_steps=10, url=URL, title="streamwatch demo").render(5))
    lines = text.splitlines()
    # 1. header
    assert "streamwatch demo" in lines[0]
    assert URL in lines[0]
    # 2. progress
    assert "5/10" in text
    assert f"{1.0 / scalar(watch, 'streamwatch_last_step_seconds'):.1f} steps/s" in text
    # 3. loss and accuracy, formatted as the view does, equal to the snapshot's
    loss = scalar(watch, "streamwatch_loss")
    assert f"loss {format_value(loss)}" in text
    assert f"accuracy {format_percent(scalar(watch, 'streamwatch_accuracy'))}" in text
    # 4. per-layer table: one row per layer, in forward order, with the snapshot's values
    assert "dead units" in text
    assert "non-finite" in text
    assert layer_names(text) == ["fc_in", "act", "head"]
    fc_in = row(text, "fc_in")
    assert fc_in[1] == format_value(tensor(watch, "fc_in", "activation", "l2"))
    assert fc_in[2] == format_value(tensor(watch, "fc_in", "param_grad", "l2", "weight"))
    assert fc_in[3] == format_value(tensor(watch, "fc_in", "update", "l2", "weight"))
    assert fc_in[4] == format_percent(tensor(watch, "fc_in", "activation", "dead_fraction"))
    assert fc_in[5] == "0"
    # a layer without parameters: the output gradient's norm, no update
    act = row(text, "act")
    assert act[2] == format_value(tensor(watch, "act", "output_grad", "l2"))
    assert act[3] == "—"
    assert act[4] == format_percent(tensor(watch, "act", "activation", "dead_fraction"))
    # 5. health
    stats = watch.statistics()
    dropped = stats.dropped_oldest + stats.dropped_newest + stats.slots_exhausted
    assert f"dropped {dropped}" in text
    assert f"queue {stats.queue_len} (max {stats.queue_high_water})" in text
    mean = stats.overhead_seconds_total / stats.steps  # over the run: sampled and unsampled steps
    overhead = f"overhead {1000 * mean:.2f} ms/step"
    share = mean / scalar(watch, "streamwatch_last_step_seconds")
    assert f"{overhead} ({format_percent(share)} of a step)" in text
    assert "hook errors 0" in text


def test_formatting() -> None:
    assert format_value(0.0123) == "1.23e-02"
    assert format_value(None) == "—"
    assert (format_value(math.nan), format_value(math.inf)) == ("nan", "inf")  # shown, not "missing"
    assert format_percent(0.5) == "50.0%"
    assert format_count(2.0) == "2"
    assert format_count(math.inf) == "—"


def test_empty_watch_renders_dashes() -> None:
    model = MLP()
    with sw.observe(model, every=1) as watch:
        text = text_of(LiveView(watch, total_steps=10).render(0))
    assert text.startswith("streamwatch  ·  —")
    assert "0/10" in text
    assert "loss —" in text
    assert "accuracy —" in text
    assert "—" in row(text, "—")
    assert "dropped 0" in text
    assert "overhead —" in text


def test_nonfinite_counts_sum_over_the_layers_series() -> None:
    torch.manual_seed(0)
    model = MLP()
    with sw.observe(model, stats=("dead", "nonfinite"), every=1) as watch:
        x = torch.randn(4, 8)
        x[0, :3] = math.nan
        model(x)
        watch.step()
        assert watch.flush()
        text = text_of(LiveView(watch, total_steps=1).render(1))
        expected = sum(
            s.value
            for s in watch.snapshot()
            if s.name == "streamwatch_tensor"
            and s.labels["layer"] == "fc_in"
            and s.labels["stat"] == "nonfinite"
        )
    assert expected > 0
    assert row(text, "fc_in")[5] == format_count(expected)
    assert row(text, "fc_in")[1] == "—"  # (the store leaves a non-finite tensor's norms out)


def test_a_nan_loss_is_shown_as_nan() -> None:
    model = MLP()
    with sw.observe(model, every=1) as watch:
        model(torch.randn(4, 8))
        watch.step(loss=math.nan)
        assert watch.flush()
        text = text_of(LiveView(watch, total_steps=1).render(1))
    assert "loss nan" in text


def test_more_layers_than_top(train: Train) -> None:
    torch.manual_seed(0)
    model = MLP(depth=4)  # fc_in, act, blocks.0-2, head
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, every=1) as watch:
        train(model, opt, watch, 2, shape=BATCH, flush=True)
        text = text_of(LiveView(watch, total_steps=2, top=3).render(2))
    assert "… 3 more" in text
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) == 3 + 1  # the top layers and the summary
    assert [line.strip("│ ").split("│")[0].strip() for line in rows] == [
        "fc_in",
        "act",
        "blocks.0",
        "… 3 more",
    ]


def test_live_updates_in_place_and_shows_the_last_frame(train: Train) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    console = Console(record=True, file=io.StringIO(), force_terminal=True, width=100)
    with sw.observe(model, opt, every=1) as watch:
        with LiveView(watch, total_steps=4, url=URL, console=console) as view:
            train(model, opt, watch, 4, shape=BATCH, after_watch_step=lambda s: view.update(s.index + 1))
            watch.flush()
        text = console.export_text()
    assert "streamwatch" in text
    assert "4/4" in text
    assert "fc_in" in text


def test_update_is_throttled(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(_live, "_now", lambda: now[0])
    rendered: list[int] = []

    class Counting(LiveView):
        def render(self, step: int) -> RenderableType:
            rendered.append(step)
            return super().render(step)

    console = Console(record=True, file=io.StringIO(), force_terminal=True, width=100)
    with sw.observe(MLP(), every=1) as watch, Counting(watch, total_steps=50, console=console) as view:
        rendered.clear()  # the initial frame
        for step in range(1, 21):
            view.update(step)  # the clock stands still: only the first is drawn
        assert rendered == [1]
        now[0] += 0.2
        view.update(21)
        assert rendered == [1, 21]
        view.update(22)
    assert rendered == [1, 21, 22]  # the last step, on exit
    assert "22/50" in console.export_text()


def test_update_outside_the_context_raises() -> None:
    with sw.observe(MLP(), every=1) as watch:
        view = LiveView(watch, total_steps=1)
        with pytest.raises(RuntimeError, match="outside"):
            view.update(1)


def test_importing_streamwatch_does_not_import_rich() -> None:
    code = "import sys, streamwatch; assert 'rich' not in sys.modules, 'rich imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
