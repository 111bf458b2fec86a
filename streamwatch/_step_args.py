"""``watch.step()``'s arguments, checked before the step is touched: :func:`check_step` → :class:`StepArgs`.

Only shapes and types are read (nothing from the device). A plain 0-d float32 CPU loss is read at once
with the compiled reader (one C call): the record and the sentinel need its value, and a loop may
overwrite a loss buffer in place.

Example:
    >>> import torch
    >>> from streamwatch._accuracy import TrainAccuracy
    >>> args = check_step(torch.tensor(0.5), None, None, 32, TrainAccuracy())
    >>> float(args.loss), args.accuracy, args.batch_size
    (0.5, None, 32)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch

from streamwatch._accuracy import Score, TrainAccuracy
from streamwatch._validate import check_int

__all__ = ["StepArgs", "check_step", "dark_ready", "number_loss", "read_loss"]

_Tensor = torch.Tensor
_F32 = torch.float32


class StepArgs(NamedTuple):
    """``watch.step()``'s arguments, checked: nothing in them can fail later.

    Attributes:
        loss: None, a float (a number, or a plain CPU loss read already), or a one-element tensor.
        accuracy: ``(scorer, outputs, targets, predictions scored)``: ``scorer(outputs, targets)`` counts
            the correct ones (a device scalar, or a host float) for a step that sends a record; None
            without outputs and targets, or where train accuracy skipped the step.
        batch_size: samples in the step, or None.
    """

    loss: torch.Tensor | float | None
    accuracy: tuple[Score, torch.Tensor, torch.Tensor, int] | None
    batch_size: int | None


NO_ARGS = StepArgs(None, None, None)
"""The arguments of a record that is not a step's end (close()'s evaluation record)."""


def check_step(
    loss: object,
    outputs: object,
    targets: object,
    batch_size: object,
    scoring: TrainAccuracy,
    read: Callable[[int], float] | None = None,
) -> StepArgs:
    """Check every argument of ``watch.step()``; ``read`` is the compiled float32 reader (None: torch
    reads the loss where it is needed); ``scoring`` decides train accuracy's layout.

    Raises:
        TypeError, ValueError: an argument is not what it should be (the message names it).
    """
    checked_loss: torch.Tensor | float | None = None
    if type(loss) is _Tensor and loss.dtype is _F32 and not loss.ndim:  # the common loss
        # (a lazily negated view, z.conj().imag, holds -value in its memory: read by torch later)
        checked_loss = loss if read is None or not loss.is_cpu or loss.is_neg() else read(loss.data_ptr())
    elif isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.is_complex():
            what = "a complex tensor" if loss.is_complex() else f"a tensor of shape {list(loss.shape)}"
            raise ValueError(
                f"Expected `loss` to be a scalar (a one-element real tensor or a number), got {what}; "
                "pass the reduced loss (e.g. loss.mean())"
            )
        checked_loss = loss
    elif loss is not None:
        checked_loss = number_loss(loss)
    if batch_size is not None:
        batch_size = check_int(batch_size, "batch_size", note="the samples in the step")
    accuracy = None if outputs is None and targets is None else _scored(outputs, targets, scoring)
    return StepArgs(checked_loss, accuracy, None if batch_size is None else int(batch_size))


def number_loss(loss: object) -> float:
    """A loss that is not a tensor: a real number ``float()`` reads exactly — a Python or numpy scalar,
    or a 0-d numpy array of a real dtype.

    Example:
        >>> import numpy as np
        >>> number_loss(0.5), number_loss(np.float32(0.25)), number_loss(np.array(2.0))
        (0.5, 0.25, 2.0)
        >>> number_loss(np.array([1.0]))
        Traceback (most recent call last):
        ...
        TypeError: Expected `loss` to be a scalar (a one-element real tensor or a number), got array([1.])
    """
    if getattr(loss, "shape", None) == () and getattr(getattr(loss, "dtype", None), "kind", "") in (
        "i",
        "u",
        "f",
    ):
        loss = loss[()]  # type: ignore[index]  # a 0-d numpy array: a number in a box, as float() reads it
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
        raise TypeError(
            f"Expected `loss` to be a scalar (a one-element real tensor or a number), got {loss!r}"
        )
    try:
        return float(loss)
    except OverflowError:
        raise ValueError(
            "Expected `loss` to be a number a float can hold, got one too large for it "
            f"({type(loss).__name__}); pass the loss as a float or a tensor"
        ) from None


def _scored(
    outputs: object, targets: object, scoring: TrainAccuracy
) -> tuple[Score, torch.Tensor, torch.Tensor, int] | None:
    """``(scorer, outputs, targets, n)`` for the layouts documented in :meth:`streamwatch.Watch.step`;
    anything else is refused, naming the shapes. None: ``scoring`` skipped this step's accuracy (an
    ambiguous layout nothing settled yet).

    Example:
        >>> scorer, o, t, n = _scored(
        ...     torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]), TrainAccuracy()
        ... )
        >>> scorer(o, t), n
        (1.0, 2)
    """
    if type(outputs) is not _Tensor or type(targets) is not _Tensor:  # (else: plain tensors, checked)
        _check_pair(outputs, targets)
    decided = scoring.layout(outputs, targets)  # type: ignore[arg-type]
    if decided is None:
        return None
    scorer, n = decided
    return scorer, outputs, targets, n  # type: ignore[return-value]


def _check_pair(outputs: object, targets: object) -> None:
    """Both given, both tensors (subclasses too), or an error naming the one that is not."""
    if outputs is None or targets is None:
        raise ValueError(
            "Expected `outputs` and `targets` together (both for train accuracy, or neither), got "
            f"{'targets' if outputs is None else 'outputs'} alone"
        )
    for name, value in (("outputs", outputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Expected `{name}` to be a torch.Tensor (for train accuracy), got {value!r}")


def dark_ready(loss: object) -> bool:
    """Whether a dark pair may follow a step with this (checked) loss: its first step keeps the loss as
    it is when called, which it can where the loss is none, a number, a plain 0-d float32 CPU tensor
    (read by one C call) or a 0-d floating tensor on a device (a 0-d copy: one launch, no sync); any other
    loss (float64 or shape ``[1]`` on the CPU) would be read one call late, when a loop that overwrites a
    loss buffer in place has changed it.

    Example:
        >>> dark_ready(None), dark_ready(0.5), dark_ready(torch.tensor([0.5]))
        (True, True, False)
    """
    if loss is None or type(loss) is float:
        return True
    if type(loss) is not _Tensor or loss.ndim:
        return False
    return loss.dtype is _F32 if loss.is_cpu else loss.is_floating_point()


def read_loss(loss: object, read: Callable[[int], float] | None) -> float | None:
    """A plain 0-d float32 CPU loss's value by ``read`` (the compiled module's one C call,
    :func:`streamwatch._kernel.scalar_reader`); None for any other loss, or without ``read``.

    Example:
        >>> from streamwatch import _kernel
        >>> read = _kernel.scalar_reader()
        >>> read_loss(torch.tensor(0.5), read) in ((0.5 if read else None),)
        True
        >>> read_loss(torch.tensor([0.5]), read) is None  # (shape [1]: item() reads it)
        True
    """
    if (
        read is None
        or type(loss) is not _Tensor
        or loss.dtype is not _F32
        or not loss.is_cpu
        or loss.ndim
        or loss.is_neg()  # (a lazily negated view, z.conj().imag: the memory holds -value)
    ):
        return None
    return read(loss.data_ptr())
