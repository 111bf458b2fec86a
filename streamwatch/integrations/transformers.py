"""Hugging Face: ``StreamwatchCallback`` observes a ``transformers.Trainer``'s run with
:func:`streamwatch.observe` (``pip install 'streamwatch-torch[transformers]'``).

What it does, event by event:

* ``on_train_begin``: ``observe(model, optimizer, **observe_kwargs)`` with the callback's ``model`` (the
  Trainer's ``self.model``: the model itself, not its DDP or ``torch.compile`` wrapper, which call it)
  and ``optimizer``. The Trainer has prepared the optimizer with Accelerate by then; the
  ``AcceleratedOptimizer`` wrapper is unwrapped to the torch optimizer whose ``step()`` it calls, which
  is where streamwatch's optimizer hooks go. No forward pass has run yet, so a ``torch_compile=True``
  run traces the taps with the model.
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

  ``batch_size`` is not reported: the callbacks never see a batch, so ``streamwatch_samples_per_second``
  is absent.
* Step numbers: the records count the Trainer's optimizer steps from ``state.global_step`` at
  ``on_train_begin`` (``observe(start_step=)``): 0, or a resumed run's checkpoint step, so a resumed
  run's records go on where the last one stopped. A record's step is the one the optimizer step ended
  (``state.global_step - 1``: the Trainer logs that step as ``global_step``).
* Evaluation needs no event: the Trainer evaluates under ``model.eval()`` and ``torch.no_grad``, and
  ``observe()`` summarises every such forward pass under ``phase="eval"``, in the record of the next
  step. An evaluation after the last optimizer step is sent when the watch closes, as a record of its
  own.
* ``on_train_end``: ``watch.close()`` (flush every step to every sink, remove every hook). The Trainer
  has no event for a failed run: if ``trainer.train()`` raises, call ``callback.close()`` (e.g. in a
  ``finally``) to remove the hooks.
* Rank: ``observe()`` labels records with ``torch.distributed``'s rank (Accelerate has initialised the
  process group before ``on_train_begin``); if that differs from ``args.process_index`` the callback
  warns.
"""

from __future__ import annotations

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
from streamwatch.integrations._common import check_rank, close_at_end, make_watch, observe_options

__all__ = ["StreamwatchCallback"]


class StreamwatchCallback(TrainerCallback):
    """Observe a Hugging Face ``Trainer.train`` with :func:`streamwatch.observe`: one step record per
    optimizer step, with the loss the Trainer logs, evaluation under ``phase="eval"``, the watch closed
    when training ends.

    Args:
        **observe_kwargs: :func:`streamwatch.observe`'s keyword arguments (``every=``, ``select=``,
            ``sinks=``, ``metrics=``, ...), checked here as ``observe()`` checks them (an unknown name
            is a ``TypeError``, a bad value the ``TypeError``/``ValueError`` observe() raises), used when
            training begins; the model and the optimizer come from the Trainer.

    Attributes:
        watch: the :class:`streamwatch.Watch` of the current (or last) ``train()``; None before the
            first. It stays readable after training (``statistics()``, ``snapshot()``).

    Example (``docs/integrations.md`` runs it)::

        from transformers import Trainer, TrainingArguments
        from streamwatch.integrations.transformers import StreamwatchCallback

        callback = StreamwatchCallback(every=1)
        args = TrainingArguments("out", logging_steps=1, report_to=[], save_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[callback])
        trainer.train()
        stats = callback.watch.statistics()  # stats.steps == trainer.state.global_step
    """

    def __init__(self, **observe_kwargs: Any) -> None:
        super().__init__()
        self._options = observe_options(observe_kwargs, type(self).__name__)
        self.watch: Watch | None = None
        self._pending = False  # the step ended; its loss comes with the Trainer's next log

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
        self.watch = make_watch(
            model, _torch_optimizer(kwargs.get("optimizer")), self._options, state.global_step
        )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A step whose loss never came is recorded without one before the next step begins."""
        self._end_pending()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The optimizer stepped: end the step now, or after the log that follows it (its loss)."""
        watch = self.watch
        if watch is None or watch.closed:
            return
        if control.should_log:
            self._pending = True
        else:
            watch.step()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """The Trainer logged: a training log (``"loss"``) ends the pending step with that loss."""
        if self._pending and logs and "loss" in logs:
            self._end_pending(logs["loss"])

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
        if not self._pending:
            return
        self._pending = False
        watch = self.watch
        if watch is not None and not watch.closed:
            watch.step(loss=_number(loss))


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
