"""Lightning: ``StreamwatchCallback`` observes a ``lightning.pytorch.Trainer``'s run with
:func:`streamwatch.observe` (``pip install 'streamwatch-torch[lightning]'``).

What it does, hook by hook:

* ``on_fit_start``: ``observe(pl_module, trainer.optimizers, **observe_kwargs)`` — the LightningModule
  and every optimizer ``configure_optimizers`` returned (a GAN's two, Muon's with AdamW's; none if it
  returns none), each parameter read around the step of the one that steps it and the learning rates
  numbered across them in order (``optimizer=i``: that one only). With ``expose=``, the watch's ``/metrics``
  endpoint starts here (``port + LOCAL_RANK`` per process, so every rank of a DDP job serves its own);
  with ``run_dir=``, a run file in that directory is one of its sinks (``run.jsonl``;
  ``run-rank{N}.jsonl`` when the job has several processes). This is the first
  hook at which the optimizers exist (the strategy creates them after ``setup`` and ``configure_model``)
  and it runs before the first forward pass of the fit, sanity check included, so the taps are in place
  before ``torch.compile`` traces anything (``trainer.fit(torch.compile(model))`` compiles lazily, on
  that first call). The module is already on its device and wrapped by the strategy (DDP, FSDP); the
  taps sit on the LightningModule and its submodules, which the wrapper calls.
* ``on_train_batch_end``: one ``watch.step(loss=..., batch_size=...)`` per **optimizer step**, not per
  batch. With ``accumulate_grad_batches=k`` the step is made on the batch whose optimizer step happened
  (``trainer.global_step`` advanced during the batch); the batches before it only accumulate:

  - ``loss``: the sum of the batches' ``outputs["loss"]`` (``outputs`` itself when ``training_step``
    returned a tensor) since the previous optimizer step. Lightning divides each batch's loss by
    ``accumulate_grad_batches`` before backward and reports that divided loss in ``outputs``, so the sum
    is the loss whose gradient the optimizer applied: the mean of the micro-batch losses (with
    ``accumulate_grad_batches=1``, simply the batch's loss). At the end of an epoch whose batches do not
    fill the last window, Lightning steps on fewer batches and the sum is over those (still each divided
    by ``k``, as Lightning computed it). The loss stays on its device (no synchronisation); a loss that
    is not a one-element real tensor or a number is not reported.
  - ``batch_size``: the samples of those batches, each batch's size read as the first dimension that
    every tensor in it shares (absent if a batch has no tensor, or tensors of different lengths).

  In manual optimisation (``automatic_optimization = False``) the same rule applies: one step per
  batch in which ``trainer.global_step`` advanced (any optimizer stepped), the loss read from what
  ``training_step`` returned (not divided by anything). ``on_train_start`` reads ``global_step`` again,
  because a fit resumed from a checkpoint restores it after ``on_fit_start``.
* What the module logs (``self.log(...)``: ``trainer.callback_metrics``) is served on ``/metrics`` and
  in ``watch.snapshot()`` every ``trainer.log_every_n_steps`` optimizer steps (Lightning's own logging
  interval), at each training epoch's end and after each validation: ``self.log("val_acc", ...)`` as
  ``streamwatch_logged_val_acc``, the names a Hugging Face Trainer logs as its families (``loss``,
  ``eval_loss``, ``learning_rate``, ``grad_norm``; ``streamwatch._families.logged_sample``), at most 64
  names. Each value is read as a number then: on a GPU, one device sync per value logged on the device.
* Step numbers: the records count the batches in which an optimizer stepped, the count Lightning's
  loggers use as their step (``fit_loop.epoch_loop._batches_that_stepped``; ``global_step`` where a
  Lightning version lacks it). A fit resumed from a checkpoint goes on from the checkpoint's count:
  ``on_train_start``, after Lightning restored it, sets :attr:`Watch.start_step`.
* Validation: Lightning runs it under ``model.eval()`` and ``torch.no_grad``/``torch.inference_mode``;
  ``on_validation_batch_start``/``_end`` tell the watch an evaluation pass runs (``validation_step``
  usually calls a submodule, ``self.net(x)``, never the LightningModule, whose call the watch would
  see), and its forward passes are summarised under ``phase="eval"`` whatever the step samples, in the
  record of the optimizer step that follows (the sanity check lands in the first step's record). A
  validation after the last optimizer step of the fit is sent when the watch closes, as a record of
  its own. ``on_train_batch_start`` likewise marks a training pass, so a submodule kept in eval mode
  (a frozen encoder) is recorded as ``train``.
* ``teardown``: ``watch.close()`` (flush every step to every sink, close ``/metrics``, remove every hook);
  a pipeline that failed during the fit (warned then) is warned about again, not raised out of ``fit()``:
  the fit finished, and the trainer would mark it interrupted and skip the other callbacks. If the fit
  fails, ``on_exception`` closes the watch instead and attaches a streamwatch error, if any, as a note to
  the training's exception (as leaving ``with observe(...)`` does).
* Rank: ``observe()`` labels records with ``torch.distributed``'s rank (Lightning has initialised the
  process group before ``on_fit_start``); if that differs from ``trainer.global_rank`` the callback warns.

Every rank observes its own model replica, as with ``torchrun`` (``watch.expose()`` serves
``port + LOCAL_RANK`` on each). Only ``trainer.fit`` is observed (not ``validate``/``test``/``predict``
on their own). The callback is for the ``lightning`` package (``lightning.pytorch``); the standalone
``pytorch_lightning`` package has its own ``Callback`` class, which this one is not.
"""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from streamwatch._version import extra

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as _err:
    raise ImportError(
        f"streamwatch.integrations.lightning needs Lightning: {extra('lightning')} ({_err})"
    ) from _err

from streamwatch._observe import Watch
from streamwatch._validate import check_int
from streamwatch.integrations._common import (
    Logged,
    check_rank,
    close_at_end,
    observe_options,
    serving_options,
    start_watch,
)
from streamwatch.sinks._prometheus import Exporter

__all__ = ["StreamwatchCallback"]


class StreamwatchCallback(Callback):
    """Observe a Lightning ``Trainer.fit`` with :func:`streamwatch.observe`: one step record per
    optimizer step, validation under ``phase="eval"``, the watch closed when the fit ends.

    Args:
        expose: serve ``/metrics`` while the fit runs: True on the default base port (16400), an int on
            that base port (0: any free port); each process on ``port + LOCAL_RANK``, as
            ``watch.expose()``. Started when the fit begins, closed at its teardown. False: no endpoint.
        host: the interface ``/metrics`` binds (``"0.0.0.0"`` to let another machine scrape).
        run_dir: a directory for the run file (``run.jsonl``; ``run-rank{N}.jsonl`` per process in a
            job of several), made if missing; ``streamwatch report/plot/replay`` and
            ``streamwatch.sinks.read_run`` read it.
        optimizer: which of ``trainer.optimizers`` the watch observes (updates, weights at its step,
            learning rates): None, the default, for all of them; an index for that one only.
        **observe_kwargs: :func:`streamwatch.observe`'s keyword arguments (``every=``, ``select=``,
            ``sinks=``, ``metrics=``, ...), checked here as ``observe()`` checks them (an unknown name
            is a ``TypeError``, a bad value the ``TypeError``/``ValueError`` observe() raises), used when
            the fit begins; the model and the optimizer come from the trainer.

    Attributes:
        watch: the :class:`streamwatch.Watch` of the current (or last) fit; None before the first.
            It stays readable after the fit (``statistics()``, ``snapshot()``).
        exporter: its ``/metrics`` endpoint (``exporter.url``) with ``expose=``; None without, and
            before the fit begins. Closed at the fit's teardown.

    Example (``docs/integrations.md`` runs it)::

        import lightning.pytorch as pl
        from streamwatch.integrations.lightning import StreamwatchCallback

        callback = StreamwatchCallback(expose=True, run_dir="runs/lightning", every=1)
        trainer = pl.Trainer(max_epochs=2, callbacks=[callback], accumulate_grad_batches=2)
        trainer.fit(lit_module, train_loader, val_loader)  # http://127.0.0.1:16400/metrics meanwhile
        stats = callback.watch.statistics()  # stats.steps == trainer.global_step
    """

    def __init__(
        self,
        *,
        expose: bool | int = False,
        host: str = "127.0.0.1",
        run_dir: str | os.PathLike[str] | None = None,
        optimizer: int | None = None,
        **observe_kwargs: Any,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self._options = observe_options(observe_kwargs, owner)
        self._serving = serving_options(expose, host, run_dir, owner)
        self._optimizer = (
            None
            if optimizer is None
            else check_int(optimizer, "optimizer", minimum=0, note="an index into trainer.optimizers or None")
        )
        self.watch: Watch | None = None
        self.exporter: Exporter | None = None
        self._logged: Logged | None = None
        self._loss: torch.Tensor | float | None = None
        self._samples: int | None = 0
        self._global_step = 0
        self._steps = 0  # optimizer steps recorded in this fit

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Create the watch: the LightningModule and the trainer's optimizers (all, or the one
        ``optimizer=`` picks); start ``/metrics`` and the run file if asked."""
        self.close()  # a watch of an earlier fit that was never torn down
        optimizers = _chosen_optimizers(trainer.optimizers, self._optimizer)
        check_rank(trainer.global_rank, "trainer.global_rank")
        self.watch, self.exporter = start_watch(
            pl_module, optimizers, self._options, _steps_done(trainer), self._serving
        )
        self._logged = Logged(self.watch.store, type(self).__name__)
        self._global_step = trainer.global_step
        self._steps = 0
        self._reset()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read ``trainer.global_step`` and the steps done again: a fit resumed from a checkpoint restores
        them only after ``on_fit_start``. The watch numbers its records from there."""
        self._global_step = trainer.global_step
        self._reset()
        watch = self.watch
        done = _steps_done(trainer)
        if watch is not None and not watch.closed and watch.start_step != done:
            if watch.statistics().steps:  # (never in a fit: no optimizer step before this hook)
                warnings.warn(
                    f"{type(self).__name__}: the trainer resumed at step {done} after the watch recorded "
                    f"steps numbered from {watch.start_step}; its records keep that numbering",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                watch.start_step = done

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """A training batch begins: its forward is a training pass (``training_step`` may call
        submodules, never the LightningModule itself)."""
        self._pass_begins(pl_module)

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """A validation batch begins: its forward passes are an evaluation pass, summarised whatever the
        step samples."""
        self._pass_begins(pl_module)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """The validation batch ended: its hooks come out."""
        watch = self.watch
        if watch is not None and not watch.closed:
            watch.pass_ends()

    def _pass_begins(self, pl_module: pl.LightningModule) -> None:
        watch = self.watch
        if watch is not None and not watch.closed:
            watch.pass_begins(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Accumulate the batch's loss and samples; end the step if the optimizer stepped in this batch."""
        watch = self.watch
        if watch is None or watch.closed:
            return
        loss = _loss(outputs)
        if loss is not None:
            self._loss = _add(self._loss, loss)
        size = _batch_size(batch)
        self._samples = None if size is None or self._samples is None else self._samples + size
        step = trainer.global_step
        if step == self._global_step:
            return  # gradient accumulation: no optimizer step in this batch
        self._global_step = step
        loss, samples = self._loss, self._samples
        self._reset()
        watch.step(loss=loss, batch_size=samples or None)
        self._steps += 1
        every = getattr(trainer, "log_every_n_steps", 50)  # (set by Lightning's logger connector)
        if isinstance(every, int) and every > 0 and self._steps % every == 0:
            self._forward(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Serve what the module logged (its epoch-level values among them)."""
        self._forward(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Serve what the module logged in validation (not the sanity check's: Lightning discards it)."""
        if not trainer.sanity_checking:
            self._forward(trainer)

    def _forward(self, trainer: pl.Trainer) -> None:
        """``trainer.callback_metrics`` (every value ``self.log`` gave, as callbacks see them) served on
        ``/metrics`` and in ``watch.snapshot()``."""
        if self._logged is not None and self.watch is not None and not self.watch.closed:
            self._logged.put(trainer.callback_metrics)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """The fit failed: close the watch, keeping the training's exception (a streamwatch error becomes
        a note on it)."""
        watch = self.watch
        self._reset()
        if watch is not None and not watch.closed:
            watch.__exit__(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The fit (or another trainer function) ended: close the watch (a pipeline that failed during
        the fit is warned about, not raised: the fit finished)."""
        self._reset()
        close_at_end(self.watch, type(self).__name__)

    def close(self) -> None:
        """Close the watch (flush every completed step, remove every hook). Idempotent; ``teardown`` calls
        it. A batch that accumulated without an optimizer step is not a step and is not recorded."""
        self._reset()
        if self.watch is not None:
            self.watch.close()

    def _reset(self) -> None:
        self._loss, self._samples = None, 0


def _chosen_optimizers(optimizers: list[Any], index: int | None) -> list[Any]:
    """Every optimizer (``index`` None), or ``optimizers[index]`` only; none when there are none."""
    if index is None or not optimizers:
        return list(optimizers)
    if index >= len(optimizers):
        raise ValueError(
            f"Expected `optimizer` to be an index into the {len(optimizers)} optimizer(s) the "
            f"LightningModule's configure_optimizers returned, got {index}"
        )
    return [optimizers[index]]


def _steps_done(trainer: pl.Trainer) -> int:
    """The batches in which an optimizer stepped so far: what Lightning's loggers number their steps
    by (its ``LearningRateMonitor`` reads the same attribute); ``global_step`` if this Lightning has no
    such count (it differs only with several optimizers stepping in one batch)."""
    count = getattr(
        getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_batches_that_stepped", None
    )
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        count = trainer.global_step
    return int(count)


def _loss(outputs: object) -> torch.Tensor | float | None:
    """The loss in a ``training_step``'s outputs: the tensor itself or ``outputs["loss"]``, detached; a
    real number as a float; None for anything that is not one value (what ``watch.step`` would refuse).

    Example:
        >>> _loss({"loss": torch.tensor(0.5), "acc": 1}), _loss(torch.ones(2)), _loss(None), _loss(2)
        (tensor(0.5000), None, None, 2.0)
    """
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor):
        return outputs.detach() if outputs.numel() == 1 and not outputs.is_complex() else None
    if isinstance(outputs, bool) or not isinstance(outputs, numbers.Real):
        return None
    return float(outputs)


def _add(total: torch.Tensor | float | None, loss: torch.Tensor | float) -> torch.Tensor | float:
    """``total + loss``; a tensor stays on its device (no synchronisation)."""
    if total is None:
        return loss
    if isinstance(total, torch.Tensor):
        return total + loss
    return loss + total


def _batch_size(batch: object, limit: int = 1000) -> int | None:
    """The samples in ``batch``: the first dimension shared by every tensor in it (through mappings,
    lists and tuples, at most ``limit`` items); None without a tensor, or when their lengths differ.

    Example:
        >>> _batch_size((torch.zeros(8, 3), torch.zeros(8))), _batch_size({"x": torch.zeros(8, 3), "n": 5})
        (8, 8)
        >>> _batch_size((torch.zeros(8, 3), torch.zeros(4))), _batch_size(["text"])
        (None, None)
    """
    sizes: set[int] = set()
    stack: list[object] = [batch]
    while stack and limit > 0:
        limit -= 1
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.dim() > 0:
                sizes.add(int(item.shape[0]))
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return sizes.pop() if len(sizes) == 1 else None
