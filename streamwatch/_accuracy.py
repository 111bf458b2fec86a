"""Train accuracy: which layout ``watch.step(outputs=, targets=)`` passes, and the scorer for it.

A training loop repeats its layout, so each combination of shapes, dtypes and devices is decided once
(:meth:`TrainAccuracy.layout`) and the scorer it picked is reused; a refusal is not cached and raises
every time. The layouts (``N`` the batch, ``C`` the classes):

* class indices: integer ``targets [N]`` with logits ``[N, C]``; ``[N, ..., C]`` with ``[N, ...]``
  (classes last, tokens) or ``[N, C, ...]`` with ``[N, ...]`` (classes second, as ``cross_entropy``
  takes images) — predicted class: the argmax;
* one-hot or class probabilities: floating ``targets [N, C]`` like ``outputs``;
* binary scores: one logit per label (the same shape as ``targets``, or ``[N, 1]`` with ``[N]``);
* predicted labels: integer/bool ``outputs`` shaped like ``targets``.

A class-index layout that fits both ways (``[N, 4, 4]`` with ``[N, 4]``: a sequence as long as there
are classes) is scored the way the run's earlier steps settled it (classes last or second). Before any
step settled it, the step's accuracy is skipped and counted (:attr:`TrainAccuracy.ambiguous`), with one
warning: a valid batch never stops training.

Example:
    >>> import torch
    >>> accuracy = TrainAccuracy()
    >>> scorer, n = accuracy.layout(torch.randn(8, 3, 4), torch.randint(0, 4, (8, 3)))  # classes last
    >>> accuracy.classes_at, n
    ('last', 24)
    >>> scorer, n = accuracy.layout(torch.randn(8, 4, 4), torch.randint(0, 4, (8, 4)))  # either way
    >>> scorer is not None, n, accuracy.ambiguous
    (True, 32, 0)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from streamwatch import _kernel

__all__ = ["AMBIGUOUS", "Score", "TrainAccuracy"]

Score = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | float"]
"""A scorer: ``score(outputs, targets)`` counts the correct predictions (a device scalar, or a host
float), taking the tensors as passed."""

AMBIGUOUS = "ambiguous_accuracy"
"""The reason a step's train accuracy was skipped (``statistics().skipped``): a class-index layout that
fits both ways before any step settled which dimension holds the classes."""

_CPU = torch.device("cpu")
_CACHE = 64  # layouts kept: a loop repeats a few; ever-new shapes clear it (cheap to rebuild)
_Tensor = torch.Tensor


class _Layout(NamedTuple):
    """A decided layout: its scorer, the predictions it scores, and where it says the classes are
    (``"last"`` or ``"first"`` for an unambiguous class-index layout, else None)."""

    score: Score
    n: int
    classes_at: str | None


class _Either(NamedTuple):
    """A class-index layout that fits both ways: the two readings, picked by the settled one."""

    last: _Layout
    first: _Layout


class TrainAccuracy:
    """Decides and caches the layouts of one :class:`streamwatch.Watch`'s ``outputs`` and ``targets``
    and remembers which dimension the run's class-index layouts put the classes in.

    Attributes:
        classes_at: ``"last"`` or ``"first"`` once an unambiguous class-index layout settled it
            (the latest such layout wins), else None.
        ambiguous: steps whose accuracy was skipped: their layout fitted both ways and nothing had
            settled it yet.

    Example:
        >>> import torch
        >>> accuracy = TrainAccuracy()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     accuracy.layout(torch.randn(2, 4, 4), torch.randint(0, 4, (2, 4)))
        >>> accuracy.ambiguous, len(caught)
        (1, 1)
    """

    __slots__ = ("_cache", "_warned", "ambiguous", "classes_at")

    def __init__(self) -> None:
        self._cache: dict[tuple[object, ...], _Layout | _Either] = {}
        self.classes_at: str | None = None
        self.ambiguous = 0
        self._warned = False

    def layout(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[Score, int] | None:
        """The scorer and the number of predictions scored for this step's tensors; None when the step's
        accuracy is skipped (an ambiguous layout not settled yet: counted, warned once).

        Raises:
            ValueError: a layout streamwatch does not read (the message names the shapes and the fix).
        """
        key = (  # (a CPU tensor's device read as the constant: making a device object costs microseconds)
            outputs.shape,
            targets.shape,
            outputs.dtype,
            targets.dtype,
            _CPU if outputs.is_cpu else outputs.device,
            _CPU if targets.is_cpu else targets.device,
        )
        found = self._cache.get(key)
        if found is None:
            found = _decide(*key)
            if len(self._cache) >= _CACHE:
                self._cache.clear()
            self._cache[key] = found
        if type(found) is _Layout:
            if found.classes_at is not None:
                self.classes_at = found.classes_at
            return found.score, found.n
        assert isinstance(found, _Either)
        if self.classes_at == "last":
            return found.last.score, found.last.n
        if self.classes_at == "first":
            return found.first.score, found.first.n
        self.ambiguous += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"streamwatch: train accuracy skipped for `outputs` of shape {list(outputs.shape)} and "
                f"`targets` of shape {list(targets.shape)}: the classes could be the last or the second "
                "dimension, and no earlier step settled which. Steps like it are skipped and counted "
                f"(statistics().skipped[{AMBIGUOUS!r}]) until one that is not ambiguous settles it; "
                "reshape to [M, C] logits and [M] targets to score every step",
                RuntimeWarning,
                stacklevel=4,  # the user's watch.step()
            )
        return None


def _count_correct(score: Score, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | float:
    """Score detached tensors (a torch scorer, bound by :func:`_decide`)."""
    return score(outputs.detach(), targets.detach())


def _equal(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (o == t).sum(dtype=torch.float32)


def _binary(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o > 0) == (t > 0.5)).sum(dtype=torch.float32)


def _one_hot(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (o.argmax(-1) == t.argmax(-1)).sum(dtype=torch.float32)


def _binary_last(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o.squeeze(-1) > 0) == (t > 0.5)).sum(dtype=torch.float32)


def _binary_first(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o.squeeze(1) > 0) == (t > 0.5)).sum(dtype=torch.float32)


def _classes_last(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (o.argmax(-1) == t).sum(dtype=torch.float32)


def _classes_first(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (o.argmax(1) == t).sum(dtype=torch.float32)


class _ClassesLastFused:
    """``_classes_last`` for CPU ``[N, C]`` scores and int64 ``[N]`` targets: one C call (the compiled
    module's ``correct_f32``/``correct_f64``, torch's argmax rules) returning a host float; a batch that
    is not contiguous goes through torch. Takes the tensors as passed (reading their addresses needs no
    ``detach()``, a dispatch through torch)."""

    __slots__ = ("classes", "count", "rows")

    def __init__(self, count: Callable[[int, int, int, int], float], rows: int, classes: int) -> None:
        self.count = count
        self.rows = rows  # (the layout it scores is one shape: the cache key)
        self.classes = classes

    def __call__(self, o: torch.Tensor, t: torch.Tensor) -> torch.Tensor | float:
        if o.is_contiguous() and t.is_contiguous() and type(o) is _Tensor and type(t) is _Tensor:
            return self.count(o.data_ptr(), t.data_ptr(), self.rows, self.classes)
        return _classes_last(o.detach(), t.detach())


_CORRECT = _kernel.correct_counters()
"""The compiled correct-prediction counters by scores' dtype (empty: torch scores every layout)."""


def _torch(score: Score, n: int, classes_at: str | None = None) -> _Layout:
    """A torch scorer's layout: it gets the tensors detached."""
    return _Layout(functools.partial(_count_correct, score), n, classes_at)


def _decide(
    o_shape: torch.Size,
    t_shape: torch.Size,
    o_dtype: torch.dtype,
    t_dtype: torch.dtype,
    o_device: torch.device,
    t_device: torch.device,
) -> _Layout | _Either:
    """The layout of one combination of shapes, dtypes and devices, or a ``ValueError`` naming them."""

    def refuse(why: str) -> ValueError:
        return ValueError(
            f"Cannot score train accuracy from `outputs` of shape {list(o_shape)} ({o_dtype}) and `targets` "
            f"of shape {list(t_shape)} ({t_dtype}): {why}. streamwatch reads class indices "
            "([N] int with [N, C] logits, [N, ...] with [N, ..., C] or [N, C, ...]), one-hot or "
            "probabilities ([N, C] float like the logits), binary scores (one logit per label, or [N, 1] "
            "with [N]) and predicted labels (int outputs shaped like targets); see Watch.step"
        )

    if o_dtype.is_complex or t_dtype.is_complex:
        raise refuse("complex tensors are not scores or labels")
    if o_device != t_device:
        raise refuse(f"they are on different devices ({o_device} and {t_device})")
    labels = not t_dtype.is_floating_point  # integer or bool targets
    n = t_shape.numel()
    if not o_dtype.is_floating_point:  # predicted labels
        if o_shape != t_shape:
            raise refuse("integer outputs are predicted labels, which must be shaped like the targets")
        return _torch(_equal, n)
    o_dim, t_dim = len(o_shape), len(t_shape)
    if o_shape == t_shape:
        # one logit per label: a single score per sample ([N], [N, 1], [N, 1, ...]) or bool labels
        if o_dim <= 1 or o_shape[-1] == 1 or o_shape[1] == 1 or t_dtype == torch.bool:
            return _torch(_binary, n)
        if o_dim == 2 and not labels:  # one-hot or class probabilities
            return _torch(_one_hot, o_shape[0])
        if labels:
            raise refuse(
                "integer targets shaped like the outputs could be one-hot (F.one_hot) or per-element "
                "0/1 labels; pass targets.float() for one-hot [N, C], targets.bool() for per-element labels"
            )
        raise refuse(
            "floating targets shaped like the outputs are one-hot only as [N, C] (flatten to [M, C]); "
            "for per-element binary labels pass bool targets"
        )
    if o_dim == t_dim + 1:
        last = o_shape[:-1] == t_shape
        first = o_dim >= 3 and o_shape[0] == t_shape[0] and o_shape[2:] == t_shape[1:]
        if last and o_shape[-1] == 1:  # [N, 1] logits with [N] labels: binary
            return _torch(_binary_last, n)
        if first and o_shape[1] == 1:
            return _torch(_binary_first, n)
        if (last or first) and not labels:
            raise refuse("class indices must be an integer tensor (targets.long())")
        if (last and o_shape[-1] == 0) or (first and not last and o_shape[1] == 0):
            raise refuse("there are no classes (a dimension of 0 where the class scores go)")
        if last and first:  # (the run's other steps tell which: TrainAccuracy.layout)
            return _Either(_torch(_classes_last, n), _torch(_classes_first, n))
        if last:
            settles = "last" if o_dim >= 3 else None  # ([N, C] with [N] settles nothing: no 2nd reading)
            count = _CORRECT.get(o_dtype)
            if count is not None and o_dim == 2 and o_device.type == "cpu" and t_dtype == torch.int64:
                return _Layout(_ClassesLastFused(count, o_shape[0], o_shape[1]), n, None)
            return _torch(_classes_last, n, settles)
        if first:
            return _torch(_classes_first, n, "first")
    raise refuse("the shapes do not match any of these layouts (is the batch the same?)")
