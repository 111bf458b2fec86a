"""The trainer callbacks serve: ``StreamwatchCallback(expose=..., run_dir=...)`` for Lightning and Hugging
Face, scraped over HTTP *during* a real ``fit()``/``train()`` (from a callback of the test's, while the
trainer runs), what each trainer logs forwarded to ``/metrics``, the endpoint closed when training ends,
the run file readable with ``read_run(run_dir)``; and a real 2-process ``torchrun`` job of each trainer,
where every rank scrapes every rank's port mid-training.

Before: neither callback took a port, ``callback.watch`` was None before ``fit()`` and closed after, so
serving needed an undocumented subclass; HF forwarded only ``logs["loss"]`` and had no batch size;
Lightning's ``self.log`` values never reached ``/metrics`` and only ``optimizers[0]`` was observed,
silently.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import streamwatch as sw
from streamwatch.integrations._common import Logged, serving_options
from streamwatch.sinks import DEFAULT_PORT, read_run
from streamwatch.testing import table
from tests import torchrun
from tests.hfnet import HFNet

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:The '.*' does not have many workers"),
]


def _dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _value(body: str, name: str, **labels: str) -> float:
    """The value of the one sample ``name{labels...}`` (identity labels aside) in a text exposition."""
    found = []
    for line in body.splitlines():
        match = re.fullmatch(rf"{name}\{{([^}}]*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            found.append(float(match.group(2)))
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _closed(url: str) -> bool:
    try:
        _scrape(url)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


# -- arguments ------------------------------------------------------------------------------------------


def test_serving_arguments_are_checked_when_the_callback_is_made() -> None:
    assert serving_options(True, "127.0.0.1", None, "C").port == DEFAULT_PORT == 16400
    assert serving_options(False, "127.0.0.1", None, "C").port is None
    assert serving_options(9500, "0.0.0.0", "runs/x", "C").run_dir == Path("runs/x")
    with pytest.raises(TypeError, match=r"^Expected `expose` to be True, False or a port number, got 'yes'$"):
        serving_options("yes", "127.0.0.1", None, "C")
    with pytest.raises(ValueError, match=r"^Expected `expose` to be an integer in \[0, 65535\]"):
        serving_options(70000, "127.0.0.1", None, "C")
    with pytest.raises(ValueError, match=r"^Expected `host` to be an interface address"):
        serving_options(True, "", None, "C")
    with pytest.raises(TypeError, match=r"^Expected `run_dir` to be a path"):
        serving_options(True, "127.0.0.1", 3, "C")


def test_logged_values_are_named_capped_and_the_refusals_counted() -> None:
    store = sw.SeriesStore(metrics=())
    logged = Logged(store, "StreamwatchCallback", cap=2)
    values = {"val/acc": torch.tensor(0.5), "epoch": 1, "eval_loss": 0.25, "text": "x", "many": torch.ones(3)}
    logged.put(values)
    with pytest.warns(RuntimeWarning, match=r"StreamwatchCallback: the trainer logged 'n_total', 'third'"):
        logged.put({"n_total": 1.0, "third": 3.0, "epoch": 2.0})  # a promtool-refused ending; past the cap
    logged.put({"fourth": 4.0})  # warned once
    latest = {(s.name, tuple(s.labels.items())): s.value for s in store.samples()}
    assert latest == {
        ("streamwatch_logged_val_acc", ()): 0.5,
        ("streamwatch_logged_epoch", ()): 2.0,
        ("streamwatch_loss", (("phase", "eval"),)): 0.25,
        ("streamwatch_logged_values_refused", ()): 3.0,
    }


def test_a_value_put_and_a_records_value_of_one_series_serve_the_later_one() -> None:
    """A trainer's logged learning rate and the optimizer's (``lr/0`` in a record) are one series:
    served once (two samples of one series fail a scrape), with the later value."""

    store = sw.SeriesStore(metrics=())
    lr = ("streamwatch_learning_rate", (("group", "0"),))

    def served() -> list[float]:
        return [s.value for s in store.samples() if (s.name, tuple(s.labels.items())) == lr]

    store.send(sw.StepRecord(0, 0.0, 0, (), table(rows=0), {"lr/0": 0.1}))
    assert served() == [0.1]
    store.put([sw.Sample("streamwatch_learning_rate", {"group": "0"}, 0.05)])
    assert served() == [0.05]
    store.send(sw.StepRecord(1, 0.0, 0, (), table(rows=0), {"lr/0": 0.02}))
    assert served() == [0.02]


# -- Lightning ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pl() -> Any:
    return pytest.importorskip("lightning.pytorch")


def _lit_module(pl: Any) -> Any:
    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            self.log("train/acc", (logits.argmax(1) == y).float().mean())
            return F.cross_entropy(logits, y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.net(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


def _trainer(pl: Any, tmp_path: Path, callbacks: list[Any], **settings: Any) -> Any:
    return pl.Trainer(
        **{
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 2,
            "log_every_n_steps": 1,
            "num_sanity_val_steps": 1,
            "callbacks": callbacks,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": tmp_path,
            **settings,
        }
    )


def test_lightning_serves_metrics_while_fit_runs_with_what_the_module_logs(pl: Any, tmp_path: Path) -> None:
    from streamwatch.integrations.lightning import StreamwatchCallback

    callback = StreamwatchCallback(expose=0, run_dir=tmp_path / "run", every=1)
    assert callback.exporter is None
    assert callback.watch is None
    scraped: dict[str, str] = {}

    class Scrape(pl.Callback):  # type: ignore[misc]
        """Scrapes /metrics from inside the fit: in its 4th optimizer step, and after epoch 0's validation."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 4 and "training" not in scraped:
                assert callback.watch is not None
                assert callback.exporter is not None
                callback.watch.flush()  # (the worker has handled the steps so far)
                scraped["training"] = _scrape(callback.exporter.url)

        def on_validation_end(self, trainer: Any, *args: Any) -> None:
            if not trainer.sanity_checking and "validation" not in scraped:
                assert callback.exporter is not None
                scraped["validation"] = _scrape(callback.exporter.url)

    trainer = _trainer(pl, tmp_path, [callback, Scrape()])
    torch.manual_seed(0)
    trainer.fit(
        _lit_module(pl), DataLoader(_dataset(40, 1), batch_size=8), DataLoader(_dataset(16, 2), batch_size=8)
    )
    assert trainer.global_step == 10

    body = scraped["training"]
    assert _value(body, "streamwatch_steps_total") == 4
    assert _value(body, "streamwatch_loss", phase="train") > 0
    assert _value(body, "streamwatch_batch_size") == 8
    assert _value(body, "streamwatch_last_step_samples_per_second") > 0
    assert 0 <= _value(body, "streamwatch_logged_train_acc") <= 1  # self.log("train/acc", ...)
    assert 'kind="param_grad"' in body
    assert "streamwatch_logged_val_loss" not in body  # the sanity check's is not a validation's
    assert _value(scraped["validation"], "streamwatch_logged_val_loss") > 0

    assert callback.exporter is not None
    assert callback.watch is not None
    assert callback.watch.closed
    assert _closed(callback.exporter.url)  # closed at the fit's teardown
    run = read_run(tmp_path / "run")  # the run directory, as the command line takes it
    assert run.path == tmp_path / "run" / "run.jsonl"
    assert [r.step for r in run.records][:10] == list(range(10))
    logged = {s.name: s.value for s in callback.watch.snapshot() if s.name.startswith("streamwatch_logged_")}
    assert logged["streamwatch_logged_val_loss"] == pytest.approx(float(trainer.callback_metrics["val_loss"]))


def _two_optimizers(pl: Any) -> Any:
    class GAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.g = nn.Linear(6, 6)
            self.d = nn.Linear(6, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_g, opt_d = self.optimizers()
            x, _ = batch
            for opt in (opt_d, opt_g):
                loss = self.d(self.g(x)).pow(2).mean()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [
                torch.optim.SGD(self.g.parameters(), lr=0.1),
                torch.optim.Adam(self.d.parameters(), lr=0.01),
            ]

    return GAN()


def test_lightning_observes_every_optimizer_or_the_one_asked_for(pl: Any, tmp_path: Path) -> None:
    """A GAN's two optimizers (manual optimization): by default both, each parameter's update read around
    its own optimizer's step and both learning rates recorded; ``optimizer=i`` observes that one only."""
    from streamwatch.integrations.lightning import StreamwatchCallback

    for index, lrs, stepped in ((None, [0.1, 0.01], {"g", "d"}), (0, [0.1], {"g"}), (1, [0.01], {"d"})):
        records = sw.sinks.collect()
        callback = StreamwatchCallback(optimizer=index, sinks=[records], every=1, cadence={"update": 1})
        trainer = _trainer(pl, tmp_path, [callback], max_epochs=1, limit_val_batches=0)
        loader = DataLoader(_dataset(8, 1), batch_size=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_two_optimizers(pl), loader)
        assert [str(w.message) for w in caught if "treamwatch" in str(w.message)] == []
        record = records.items[-1]
        assert [v for k, v in sorted(record.scalars.items()) if k.startswith("lr/")] == lrs
        assert {k.layer for k in record.keys if k.kind == "update"} == stepped
        assert {k.layer for k in record.keys if k.kind == "param_grad"} == {"g", "d"}
    with pytest.raises(ValueError, match=r"^Expected `optimizer` to be an index into the 2 optimizer"):
        _trainer(pl, tmp_path, [StreamwatchCallback(optimizer=2)], max_epochs=1).fit(
            _two_optimizers(pl), DataLoader(_dataset(8, 1), batch_size=4)
        )


# -- Hugging Face ---------------------------------------------------------------------------------------


def test_transformers_serves_metrics_while_train_runs_with_what_the_trainer_logs(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from streamwatch.integrations.transformers import StreamwatchCallback

    callback = StreamwatchCallback(expose=0, run_dir=tmp_path / "run", every=1)
    scraped: dict[int, str] = {}

    class Scrape(transformers.TrainerCallback):  # type: ignore[misc]
        """Scrapes /metrics from inside train(), at the end of its 4th optimizer step (after step 2's
        evaluation and step 3's log)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 4:
                assert callback.watch is not None
                assert callback.exporter is not None
                callback.watch.flush()
                scraped[4] = _scrape(callback.exporter.url)

    torch.manual_seed(0)
    train, val = _dataset(20, 1), _dataset(8, 2)
    trainer = transformers.Trainer(  # 5 micro-batches of 4 an epoch, accumulating 2: steps of 2, 2, 1
        model=HFNet(),
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_train_epochs=2,
            learning_rate=0.1,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        ),
        train_dataset=[{"x": x, "labels": y} for x, y in train],
        eval_dataset=[{"x": x, "labels": y} for x, y in val],
        callbacks=[callback, Scrape()],
    )
    trainer.train()
    history = trainer.state.log_history
    logged = {h["step"]: h for h in history if "loss" in h}
    evaluated = {h["step"]: h for h in history if "eval_loss" in h}

    body = scraped[4]
    assert _value(body, "streamwatch_steps_total") == 3  # (step 4 is recorded with the loss logged after it)
    assert _value(body, "streamwatch_loss", phase="eval") == evaluated[2]["eval_loss"]
    assert _value(body, "streamwatch_grad_norm") == logged[3]["grad_norm"]
    records = read_run(tmp_path / "run").records
    # the learning rate: one series, the later of the rate HF logged for step 3 (before its scheduler
    # stepped) and the optimizer's in step 3's record (after; the record reached the store later)
    assert logged[3]["learning_rate"] != records[2].scalars["lr/0"]
    assert _value(body, "streamwatch_learning_rate", group="0") == records[2].scalars["lr/0"]
    assert _value(body, "streamwatch_loss", phase="train") == logged[3]["loss"]
    assert _value(body, "streamwatch_batch_size") == 4  # step 3: the epoch's last, one micro-batch
    assert _value(body, "streamwatch_last_step_samples_per_second") > 0
    assert _value(body, "streamwatch_logged_epoch") == logged[3]["epoch"]
    assert body.count('streamwatch_learning_rate{group="0",') == 1  # logged and the optimizer's: one series

    assert [r.scalars.get("batch_size") for r in records[:6]] == [8.0, 8.0, 4.0, 8.0, 8.0, 4.0]
    assert callback.exporter is not None
    assert _closed(callback.exporter.url)  # closed when training ended
    assert callback.watch is not None
    assert callback.watch.closed


# -- two processes --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("trainer", ["lightning", "transformers"])
def test_every_rank_of_a_two_process_run_serves_its_own_port_during_training(
    trainer: str, tmp_path: Path
) -> None:
    pytest.importorskip({"lightning": "lightning.pytorch", "transformers": "transformers"}[trainer])
    base = torchrun.free_ports(2)
    torchrun.run(
        ROOT / "tests" / "scripts" / "trainer_serve.py", 2, trainer, str(base), str(tmp_path), timeout=220
    )
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["url"] == f"http://127.0.0.1:{base + rank}/metrics"
        assert out["record_ranks"] == [rank]
        assert out["closed"] is True
        # what this rank saw of every rank's /metrics in the middle of training
        for local_rank, body in out["bodies"].items():
            assert _value(body, "streamwatch_info", rank=local_rank, world_size="2") == 1
            # three optimizer steps done; HF's third is recorded with the loss logged after it
            assert _value(body, "streamwatch_steps_total") == (3 if trainer == "lightning" else 2)
            assert _value(body, "streamwatch_loss", phase="train") > 0
            if trainer == "lightning":
                assert "streamwatch_logged_train_acc{" in body
            else:
                assert "streamwatch_grad_norm{" in body
        assert read_run(tmp_path / "run" / f"run-rank{rank}.jsonl").records[0].rank == rank


def test_a_port_in_use_fails_the_fit_at_its_start_and_leaves_nothing_attached(
    pl: Any, tmp_path: Path
) -> None:
    import socket

    from streamwatch.integrations.lightning import StreamwatchCallback

    model = _lit_module(pl)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        callback = StreamwatchCallback(expose=port, run_dir=tmp_path / "run")
        trainer, loader = (
            _trainer(pl, tmp_path, [callback], max_epochs=1),
            DataLoader(_dataset(8, 1), batch_size=4),
        )
        with pytest.raises(OSError, match=rf"{port}.*already in use"):
            trainer.fit(model, loader, loader)
    assert callback.watch is None
    hooks = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooks == []
    assert read_run(tmp_path / "run").records == []  # the run file was made, then closed: empty
