"""Trainer integrations, each run for real on the CPU for a few steps (streamwatch.integrations).

* Lightning (``StreamwatchCallback``): one record per optimizer step under gradient accumulation, the
  loss equal to what ``training_step`` computed (as Lightning scales it), batch sizes, validation under
  ``phase="eval"``, the watch closed and every hook gone after ``fit`` (and after a failed ``fit``), the
  final weights bit-identical with and without the callback, and the rank of every record equal to
  ``trainer.global_rank`` in a real 2-rank DDP run under ``torchrun``.
* Hugging Face (``StreamwatchCallback``): one record per optimizer step, the loss equal to the one the
  Trainer logged (``state.log_history``) and to an independent computation, evaluation under
  ``phase="eval"``, the watch closed and every hook gone; ``gradient_checkpointing=True`` records what
  training without it records.
* Both trainers' ``torch.compile`` with gradient accumulation: compiled once, every micro-batch recorded.
* Accelerate: ``observe(accelerator.unwrap_model(model), optimizer)`` unchanged, one record per
  optimizer step under ``accelerator.accumulate``; the ``AcceleratedOptimizer`` itself is unwrapped to
  the optimizer it steps.
* Lightning Fabric: ``observe()`` of what ``fabric.setup`` returns records the model under its own layer
  names, clipped gradients with the norm ``fabric.clip_gradients`` returned, training unchanged.
* PEFT: a LoRA layer is recorded as the layer the model sees (its adapted output and output gradient),
  beside the leaves inside it.
* ``import streamwatch`` imports none of the trainer libraries, and a missing one is an ImportError
  naming the extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import streamwatch as sw
from streamwatch._taps import KINDS
from tests import torchrun
from tests.hfnet import HFNet
from tests.training import train

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    # Lightning 2.6 builds torch pytree LeafSpec objects, which torch 2.13 deprecates (Lightning's own code)
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    # on a machine with more than 2 CPUs Lightning suggests DataLoader workers
    pytest.mark.filterwarnings("ignore:The '.*' does not have many workers"),
]


def _dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _leftover_hooks(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """Every hook still registered on the model's modules and parameters, and on the optimizer."""
    found = []
    for name, module in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, attr, None):
                found.append(f"{name or '<root>'}.{attr}")
    for name, param in model.named_parameters():
        for attr in ("_post_accumulate_grad_hooks", "_backward_hooks"):
            if getattr(param, attr, None):
                found.append(f"{name}.{attr}")
    if optimizer is not None:
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            if getattr(optimizer, attr, None):
                found.append(f"optimizer.{attr}")
    return found


def _eval_records(records: list[sw.StepRecord]) -> set[int]:
    """The indices of the records that hold evaluation-phase summaries."""
    return {i for i, record in enumerate(records) if record.rows(phase="eval")}


# -- Lightning ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pl() -> Any:
    return pytest.importorskip("lightning.pytorch")


def _lightning_module(pl: Any, fail_at: int | None = None) -> Any:
    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
            self.losses: list[torch.Tensor] = []  # every training batch's loss, as training_step computed it

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            if fail_at is not None and self.global_step >= fail_at:
                raise RuntimeError("the training step failed")
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.detach().clone())
            return {"loss": loss, "samples": len(y)}

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Net()


def _fit(
    pl: Any, tmp_path: Path, callbacks: list[Any], model: Any = None, *, epochs: int = 2, **fit: Any
) -> tuple[Any, Any]:
    """Two epochs of 5 batches of 8 with ``accumulate_grad_batches=2`` (optimizer steps on batches 2, 4
    and 5 of each epoch: 6 steps), one sanity-check batch and a 2-batch validation after each epoch."""
    torch.manual_seed(0)  # the initial weights and the dropout masks
    if model is None:
        model = _lightning_module(pl)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        num_sanity_val_steps=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    train = DataLoader(_dataset(40, seed=1), batch_size=8)
    trainer.fit(model, train, DataLoader(_dataset(16, seed=2), batch_size=8), **fit)
    return trainer, model


def test_lightning_one_record_per_optimizer_step_with_the_trainers_loss(pl: Any, tmp_path: Path) -> None:
    from streamwatch.integrations.lightning import StreamwatchCallback

    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], every=1)
    trainer, model = _fit(pl, tmp_path, [callback])
    watch = callback.watch
    assert watch is not None

    assert trainer.global_step == 6
    assert watch.statistics().steps == watch.statistics().sampled == 6
    # one record per optimizer step, and the final validation's, sent at close as the next step's
    assert [r.step for r in records.items] == list(range(7))
    steps, final = records.items[:6], records.items[6]
    assert {k.phase for k in final.keys} == {"eval"}
    assert "loss" not in final.scalars
    # Lightning divides each batch's loss by accumulate_grad_batches (2) before backward and reports it
    # so; a step's loss is the sum over its batches (windows of 2, 2, 1 batches per epoch)
    windows = [[0, 1], [2, 3], [4], [5, 6], [7, 8], [9]]
    assert len(model.losses) == 10
    expected = []
    for window in windows:
        total = model.losses[window[0]] / 2
        for i in window[1:]:
            total = total + model.losses[i] / 2
        expected.append(float(total))
    assert [r.scalars["loss"] for r in steps] == expected
    assert [r.scalars["batch_size"] for r in steps] == [16.0, 16.0, 8.0] * 2
    assert all(r.scalars["lr/0"] == 0.1 for r in records.items)
    # validation is summarised under phase="eval" in the record of the next optimizer step: the sanity
    # check in the first, epoch 0's validation in the first step of epoch 1; epoch 1's comes after the
    # last step: in the record close() sends
    assert _eval_records(records.items) == {0, 3, 6}
    layers = {k.layer for k in records.items[3].keys if k.phase == "eval" and k.kind == "activation"}
    assert layers == {"net.0", "net.1", "net.2", "net.3"}
    assert {r.rank for r in records.items} == {trainer.global_rank} == {0}
    # the watch is closed: every hook is gone
    assert watch.closed
    assert _leftover_hooks(model, trainer.optimizers[0]) == []
    latest = {s.name: s.value for s in watch.snapshot() if not s.labels.get("layer")}
    assert latest["streamwatch_loss"] == expected[-1]


def _compiled_lightning_module(pl: Any) -> Any:
    """A module whose steps read no Python state that changes (``_lightning_module`` keeps its losses in
    a list, which dynamo would guard on): what dynamo compiles here is streamwatch's doing alone."""

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


@pytest.mark.parametrize("every", [1, None], ids=["every=1", "governor"])
def test_lightning_a_compiled_module_with_accumulation_is_compiled_once_per_step_kind(
    pl: Any, tmp_path: Path, every: int | None
) -> None:
    """``trainer.fit(torch.compile(module))`` with ``accumulate_grad_batches=4``: Lightning compiles the
    steps, which call ``self.net``, never the module streamwatch observes. Every micro-batch's
    activations reach its step's record; dynamo compiles ``training_step`` and ``validation_step`` once
    each (the governor's unsampled steps, whose hooks do nothing, once more), where the micro-batches of
    every step after the first were each a new variant, and nothing is warned."""
    from torch._dynamo.utils import counters

    from streamwatch.integrations.lightning import StreamwatchCallback

    torch._dynamo.reset()
    counters.clear()
    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], **({} if every is None else {"every": every}))
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        accumulate_grad_batches=4,
        num_sanity_val_steps=0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            torch.compile(_compiled_lightning_module(pl), backend="eager"),
            DataLoader(_dataset(64, seed=1), batch_size=4),  # 16 batches an epoch: 4 steps of 4
            DataLoader(_dataset(16, seed=2), batch_size=4),  # 4 validation batches an epoch
        )
    torch._dynamo.reset()
    assert [str(w.message) for w in caught if "streamwatch" in str(w.message)] == []
    assert counters["frames"]["ok"] == (2 if every == 1 else 3)
    assert trainer.global_step == 8
    steps = [r for r in records.items if r.rows(phase="train")]
    assert len(steps) == 8 if every == 1 else len(steps) >= 2  # (the governor: step 0 and a few more)
    for record in steps:  # every micro-batch's activations and output gradients: 4 batches of 4 through
        for kind in ("activation", "output_grad"):  # net.0 (16 units)
            index = record.keys.index(sw.SeriesKey("train", "net.0", kind, ""))
            assert record.column("count")[index] == 4 * 4 * 16


@pytest.mark.filterwarnings("ignore:Found 1 module.s. in eval mode")
@pytest.mark.parametrize("every", [2, None], ids=["every=2", "governor"])
def test_lightning_validation_is_recorded_on_unsampled_steps_and_a_frozen_encoder_as_train(
    pl: Any, tmp_path: Path, every: int | None
) -> None:
    """``validation_step`` calls ``self.net(x)``, never the LightningModule: the watch, which learns of an
    evaluation pass from the root module's call, summarised validation only when the step was sampled
    anyway (with the governor: the sanity check alone). And a submodule kept in eval mode (a frozen
    encoder) was recorded as an evaluation pass in every training step, without its gradients."""
    from streamwatch.integrations.lightning import StreamwatchCallback

    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], **({} if every is None else {"every": every}))
    model = _lightning_module(pl)
    model.net[2].eval()  # (Dropout: eval mode in training, as a frozen part is kept)
    trainer, model = _fit(pl, tmp_path, [callback], model)
    assert trainer.global_step == 6
    # the sanity check in step 0's record, epoch 0's validation in step 3's, epoch 1's at close
    assert {records.items[i].step for i in _eval_records(records.items)} == {0, 3, 6}
    for record in records.items:
        eval_layers = {k.layer for k in record.keys if k.phase == "eval" and k.kind == "activation"}
        assert eval_layers in (set(), {"net.0", "net.1", "net.2", "net.3"}), record.step
        train_layers = {k.layer for k in record.keys if k.phase == "train" and k.kind == "activation"}
        if record.step < 6 and train_layers:
            assert "net.2" in train_layers  # the eval-mode Dropout in a training pass: train
            assert sw.SeriesKey("train", "net.2", "output_grad", "") in record.keys


def test_lightning_a_sink_that_failed_during_the_fit_is_warned_not_raised_at_teardown(
    pl: Any, tmp_path: Path
) -> None:
    """A sink that fails mid-fit stops itself (warned); teardown's close() raised its PipelineError out of
    ``fit()`` after the fit had finished: the trainer marked it interrupted and skipped the teardown
    of the callbacks after ours."""
    from streamwatch.integrations.lightning import StreamwatchCallback

    def broken(record: sw.StepRecord) -> None:
        raise ValueError("the sink broke")

    torn: list[str] = []

    class After(pl.Callback):  # type: ignore[misc]
        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            torn.append(stage)

    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[sw.sinks.callback(broken), records], every=1)
    with pytest.warns(RuntimeWarning) as warned:
        trainer, model = _fit(pl, tmp_path, [callback, After()], epochs=1)
    assert trainer.state.status == "finished"
    assert torn == ["fit"]
    assert any("the run finished, but part of its monitoring failed" in str(w.message) for w in warned)
    assert any("the sink broke" in str(w.message) for w in warned)
    assert callback.watch is not None
    assert callback.watch.closed
    assert callback.watch.statistics().pipeline_failures == 1
    assert [r.step for r in records.items] == [0, 1, 2, 3]  # the other sink got every record
    assert _leftover_hooks(model, trainer.optimizers[0]) == []


def test_lightning_monitoring_does_not_change_training(pl: Any, tmp_path: Path) -> None:
    from streamwatch.integrations.lightning import StreamwatchCallback

    _, plain = _fit(pl, tmp_path / "plain", [])
    callback = StreamwatchCallback(
        taps=KINDS, cadence=dict.fromkeys(KINDS, 1), stats=("dead", "nonfinite"), every=1
    )
    _, observed = _fit(pl, tmp_path / "observed", [callback])
    assert callback.watch is not None
    assert callback.watch.statistics().sampled == 6
    assert [float(x) for x in observed.losses] == [float(x) for x in plain.losses]
    weights, reference = observed.state_dict(), plain.state_dict()
    assert weights.keys() == reference.keys()
    different = [name for name in weights if not torch.equal(weights[name], reference[name])]
    assert different == []


def test_lightning_failed_fit_closes_the_watch(pl: Any, tmp_path: Path) -> None:
    from streamwatch.integrations.lightning import StreamwatchCallback

    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], every=1)
    model = _lightning_module(pl, fail_at=2)
    with pytest.raises(RuntimeError, match="the training step failed"):
        _fit(pl, tmp_path, [callback], model)
    assert callback.watch is not None
    assert callback.watch.closed
    assert [r.step for r in records.items] == [0, 1]  # the two completed optimizer steps
    assert _leftover_hooks(model) == []


def test_lightning_fit_resumed_from_a_checkpoint_steps_with_the_optimizer(pl: Any, tmp_path: Path) -> None:
    from streamwatch.integrations.lightning import StreamwatchCallback

    first, _ = _fit(pl, tmp_path, [], epochs=1)
    first.save_checkpoint(tmp_path / "epoch0.ckpt")
    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], every=1)
    # the trainer restores global_step (3) only after on_fit_start; the second epoch steps 3 more times
    resumed, model = _fit(pl, tmp_path, [callback], ckpt_path=tmp_path / "epoch0.ckpt")
    assert resumed.global_step == 6
    assert [r.scalars.get("batch_size") for r in records.items] == [16.0, 16.0, 8.0, None]  # + validation
    # the records go on from the checkpoint's steps (0-based: the first run's were 0, 1, 2)
    assert [r.step for r in records.items] == [3, 4, 5, 6]
    assert callback.watch is not None
    assert callback.watch.start_step == 3
    assert callback.watch.statistics().steps == 3
    assert len(model.losses) == 5
    assert records.items[0].scalars["loss"] == float(model.losses[0] / 2 + model.losses[1] / 2)


def test_lightning_optimizer_wrapper_is_unwrapped(pl: Any) -> None:
    """A ``LightningOptimizer`` (what ``self.optimizers()`` returns in a LightningModule) given to
    ``observe()`` directly: the hooks go on the torch optimizer it wraps, and its steps are recorded."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = LightningOptimizer(optimizer)
    records = sw.sinks.collect()
    with sw.observe(model, wrapped, sinks=[records], every=1, cadence={"update": 1}) as watch:
        assert len(optimizer._optimizer_step_pre_hooks) == len(optimizer._optimizer_step_post_hooks) == 1
        for x, y in DataLoader(_dataset(16, seed=3), batch_size=8):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()  # the wrapper's step() does this inside a Trainer
            optimizer.zero_grad()
            watch.step(loss=loss)
    assert [bool(r.rows("update")) for r in records.items] == [True, True]
    assert _leftover_hooks(model, optimizer) == []


def test_lightning_callback_checks_its_arguments(pl: Any) -> None:
    from streamwatch.integrations.lightning import StreamwatchCallback

    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['evry'\].*every"):
        StreamwatchCallback(evry=2)
    with pytest.raises(TypeError, match="the model and the optimizer come from the trainer"):
        StreamwatchCallback(model=nn.Linear(1, 1))
    _values_are_checked_when_the_callback_is_made(StreamwatchCallback)


_DDP_SCRIPT = """
import json, os, sys, warnings
warnings.simplefilter("error")
warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*does not have many workers")
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import streamwatch as sw
from streamwatch.integrations.lightning import StreamwatchCallback

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class ProcessGroup(pl.Callback):  # after streamwatch's: what observe() saw when it created the watch
    def on_fit_start(self, trainer, pl_module):
        self.initialized = torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if self.initialized else None

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
records = sw.sinks.collect()
callback, group = StreamwatchCallback(sinks=[records], every=1), ProcessGroup()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, callbacks=[callback, group],
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(Net(), DataLoader(data, batch_size=4))
out = {"global_rank": trainer.global_rank, "world_size": trainer.world_size, "initialized": group.initialized,
       "group_rank": group.rank, "record_ranks": [r.rank for r in records.items],
       "steps": callback.watch.statistics().steps, "global_step": trainer.global_step,
       "closed": callback.watch.closed}
with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(out, f)
# Lightning leaves the process group up after fit(); left to the interpreter's exit, gloo's teardown
# sometimes aborts a rank ("terminate called without an active exception"): leave it here, as every
# other torchrun job of the tests does (tests/torchrun.py)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lightning_ddp_records_carry_the_trainers_global_rank(pl: Any, tmp_path: Path) -> None:
    script = tmp_path / "ddp_lightning.py"
    script.write_text(_DDP_SCRIPT)
    torchrun.run(script, 2, str(tmp_path))
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (out["global_rank"], out["world_size"]) == (rank, 2)
        # the process group was up when the watch was created, so observe() took the rank from it
        assert (out["initialized"], out["group_rank"]) == (True, rank)
        assert out["record_ranks"] == [rank] * 3
        assert out["steps"] == out["global_step"] == 3
        assert out["closed"] is True


def test_rank_mismatch_is_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamwatch.integrations._common import check_rank

    monkeypatch.delenv("RANK", raising=False)
    check_rank(0, "trainer.global_rank")  # agrees: silent (filterwarnings=error)
    with pytest.warns(RuntimeWarning, match=r"global rank is 1 \(trainer.global_rank\).*rank=0"):
        check_rank(1, "trainer.global_rank")


# -- Hugging Face transformers --------------------------------------------------------------------------


class _HFNet(nn.Module):
    """What the Hugging Face Trainer needs of a model: a forward that returns a dict with ``loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.losses: list[torch.Tensor] = []  # every training micro-batch's loss

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
            if self.training:
                self.losses.append(out["loss"].detach().clone())
        return out


def _hf_trainer(
    tmp_path: Path,
    callbacks: list[Any],
    train: TensorDataset,
    val: TensorDataset | None = None,
    model: nn.Module | None = None,
    **arguments: Any,
) -> Any:
    """A CPU ``transformers.Trainer`` of ``model`` (an ``_HFNet``) on ``train`` (and ``val``): batches of 4,
    learning rate 0.1, no checkpoints, no report, seed 0, unless ``arguments`` say otherwise."""
    transformers = pytest.importorskip("transformers")
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 4,
        "learning_rate": 0.1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    return transformers.Trainer(
        model=model if model is not None else _HFNet(),
        args=transformers.TrainingArguments(**(settings | arguments)),
        train_dataset=[{"x": x, "labels": y} for x, y in train],
        eval_dataset=None if val is None else [{"x": x, "labels": y} for x, y in val],
        callbacks=callbacks,
    )


@pytest.mark.parametrize("logging_steps", [1, 2])
def test_transformers_one_record_per_optimizer_step_with_the_logged_loss(
    tmp_path: Path, logging_steps: int
) -> None:
    pytest.importorskip("transformers")
    from streamwatch.integrations.transformers import StreamwatchCallback

    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], every=1)
    model = _HFNet()
    trainer = _hf_trainer(  # 5 micro-batches of 4 an epoch: optimizer steps after 2, 2 and 1
        tmp_path,
        [callback],
        _dataset(20, seed=1),
        _dataset(8, seed=2),
        model,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        logging_steps=logging_steps,
        eval_strategy="steps",
        eval_steps=2,
    )
    trainer.train()
    watch = callback.watch
    assert watch is not None

    assert trainer.state.global_step == 6
    assert watch.statistics().steps == watch.statistics().sampled == 6
    # one record per optimizer step, and the last evaluation's, sent at close as the next step's
    assert [r.step for r in records.items] == list(range(7))
    steps = records.items[:6]
    # the record of optimizer step n (from 1) carries the loss the Trainer logged right after it
    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == list(range(logging_steps, 7, logging_steps))
    for record in steps:
        assert record.scalars.get("loss") == logged.get(record.step + 1)
    if logging_steps == 1:  # then that is each step's own loss: its micro-batches' losses, each divided
        # by the micro-batches in the step (HF scales a short last window by its own length)
        windows = [[0, 1], [2, 3], [4], [5, 6], [7, 8], [9]]
        assert len(model.losses) == 10
        expected = []
        for window in windows:
            total = model.losses[window[0]] / len(window)
            for i in window[1:]:
                total = total + model.losses[i] / len(window)
            expected.append(float(total))
        # (transformers 4.x logs the loss rounded to 4 decimals; 5.x as computed)
        assert [r.scalars["loss"] for r in steps] == pytest.approx(expected, rel=1e-6, abs=5e-5)
    # evaluation after steps 2 and 4 is summarised under phase="eval" in the next step's record (the one
    # after step 6, the last, in the record close() sends)
    assert _eval_records(records.items) == {2, 4, 6}
    assert {k.phase for k in records.items[6].keys} == {"eval"}
    assert watch.closed
    assert _leftover_hooks(model, trainer.optimizer.optimizer) == []


@pytest.mark.parametrize("every", [1, None], ids=["every=1", "governor"])
def test_transformers_torch_compile_with_accumulation_is_compiled_once_per_pass_kind(
    tmp_path: Path, every: int | None
) -> None:
    """``TrainingArguments(torch_compile=True, gradient_accumulation_steps=4)`` with evaluation: every
    micro-batch's activations reach its step's record, and dynamo compiles the model's forward once (the
    governor's unsampled steps, whose hooks do nothing, once more); nothing is warned (the callback ends
    each evaluation batch's pass)."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from streamwatch.integrations.transformers import StreamwatchCallback

    torch._dynamo.reset()
    counters.clear()
    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], **({} if every is None else {"every": every}))
    torch.manual_seed(0)
    trainer = _hf_trainer(  # 16 micro-batches of 4 an epoch: 4 steps; 4 evaluation batches every 2 steps
        tmp_path,
        [callback],
        _dataset(64, seed=1),
        _dataset(16, seed=2),
        HFNet(),  # (not _HFNet: its list of losses would be a guard)
        gradient_accumulation_steps=4,
        num_train_epochs=2,
        eval_strategy="steps",
        eval_steps=2,
        torch_compile=True,
        torch_compile_backend="eager",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    torch._dynamo.reset()
    assert [str(w.message) for w in caught if "streamwatch" in str(w.message)] == []
    assert trainer.state.global_step == 8
    assert counters["frames"]["ok"] == (1 if every == 1 else 2)
    assert _eval_records(records.items)  # evaluation was recorded too
    steps = [r for r in records.items if r.rows(phase="train")]
    assert len(steps) == 8 if every == 1 else len(steps) >= 2
    for record in steps:  # every micro-batch's activations and output gradients: 4 batches of 4 through
        for kind in ("activation", "output_grad"):  # net.0 (16 units)
            index = record.keys.index(sw.SeriesKey("train", "net.0", kind, ""))
            assert record.column("count")[index] == 4 * 4 * 16


def _gpt2_records(tmp_path: Path, **arguments: Any) -> tuple[list[sw.StepRecord], list[torch.Tensor]]:
    """Three steps of a 2-layer GPT-2 (built from its config: nothing downloaded) under the Trainer and
    the callback, 2 micro-batches of 4 sequences of 16 tokens a step; the records and final weights."""
    transformers = pytest.importorskip("transformers")
    from streamwatch.integrations.transformers import StreamwatchCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(1))
    records = sw.sinks.collect()
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=3,
            learning_rate=1e-3,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
            logging_steps=1,
            **arguments,
        ),
        train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
        callbacks=[StreamwatchCallback(sinks=[records], every=1)],
    )
    trainer.train()
    return list(records.items), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["default", "reentrant", "non-reentrant"])
def test_transformers_gradient_checkpointing_records_what_training_without_it_records(
    tmp_path: Path, reentrant: bool | None
) -> None:
    """``gradient_checkpointing=True`` (``activation_checkpointing`` since transformers 5) runs each GPT-2
    block's forward again in the backward: each is summarised once, so the records hold the same rows
    and values as without checkpointing (and the weights train the same)."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    plain, weights = _gpt2_records(tmp_path / "plain")
    kwargs: dict[str, Any] = {name: True}
    if reentrant is not None:
        kwargs[f"{name}_kwargs"] = {"use_reentrant": reentrant}
    again, checkpointed = _gpt2_records(tmp_path / "ckpt", **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(weights, checkpointed, strict=True))
    assert len(plain) == len(again) == 3
    for a, b in zip(plain, again, strict=True):
        assert set(a.keys) == set(b.keys)
        assert {k.kind for k in a.keys} >= {"activation", "output_grad", "param_grad"}
        rows = {key: i for i, key in enumerate(b.keys)}
        other = np.asarray(b.table)[[rows[key] for key in a.keys]]
        np.testing.assert_allclose(np.asarray(a.table), other, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_transformers_resumed_run_numbers_its_records_from_the_checkpoint(tmp_path: Path) -> None:
    """A run resumed with ``train(resume_from_checkpoint=...)`` goes on from the checkpoint's step, as
    the Trainer's own logs do: its records are not numbered from 0 again (a run file appended to, a
    TensorBoard directory and the dashboards would show the two runs on top of each other)."""
    pytest.importorskip("transformers")
    from streamwatch.integrations.transformers import StreamwatchCallback

    def run(epochs: int, callbacks: list[Any], resume: str | None = None) -> Any:
        trainer = _hf_trainer(  # 3 optimizer steps an epoch
            tmp_path,
            callbacks,
            _dataset(12, seed=1),
            num_train_epochs=epochs,
            logging_steps=1,
            save_strategy="epoch",
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    run(1, [])
    checkpoint = tmp_path / "checkpoint-3"
    assert checkpoint.is_dir()
    records = sw.sinks.collect()
    callback = StreamwatchCallback(sinks=[records], every=1)
    trainer = run(2, [callback], resume=str(checkpoint))
    assert trainer.state.global_step == 6
    assert [r.step for r in records.items] == [3, 4, 5]
    # each record carries the loss the Trainer logged for that step (it logs step n + 1 for record n)
    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert [r.scalars.get("loss") for r in records.items] == [logged[4], logged[5], logged[6]]
    assert callback.watch is not None
    assert callback.watch.start_step == 3
    assert callback.watch.statistics().steps == 3


def test_callbacks_refuse_start_step(pl: Any) -> None:
    """The callbacks take the step to start from from the trainer: a start_step of the user's would
    be overwritten or contradict it."""
    from streamwatch.integrations.lightning import StreamwatchCallback

    with pytest.raises(TypeError, match="numbers steps from the trainer's own step count"):
        StreamwatchCallback(start_step=5)


def test_transformers_a_sink_that_failed_during_training_is_warned_not_raised_at_the_end(
    tmp_path: Path,
) -> None:
    """As with Lightning: ``trainer.train()`` raised the PipelineError after training had finished, so a
    script's ``trainer.save_model()`` after it never ran."""
    pytest.importorskip("transformers")
    from streamwatch.integrations.transformers import StreamwatchCallback

    def broken(record: sw.StepRecord) -> None:
        raise ValueError("the sink broke")

    callback = StreamwatchCallback(sinks=[sw.sinks.callback(broken)], every=1)
    trainer = _hf_trainer(tmp_path, [callback], _dataset(12, seed=1), num_train_epochs=1)
    with pytest.warns(RuntimeWarning) as warned:
        trainer.train()
    assert any("the run finished, but part of its monitoring failed" in str(w.message) for w in warned)
    assert trainer.state.global_step == 3
    assert callback.watch is not None
    assert callback.watch.closed
    assert callback.watch.statistics().pipeline_failures == 1


def test_transformers_callback_checks_its_arguments() -> None:
    pytest.importorskip("transformers")
    from streamwatch.integrations.transformers import StreamwatchCallback

    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['optimizer'\]"):
        StreamwatchCallback(optimizer=None)
    _values_are_checked_when_the_callback_is_made(StreamwatchCallback)


BAD_VALUES: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "every_0": ({"every": 0}, ValueError, r"^Expected `every` to be a positive integer, got 0$"),
    "every_and_overhead": ({"every": 2, "overhead": 0.05}, ValueError, r"^Expected `every` or `overhead`"),
    "overhead_2": ({"overhead": 2}, ValueError, r"^Expected `overhead` to be a number in \(0, 1\)"),
    "taps_unknown": ({"taps": ("activations",)}, ValueError, r"^Expected `taps` to be a collection of"),
    "capacity_0": ({"capacity": 0}, ValueError, r"^Expected `capacity` to be a positive integer"),
    "detail_typo": ({"detail": "rank_0"}, ValueError, r"^Expected `detail` to be one of"),
    "metrics_unknown": ({"metrics": ("spectral",)}, ValueError, r"^Unknown metric 'spectral'"),
    "sinks_string": ({"sinks": "run.jsonl"}, TypeError, r"^Expected `sinks` to be a Sink"),
    "select_bad": ({"select": 3.5}, TypeError, r"select"),
}


def _values_are_checked_when_the_callback_is_made(callback: Any) -> None:
    """A bad observe() value fails when the callback is made, with observe()'s own message (before: at
    StreamwatchCallback(every=0) nothing; fit()/train() failed inside the trainer's first hook)."""
    for kwargs, error, message in BAD_VALUES.values():
        with pytest.raises(error, match=message):
            callback(**kwargs)
        with pytest.raises(error, match=message):
            sw.observe(nn.Linear(1, 1), **kwargs)  # the same error as observe() itself
    taps = (kind for kind in ("activation", "output_grad"))  # read once, when the callback is made
    assert callback(taps=taps)._options.taps == {"activation", "output_grad"}


# -- Accelerate -----------------------------------------------------------------------------------------


def test_accelerate_observe_the_unwrapped_model_unchanged() -> None:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_dataset(40, seed=1), batch_size=8)
    prepared, prepared_optimizer, prepared_loader = accelerator.prepare(model, optimizer, loader)
    stepped: list[int] = []  # the reference: optimizer steps taken
    handle = optimizer.register_step_post_hook(lambda *_: stepped.append(1))
    records = sw.sinks.collect()
    expected: list[float] = []
    with sw.observe(accelerator.unwrap_model(prepared), optimizer, sinks=[records], every=1) as watch:
        window: list[torch.Tensor] = []
        for x, y in prepared_loader:
            with accelerator.accumulate(prepared):
                loss = F.cross_entropy(prepared(x), y)
                accelerator.backward(loss)
                prepared_optimizer.step()
                prepared_optimizer.zero_grad()
            window.append(loss.detach())
            if accelerator.sync_gradients:  # the optimizer stepped: one watch.step
                step_loss = torch.stack(window).mean()
                watch.step(loss=step_loss, batch_size=8 * len(window))
                expected.append(float(step_loss))
                window = []
    handle.remove()
    assert len(stepped) == 3  # 5 batches, accumulating 2: steps after batches 2, 4 and 5
    assert watch.statistics().steps == len(records.items) == 3
    assert [r.scalars["loss"] for r in records.items] == expected
    assert [r.scalars["batch_size"] for r in records.items] == [16.0, 16.0, 8.0]
    kinds = {k.kind for r in records.items for k in r.keys}
    assert kinds == {"activation", "output_grad", "param", "param_grad", "update"}
    assert _leftover_hooks(model, optimizer) == []


def test_accelerate_wrapped_optimizer_is_unwrapped_to_the_one_it_steps() -> None:
    """``observe(model, accelerated_optimizer)``: the hooks go on the torch optimizer inside (the wrapper
    has none), so the records are those of passing it; a subclass with no hook tables and nothing
    inside is refused, naming what to pass."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, wrapped = accelerator.prepare(model, optimizer)
    assert wrapped is not optimizer
    records = sw.sinks.collect()
    grads: list[torch.Tensor] = []
    with sw.observe(model, wrapped, sinks=[records], every=1, cadence={"update": 1}) as watch:
        assert (len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks)) == (1, 1)
        for x, y in DataLoader(_dataset(16, seed=2), batch_size=8):
            loss = F.cross_entropy(prepared(x), y)
            accelerator.backward(loss)
            grads.append(model[2].weight.grad.detach().clone())
            wrapped.step()
            wrapped.zero_grad()
            watch.step(loss=loss)
    assert [r.step for r in records.items] == [0, 1]
    for record, grad in zip(records.items, grads, strict=True):
        (row,) = [
            i
            for i, k in enumerate(record.keys)
            if k.kind == "param_grad" and k.layer == "2" and k.name == "weight"
        ]
        assert record.column("sumsq")[row] == pytest.approx(float(grad.double().pow(2).sum()), rel=1e-6)
        assert record.scalars["lr/0"] == 0.1
        assert record.rows("update")
    assert _leftover_hooks(model, optimizer) == []

    class Hollow(torch.optim.Optimizer):
        def __init__(self) -> None:  # never calls Optimizer.__init__ and wraps nothing
            pass

    with pytest.raises(TypeError, match=r"has no step hooks.*pass the torch optimizer it wraps"):
        sw.observe(model, Hollow())


def _fabric_training(fabric_module: Any, watch_options: dict[str, Any] | None) -> dict[str, Any]:
    """Four optimizer steps of two micro-batches each under a real CPU ``Fabric`` (bf16 autocast, Dropout,
    ``fabric.clip_gradients``), observed through what ``fabric.setup`` returns when ``watch_options`` is
    given; what the loop saw (clipped gradients, the norms ``clip_gradients`` returned, the losses)."""
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    set_up, set_up_optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(_dataset(64, seed=3), batch_size=8)
    seen: dict[str, Any] = {"model": model, "optimizer": optimizer, "grads": [], "norms": [], "losses": []}
    watch = None if watch_options is None else sw.observe(set_up, set_up_optimizer, **watch_options)
    batches = iter(loader)
    for _ in range(4):
        total = torch.zeros(())
        for micro in range(2):
            x, y = next(batches)
            with fabric.no_backward_sync(set_up, enabled=micro == 0):
                loss = F.cross_entropy(set_up(x), y) / 2
                fabric.backward(loss)
            total += loss.detach().float()
        seen["norms"].append(float(fabric.clip_gradients(set_up, set_up_optimizer, max_norm=0.5)))
        seen["grads"].append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        set_up_optimizer.step()
        set_up_optimizer.zero_grad()
        seen["losses"].append(float(total))
        if watch is not None:
            watch.step(loss=total)
    if watch is not None:
        watch.close()
    return seen


def test_fabric_observe_what_setup_returns_under_the_models_own_names() -> None:
    """``observe(model, optimizer)`` with what ``fabric.setup`` returns: the module's own layer names (not
    ``_forward_module.0``), gradients as clipped by ``fabric.clip_gradients`` with the norm it returned
    before clipping, the losses the loop computed, training bit-identical, and no hook left."""
    fabric_module = pytest.importorskip("lightning.fabric")
    records = sw.sinks.collect()
    options = {"every": 1, "cadence": {"param": 1, "update": 1}, "sinks": [records]}
    watched = _fabric_training(fabric_module, options)
    plain = _fabric_training(fabric_module, None)
    assert watched["model"] is not plain["model"]
    for a, b in zip(watched["model"].parameters(), plain["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(records.items) == 4
    assert {k.layer for r in records.items for k in r.keys} == {"0", "1", "2", "3"}
    for record, grads, norm, loss in zip(
        records.items, watched["grads"], watched["norms"], watched["losses"], strict=True
    ):
        assert record.scalars["loss"] == loss
        assert record.scalars["log/grad_norm"] == pytest.approx(norm, rel=1e-6)
        assert {k.kind for k in record.keys} == {"activation", "output_grad", "param", "param_grad", "update"}
        for i, key in enumerate(record.keys):
            if key.kind == "param_grad":
                reference = grads[f"{key.layer}.{key.name}"].double()
                assert record.column("sumsq")[i] == pytest.approx(float(reference.pow(2).sum()), rel=1e-6)
    assert _leftover_hooks(watched["model"], watched["optimizer"]) == []


def test_fabric_a_compiled_model_set_up_is_named_as_the_model() -> None:
    """``fabric.setup(torch.compile(model))`` wraps the compiled module and keeps the model beside it:
    each layer is listed once, under its own name."""
    fabric_module = pytest.importorskip("lightning.fabric")
    from streamwatch._select import named_layers

    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 3)))
    set_up = fabric.setup(torch.compile(model, backend="eager"))
    names = [name for name, _ in set_up.named_modules()]
    assert names[:3] == ["", "_forward_module", "_forward_module._orig_mod"]
    assert [(name, type(m).__name__) for name, m in named_layers(set_up)] == [
        ("", "Sequential"),
        ("0", "Linear"),
        ("1", "ReLU"),
        ("2", "Sequential"),
        ("2.0", "Linear"),
    ]


_FABRIC_DDP_SCRIPT = """
import json, os, sys, warnings
warnings.simplefilter("error")
import torch
from lightning.fabric import Fabric
import streamwatch as sw

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
set_up, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
records = sw.sinks.collect()
g = torch.Generator().manual_seed(fabric.global_rank)
grads = []
with sw.observe(set_up, optimizer, every=1, sinks=[records]) as watch:
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        fabric.backward(torch.nn.functional.cross_entropy(set_up(x), y))
        grads.append(float(model[2].weight.grad.double().pow(2).sum()))  # averaged over the ranks by DDP
        optimizer.step()
        optimizer.zero_grad()
        watch.step()
rows = [[float(r.column("sumsq")[i]) for i, k in enumerate(r.keys)
         if (k.layer, k.kind, k.name) == ("2", "param_grad", "weight")] for r in records.items]
out = {"rank": fabric.global_rank, "forward_module": type(set_up._forward_module).__name__,
       "layers": sorted({k.layer for r in records.items for k in r.keys}),
       "record_ranks": [r.rank for r in records.items], "rows": rows, "grads": grads}
with open(os.path.join(sys.argv[1], f"rank{fabric.global_rank}.json"), "w") as f:
    json.dump(out, f)
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fabric_ddp_records_each_ranks_averaged_gradients_under_the_models_names(tmp_path: Path) -> None:
    """A 2-rank ``Fabric(strategy="ddp")`` job under ``torchrun`` (gloo): ``fabric.setup`` wraps the model in
    DDP inside its own wrapper; each rank's records carry its rank, the model's own layer names, and the
    gradient DDP averaged."""
    pytest.importorskip("lightning.fabric")
    script = tmp_path / "ddp_fabric.py"
    script.write_text(_FABRIC_DDP_SCRIPT)
    torchrun.run(script, 2, str(tmp_path))
    outs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, out in enumerate(outs):
        assert out["rank"] == rank
        assert out["forward_module"] == "DistributedDataParallel"
        assert out["layers"] == ["0", "1", "2"]
        assert out["record_ranks"] == [rank] * 3
        assert [row for (row,) in out["rows"]] == pytest.approx(out["grads"], rel=1e-6)
    assert outs[0]["grads"] == outs[1]["grads"]  # (averaged: both ranks step the same gradient)


# -- PEFT -------------------------------------------------------------------------------------------------


def _lora_training(peft: Any, observed: bool) -> dict[str, Any]:
    """Three steps of a LoRA fine-tune (PEFT on an MLP, both adapters initialised at random so that the
    adapted output differs from the base layer's), with the outputs and output gradients of each adapted
    layer and its base layer taken by hooks of the test's own."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    config = peft.LoraConfig(r=4, target_modules=["0", "2"], lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(net, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    seen: dict[str, Any] = {"model": model, "outputs": [], "grads": []}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            seen["outputs"][-1][name] = output.detach().clone()
            if output.requires_grad:  # (the first base layer's does not: frozen, on the input)
                output.register_hook(lambda grad: seen["grads"][-1].__setitem__(name, grad.clone()))

        return hook

    for name in ("0", "2"):
        adapter = model.base_model.model[int(name)]
        adapter.register_forward_hook(keep(f"base_model.model.{name}"))
        adapter.base_layer.register_forward_hook(keep(f"base_model.model.{name}.base_layer"))
    records = sw.sinks.collect()
    watch = sw.observe(model, optimizer, every=1, sinks=[records]) if observed else None

    def next_step(_: object) -> None:
        seen["outputs"].append({})
        seen["grads"].append({})

    next_step(None)
    data = DataLoader(_dataset(24, seed=4), batch_size=8)
    train(model, optimizer, watch, data=data, report_outputs=False, after_opt_step=next_step)
    if watch is not None:
        watch.close()
    del seen["outputs"][-1], seen["grads"][-1]  # (the step after the last)
    seen["records"] = records.items
    return seen


def test_peft_lora_layers_are_recorded_as_the_layers_the_model_sees() -> None:
    """A LoRA layer holds the layer it adapts as ``base_layer`` and adds its low-rank path: the default
    selection records the adapted layer itself (what the next layer sees, its output gradient) beside
    the leaves inside it, each against the tensors torch computed; the frozen base weights get no
    gradient row; training is unchanged."""
    peft = pytest.importorskip("peft")
    watched, plain = _lora_training(peft, True), _lora_training(peft, False)
    for a, b in zip(watched["model"].parameters(), plain["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    layers = {k.layer for r in watched["records"] for k in r.keys if k.kind == "activation"}
    adapted = {"base_model.model.0", "base_model.model.2"}
    inside = {f"{a}.{part}" for a in adapted for part in ("base_layer", "lora_A.default", "lora_B.default")}
    dropout = {f"{a}.lora_dropout.default" for a in adapted}  # (an Identity at lora_dropout=0)
    assert layers == adapted | inside | dropout | {"base_model.model.1"}
    assert len(watched["records"]) == 3
    for record, outputs, grads in zip(watched["records"], watched["outputs"], watched["grads"], strict=True):
        assert set(grads) == adapted | {"base_model.model.2.base_layer"}
        assert sw.SeriesKey("train", "base_model.model.0.base_layer", "output_grad", "") not in record.keys
        for layer in adapted | {f"{a}.base_layer" for a in adapted}:
            references = [("activation", outputs[layer])]
            if layer in grads:
                references.append(("output_grad", grads[layer]))
            for kind, reference in references:
                row = record.keys.index(sw.SeriesKey("train", layer, kind, ""))
                assert record.column("count")[row] == reference.numel()
                expected = float(reference.double().pow(2).sum())
                assert record.column("sumsq")[row] == pytest.approx(expected, rel=1e-6), (layer, kind)
        for name in adapted:  # (the adapter changes the output: the two rows differ)
            assert not torch.equal(outputs[name], outputs[f"{name}.base_layer"])
        with_grads = {(k.layer, k.name) for k in record.keys if k.kind == "param_grad"}
        assert with_grads == {(f"{a}.lora_{ab}.default", "weight") for a in adapted for ab in "AB"}


# -- imports --------------------------------------------------------------------------------------------

_IMPORTS = """
import importlib, sys
import streamwatch, streamwatch.integrations
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in {"lightning", "pytorch_lightning", "lightning_fabric", "transformers",
                                      "accelerate"})
assert not heavy, f"import streamwatch imported {heavy}"
for extra in ("lightning", "transformers"):
    sys.modules[extra] = None  # as if it were not installed
    try:
        importlib.import_module(f"streamwatch.integrations.{extra}")
    except ImportError as err:
        assert f"pip install 'streamwatch-torch[{extra}]'" in str(err), err
    else:
        raise AssertionError(f"streamwatch.integrations.{extra} imported without {extra}")
print("ok")
"""


def test_import_streamwatch_imports_no_trainer_library_and_a_missing_one_names_its_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_IMPORTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
