"""Hugging Face: ``StreamwatchCallback`` observes a ``transformers.Trainer``'s run with
:func:`streamwatch.observe` (``pip install 'streamwatch-torch[transformers]'``).

What it does, event by event:

* ``on_train_begin``: ``observe(model, optimizer, **observe_kwargs)`` with the callback's ``model`` (the
  Trainer's ``self.model``: the model itself, not its DDP or ``torch.compile`` wrapper, which call it)
  and ``optimizer``. The Trainer has prepared the optimizer with Accelerate by then; the
  ``AcceleratedOptimizer`` wrapper is unwrapped to the torch optimizer whose ``step()`` it calls, which
  is where streamwatch's optimizer hooks go; with ``deepspeed=``, to the one DeepSpeed's ZeRO optimizer
  steps its partitions with, whose fragments stand for the parameters (docs/scale.md#deepspeed-zero).
  No forward pass has run yet, so a ``torch_compile=True`` run traces the taps with the model. With
  ``expose=``, the watch's ``/metrics`` endpoint starts here
  (``watch.expose(port, host=host)``: ``port + LOCAL_RANK`` per process, so every rank of a
  ``torchrun`` job serves its own); with ``run_dir=``, a run file in that directory is one of its sinks
  (``run.jsonl``; ``run-rank{N}.jsonl`` when the job has several processes).
* ``on_step_end`` (the Trainer's step: one optimizer step, after ``gradient_accumulation_steps``
  micro-batches): one ``watch.step(loss=...)``. The Trainer does not hand its callbacks the step's loss;
  it keeps a running sum on the device and turns it into a number only when it logs, right after
  ``on_step_end``. So:

  - on a step after which the Trainer logs (``control.should_log``: every ``logging_steps`` steps with
    ``logging_strategy="steps"``, and the first with ``logging_first_step``), the callback waits for that
    ``on_log`` and reports ``logs["loss"]``: the mean, over the optimizer steps since the previous
    log, of the loss the Trainer computed for each step (the sum of its micro-batch losses, each divided
    by the number of micro-batches in the step unless the model normalises by ``num_items_in_batch``
    itself: the loss whose gradient the optimizer applied), averaged over the processes. With
    ``logging_steps=1`` that is every step's own loss. It is the number in ``state.log_history``
    (transformers 4.x rounds it to 4 decimals; ``logging_nan_inf_filter``, on by default, replaces a
    non-finite step's loss in it);
  - every other step is recorded without a loss (``logging_strategy="epoch"`` or ``"no"``: no step has
    one).

  ``batch_size``: the step's micro-batches (``on_substep_end`` counts those before the last) times
  ``args.train_batch_size`` (the per-device batch size times the GPUs of this process): the samples
  this process put through the step, so ``streamwatch_samples_total`` and
  ``streamwatch_last_step_samples_per_second`` are served. A last batch of an epoch cut short by the
  dataset's end counts as a full one.
* ``on_log``: every number the Trainer logs is served on ``/metrics`` and in ``watch.snapshot()``
  at once, not only on sampled steps: ``loss`` as ``streamwatch_loss{phase="train"}``, ``eval_loss``
  as ``streamwatch_loss{phase="eval"}``, ``eval_accuracy`` as ``streamwatch_accuracy{phase="eval"}``,
  ``learning_rate`` as ``streamwatch_learning_rate{group="0"}``, ``grad_norm`` as
  ``streamwatch_grad_norm``, anything else (``epoch``, ``eval_runtime``, a ``compute_metrics``
  value) as ``streamwatch_logged_<name>``, at most 64 names (``streamwatch._families.logged_sample``).
* Step numbers: the records count the Trainer's optimizer steps from ``state.global_step`` at
  ``on_train_begin`` (``observe(start_step=)``): 0, or a resumed run's checkpoint step, so a resumed
  run's records go on where the last one stopped. A record's step is the one the optimizer step ended
  (``state.global_step - 1``: the Trainer logs that step as ``global_step``).
* Evaluation needs no event: the Trainer evaluates under ``model.eval()`` and ``torch.no_grad``, and
  ``observe()`` summarises every such forward pass under ``phase="eval"``, in the record of the next
  step. An evaluation after the last optimizer step is sent when the watch closes, as a record of its
  own.
* ``on_train_end``: ``watch.close()`` (flush every step to every sink, close ``/metrics``, remove every
  hook). The Trainer has no event for a failed run: if ``trainer.train()`` raises, call
  ``callback.close()`` (e.g. in a ``finally``) to remove the hooks and close ``/metrics`` when the
  process goes on (a process that ends closes it at exit, every completed step sent).
* Rank: ``observe()`` labels records with ``torch.distributed``'s rank (Accelerate has initialised the
  process group before ``on_train_begin``); if that differs from ``args.process_index`` the callback
  warns.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from streamwatch._version import extra

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as _err:
    raise ImportError(
        f"streamwatch.integrations.transformers needs transformers: {extra('transformers')} ({_err})"
    ) from _err

from streamwatch._observe import Watch
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


class StreamwatchCallback(TrainerCallback):
    """Observe a Hugging Face ``Trainer.train`` with :func:`streamwatch.observe`: one step record per
    optimizer step, with the loss the Trainer logs, evaluation under ``phase="eval"``, the watch closed
    when training ends.

    Args:
        expose: serve ``/metrics`` while training runs: True on the default base port (16400), an int
            on that base port (0: any free port); each process on ``port + LOCAL_RANK``, as
            ``watch.expose()``. Started when training begins, closed when it ends. False: no endpoint.
        host: the interface ``/metrics`` binds (``"0.0.0.0"`` to let another machine scrape).
        run_dir: a directory for the run file (``run.jsonl``; ``run-rank{N}.jsonl`` per process in a
            job of several), made if missing; ``streamwatch report/plot/replay`` and
            ``streamwatch.sinks.read_run`` read it.
        **observe_kwargs: :func:`streamwatch.observe`'s keyword arguments (``every=``, ``select=``,
            ``sinks=``, ``metrics=``, ...), checked here as ``observe()`` checks them (an unknown name
            is a ``TypeError``, a bad value the ``TypeError``/``ValueError`` observe() raises), used when
            training begins; the model and the optimizer come from the Trainer.

    Attributes:
        watch: the :class:`streamwatch.Watch` of the current (or last) ``train()``; None before the
            first. It stays readable after training (``statistics()``, ``snapshot()``).
        exporter: its ``/metrics`` endpoint (``exporter.url``) with ``expose=``; None without, and before
            training begins. Closed when training ends.

    Example (``docs/integrations.md`` runs it)::

        from transformers import Trainer, TrainingArguments
        from streamwatch.integrations.transformers import StreamwatchCallback

        callback = StreamwatchCallback(expose=True, run_dir="runs/hf", every=1)
        args = TrainingArguments("out", logging_steps=1, report_to=[], save_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[callback])
        trainer.train()  # http://127.0.0.1:16400/metrics while it runs
        stats = callback.watch.statistics()  # stats.steps == trainer.state.global_step
    """

    def __init__(
        self,
        *,
        expose: bool | int = False,
        host: str = "127.0.0.1",
        run_dir: str | os.PathLike[str] | None = None,
        **observe_kwargs: Any,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self._options = observe_options(observe_kwargs, owner)
        self._serving = serving_options(expose, host, run_dir, owner)
        self.watch: Watch | None = None
        self.exporter: Exporter | None = None
        self._logged: Logged | None = None
        self._pending: int | None = None  # the step ended (its samples); its loss comes with the next log
        self._substeps = 0  # micro-batches of the current step before its last

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Create the watch: the Trainer's model and (unwrapped) optimizer."""
        self.close()  # a watch of an earlier train() that never ended
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"StreamwatchCallback: the Trainer passed no torch.nn.Module as `model`, got {model!r}"
            )
        check_rank(int(args.process_index), "args.process_index")
        self.watch, self.exporter = start_watch(
            model, _torch_optimizer(kwargs.get("optimizer")), self._options, state.global_step, self._serving
        )
        self._logged = Logged(self.watch.store, type(self).__name__)
        self._substeps = 0

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A step whose loss never came is recorded without one before the next step begins."""
        self._end_pending()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A micro-batch of gradient accumulation ended without an optimizer step: count its samples."""
        self._substeps += 1

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The optimizer stepped: end the step now, or after the log that follows it (its loss)."""
        samples = (self._substeps + 1) * int(args.train_batch_size)
        self._substeps = 0
        watch = self.watch
        if watch is None or watch.closed:
            return
        if control.should_log:
            self._pending = samples
        else:
            watch.step(batch_size=samples)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """The Trainer logged: every value is served (``eval_loss``, ``grad_norm``, ``learning_rate``, ...,
        :class:`streamwatch.integrations._common.Logged`), and a training log (``"loss"``) ends the
        pending step with that loss."""
        if logs and self._logged is not None:
            self._logged.put(logs)
        if self._pending is not None and logs and "loss" in logs:
            self._end_pending(logs["loss"])

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An evaluation batch ended (``Watch.pass_ends``): with a compiled model, its rows leave the
        graph now, so the next batch compiles no new variant (docs/observe.md#torchcompile)."""
        watch = self.watch
        if watch is not None and not watch.closed:
            watch.pass_ends()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A step whose loss never came is recorded without one."""
        self._end_pending()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Training ended: close the watch (a pipeline that failed during the run is warned about, not
        raised: the training finished)."""
        self._end_pending()
        close_at_end(self.watch, type(self).__name__)

    def close(self) -> None:
        """Record a pending step, then close the watch (flush every completed step, remove every hook).
        Idempotent; ``on_train_end`` calls it."""
        self._end_pending()
        if self.watch is not None:
            self.watch.close()

    def _end_pending(self, loss: object = None) -> None:
        samples, self._pending = self._pending, None
        if samples is None:
            return
        watch = self.watch
        if watch is not None and not watch.closed:
            watch.step(loss=_number(loss), batch_size=samples)


def _torch_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer behind the Trainer's: Accelerate's ``AcceleratedOptimizer`` keeps it in
    ``.optimizer`` and calls its ``step()`` (the wrapper itself has no step hooks)."""
    while type(optimizer).__name__ == "AcceleratedOptimizer" and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(
        f"StreamwatchCallback: the Trainer's optimizer is not a torch.optim.Optimizer: {optimizer!r}"
    )


def _number(loss: object) -> float | None:
    """A logged loss as a float (None if it is not a real number).

    Example:
        >>> _number(0.25), _number(None), _number("nan?")
        (0.25, None, None)
    """
    if isinstance(loss, bool) or not isinstance(loss, int | float):
        return None
    return float(loss)
