"""``watch.log()``: your own values per step (a validation loss, a custom scalar), checked and kept on
the training thread until the step's end hands them to its record (or to the outbox's step log).

Example:
    >>> book = LogBook()
    >>> book.add({"val_loss": 0.5, "val/acc": 0.75})
    >>> book.take()
    {'val_loss': 0.5, 'val/acc': 0.75}
    >>> book.take() is None  # (taken: the next step starts with none)
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from streamwatch._families import logged_sample
from streamwatch._step_args import number_loss

__all__ = ["LOG_CAP", "LogBook", "Value", "log_value"]

LOG_CAP = 64
"""Distinct names ``watch.log()`` keeps (each a series on ``/metrics``); later new names are refused and
counted (``statistics().log_refused``)."""

Value = float | torch.Tensor
"""A step-level value as it is kept until its record ships: a number, or a 0-d tensor (on its device)."""


class LogBook:
    """The values given to ``watch.log()`` for the step under way, and the names seen so far (at most
    :data:`LOG_CAP`; values of later new names are refused, counted in :attr:`refused` and warned about
    once).

    Example:
        >>> book = LogBook()
        >>> book.add({"a": 1.0}); book.add({"a": 2.0, "b": 3})
        >>> book.take(), book.refused
        ({'a': 2.0, 'b': 3.0}, 0)
    """

    __slots__ = ("_names", "_warned", "pending", "refused")

    def __init__(self) -> None:
        self.pending: dict[str, Value] | None = None  # the values for the step under way (None: none)
        self._names: set[str] = set()
        self._warned = False
        self.refused = 0

    def add(self, values: Mapping[str, object]) -> None:
        """Check and keep ``values`` for the step under way (a later value of a name replaces one).

        Raises:
            TypeError, ValueError: a name that cannot be a metric name, or a value that is not a real
                number or a one-element real tensor (:func:`log_value`).
        """
        kept = self.pending if self.pending is not None else {}
        names = self._names
        refused: list[str] = []
        for name, value in values.items():
            checked = log_value(name, value)
            if name not in names:
                if len(names) >= LOG_CAP:
                    refused.append(name)
                    continue
                names.add(name)
            kept[name] = checked
        self.pending = kept
        if refused:
            self.refused += len(refused)
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"streamwatch: watch.log() values {', '.join(map(repr, refused))} not recorded: at "
                    f"most {LOG_CAP} distinct names are kept (a series each on /metrics); refused values "
                    "are counted in statistics().log_refused (warned once)",
                    RuntimeWarning,
                    stacklevel=4,  # the user's watch.log()
                )

    def take(self) -> dict[str, Value] | None:
        """The step's values (None: none were given); the book is empty after."""
        values, self.pending = self.pending, None
        return values

    def drop_unfinished(self) -> None:
        """At close: values given after the last ``watch.step()`` belong to no step: warned, dropped."""
        values = self.take()
        if values:
            warnings.warn(
                f"streamwatch: watch.log() values {sorted(values)} were given after the last watch.step() "
                "and belong to no step: they are not recorded (log them before the step ends)",
                RuntimeWarning,
                stacklevel=4,  # the user's close()
            )


def log_value(name: object, value: object) -> float | torch.Tensor:
    """One ``watch.log()`` value, checked: a real number (Python, numpy, a 0-d array) as a float, or a
    one-element real tensor (a CPU one read now; a device one copied as it is now, read with the record's
    copy: no host sync). NaN and ±inf are values like any other (recorded as they are).

    Example:
        >>> log_value("val_loss", 0.5), float(log_value("val/acc", torch.tensor([0.75])))
        (0.5, 0.75)
        >>> log_value("val loss!", 0.5)  # (any name that leaves a metric name once its odd characters go)
        0.5
        >>> log_value("tokens_total", 1.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected `watch.log()` names that can be metric names (...), got 'tokens_total'
    """
    if not isinstance(name, str) or logged_sample(name, 0.0) is None:
        raise (TypeError if not isinstance(name, str) else ValueError)(
            "Expected `watch.log()` names that can be metric names (letters, digits, _ . / -, not ending in "
            f"_total, _count, _sum or _bucket, not a built-in family's), got {name!r}"
        )
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"Expected `watch.log()` value {name!r} to be a real number or a one-element real tensor, "
                f"got a tensor of shape {list(value.shape)} ({value.dtype})"
            )
        # (a device one is copied, one small kernel and no sync: a loop may update it in place, a running
        # count or sum, before the record that reads it)
        return float(value.detach()) if value.is_cpu else value.detach().reshape(()).clone()
    try:
        return number_loss(value)
    except TypeError:
        raise TypeError(
            f"Expected `watch.log()` value {name!r} to be a real number or a one-element real tensor, got "
            f"{value!r}"
        ) from None
