"""plot(): a recorded run drawn as a PNG, and the values it draws (series())."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamwatch import testing
from streamwatch._plot import plot, series
from streamwatch._taps import DEFAULT_TAPS
from streamwatch.sinks import RunData, RunFile, read_run
from tests.recording import record_run

STEPS = 12


def _train(path: Path, taps: tuple[str, ...] = DEFAULT_TAPS) -> RunData:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 3),
    )
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    return record_run(path, model, x, y, STEPS, lr=0.2, taps=taps)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunData:
    return _train(tmp_path_factory.mktemp("plot") / "run.jsonl")


def test_series_matches_a_numpy_reference(run: RunData) -> None:
    s = series(run)
    records = run.records
    assert s["steps"] == [r.step for r in records] == list(range(STEPS))
    np.testing.assert_array_equal(s["loss"], [r.scalars["loss"] for r in records])
    np.testing.assert_array_equal(s["accuracy"], [r.scalars["accuracy"] for r in records])
    assert all(math.isnan(v) for v in s["eval_accuracy"])
    assert sorted(s["grad_l2"]) == sorted(s["update_ratio"]) == ["0", "2", "4"]
    assert sorted(s["dead"]) == ["0", "1", "2", "3", "4"]
    for j, record in enumerate(records):
        keys = record.keys
        sumsq = record.column("sumsq")
        for layer in ("0", "2", "4"):
            (g,) = [
                i for i, k in enumerate(keys) if (k.layer, k.kind, k.name) == (layer, "param_grad", "weight")
            ]
            assert s["grad_l2"][layer][j] == pytest.approx(math.sqrt(sumsq[g]), rel=1e-12)
            u = sum(sumsq[i] for i, k in enumerate(keys) if (k.layer, k.kind) == (layer, "update"))
            w = sum(sumsq[i] for i, k in enumerate(keys) if (k.layer, k.kind) == (layer, "param"))
            assert s["update_ratio"][layer][j] == pytest.approx(math.sqrt(u / w), rel=1e-12)
            assert 0 < s["update_ratio"][layer][j] < 1
        for layer in ("0", "1", "2", "3", "4"):
            (a,) = [i for i, k in enumerate(keys) if (k.layer, k.kind) == (layer, "activation")]
            dead, units = record.column("dead")[a], record.column("units")[a]
            assert s["dead"][layer][j] == pytest.approx(dead / units, rel=1e-12)


def _colors(rgb: np.ndarray) -> int:
    """Distinct RGB colours (packed into one int per pixel: np.unique(axis=0) is slow)."""
    q = (rgb * 255).round().astype(np.uint32)
    return len(np.unique(q[..., 0] << 16 | q[..., 1] << 8 | q[..., 2]))


def _check_png(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
    image = imread(path)
    assert image.shape[:2] == (900, 1400)  # figsize (14, 9) at 100 dpi
    rgb = image[..., :3]
    assert rgb.std() > 0.05
    assert _colors(rgb) > 200
    return rgb


def test_plot_writes_a_png_with_four_panels(run: RunData, tmp_path: Path) -> None:
    out = plot(run, tmp_path / "run.png")
    assert out == tmp_path / "run.png"
    rgb = _check_png(out)
    # the heatmap: top right quadrant, inside the axes (a band of the middle of it)
    h, w = rgb.shape[:2]
    band = rgb[int(h * 0.15) : int(h * 0.4), int(w * 0.6) : int(w * 0.8)]
    assert band.std() > 0.05
    assert _colors(band) > 10


def test_plot_top_limits_layers(run: RunData, tmp_path: Path) -> None:
    out = plot(run, tmp_path / "top.png", top=2)
    _check_png(out)
    with pytest.raises(ValueError, match="top"):
        plot(run, tmp_path / "bad.png", top=0)


def test_plot_without_gradients_says_no_data(tmp_path: Path) -> None:
    run = _train(tmp_path / "run.jsonl", taps=("activation", "param", "update"))
    assert not any(k.kind == "param_grad" for r in run.records for k in r.keys)
    s = series(run)
    assert s["grad_l2"] == {}
    assert s["dead"]
    _check_png(plot(run, tmp_path / "run.png"))


def test_plot_empty_run(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    RunFile(path).close()
    run = read_run(path)
    out = plot(run, tmp_path / "empty.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_file_of_several_ranks_is_drawn_one_rank_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two ranks' records interleaved in one file: drawn together, their steps repeated and the loss
    zigzagged between the ranks. The first record's rank is drawn unless ``rank=`` picks another."""
    import streamwatch._plot as plotting
    from streamwatch import SeriesKey, StepRecord
    from streamwatch.cli import main

    path = tmp_path / "run.jsonl"
    sink = RunFile(path)
    key = SeriesKey("train", "fc", "param_grad", "weight")
    for step in range(3):
        for rank, loss in ((1, 5.0), (0, 1.0)):
            row = testing.table(count=2, sumsq=9, min=-3, zeros=1, fill=0.0)
            sink.send(StepRecord(step, 0.0, rank, (key,), row, {"loss": loss + step}))
    sink.close()
    drawn: list[list[tuple[int, int, float]]] = []
    real_series = plotting.series

    def spy(run: RunData) -> Any:
        drawn.append([(r.rank, r.step, r.scalars["loss"]) for r in run.records])
        return real_series(run)

    monkeypatch.setattr(plotting, "series", spy)
    run = read_run(path)
    _check_png(plot(run, tmp_path / "a.png"))
    _check_png(plot(run, tmp_path / "b.png", rank=0))
    assert drawn == [[(1, s, 5.0 + s) for s in range(3)], [(0, s, 1.0 + s) for s in range(3)]]
    with pytest.raises(ValueError, match="has no record of rank 7; its ranks: 0, 1"):
        plot(run, tmp_path / "c.png", rank=7)
    assert main(["plot", str(path), "-o", str(tmp_path / "d.png"), "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "holds ranks 0, 1; drew rank 0 (--rank picks another: 1)" in out


def test_importing_streamwatch_does_not_import_matplotlib() -> None:
    import subprocess
    import sys

    code = "import sys, streamwatch, streamwatch._plot; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
