"""The clip tap: the gradient norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it.

Parameter-gradient rows are read as the optimizer gets them — after clipping — so a clipped norm never
rises above ``max_norm`` and an explosion that clipping contains is invisible in them. The norm before
clipping is what ``clip_grad_norm_`` computes anyway and returns (a 0-d tensor on the gradients' device).
While a watch is open, ``torch.nn.utils.clip_grad_norm_`` (the attribute of ``torch.nn.utils`` and of
``torch.nn.utils.clip_grad``, which Lightning, Accelerate and the Hugging Face Trainer call through) is a
thin wrapper: it calls the original with the same arguments (a generator of parameters made a list first,
as the original does itself) and returns its result untouched; then, for a call with ``norm_type=2`` over
parameters of an observed model, it hands the returned tensor to that watch as the step's
``grad_norm`` — ``watch.log(grad_norm=...)``'s path: ``log/grad_norm`` in the step's scalars, carried
every step like the loss, ``streamwatch_grad_norm`` on ``/metrics``. No extra kernel, no copy and no sync:
a CUDA norm stays on its device until the record's one copy. The last call of a step wins.

Not seen: a ``clip_grad_norm_`` imported by name before the watch opened (``from torch.nn.utils import
clip_grad_norm_``), FSDP1's ``model.clip_grad_norm_``, ``get_total_norm`` with ``clip_grads_with_norm_``,
other norm types, and a total that is not a plain tensor (FSDP2's DTensor: reading it may need a
collective); log the norm yourself there (``watch.log(grad_norm=norm)``). When the last watch
closes the originals are put back, unless someone replaced the wrapper meanwhile (then it stays, passing
every call straight through).

Example:
    >>> seen = []
    >>> model = torch.nn.Linear(3, 1)
    >>> handle = watch_clipping(model.parameters(), seen.append, print)
    >>> model(torch.ones(2, 3)).sum().backward()
    >>> total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    >>> seen == [total], handle.remove(), torch.nn.utils.clip_grad_norm_ is ORIGINAL
    (True, None, True)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

__all__ = ["GRAD_NORM", "ORIGINAL", "ClipHandle", "log_clipping", "watch_clipping"]

GRAD_NORM = "grad_norm"
"""The name the clip tap logs the norm under (the step's scalar ``log/grad_norm``; the Hugging Face
Trainer's name for the same value, served as ``streamwatch_grad_norm``)."""

ORIGINAL: Callable[..., torch.Tensor] = torch.nn.utils.clip_grad.clip_grad_norm_
"""``torch.nn.utils.clip_grad_norm_`` as torch defines it."""


Recorder = Callable[[torch.Tensor], object]
"""What receives each norm (on the training thread, after the clipping)."""


class ClipHandle:
    """One watch's listening to ``clip_grad_norm_``: :meth:`remove` ends it (idempotent)."""

    __slots__ = ("fail", "ids", "record")

    def __init__(self, ids: frozenset[int], record: Recorder, fail: Callable[[Exception], object]) -> None:
        self.ids = ids
        self.record = record
        self.fail = fail

    def remove(self) -> None:
        with _LOCK:
            if self in _LISTENERS:
                _LISTENERS.remove(self)
                if not _LISTENERS:
                    _restore()


_LOCK = threading.Lock()
_LISTENERS: list[ClipHandle] = []


def watch_clipping(
    parameters: Iterable[torch.Tensor],
    record: Callable[[torch.Tensor], object],
    fail: Callable[[Exception], object],
) -> ClipHandle:
    """From now on, hand every 2-norm ``clip_grad_norm_`` returns over any of ``parameters`` to
    ``record`` (on the caller's thread, after the clipping); an exception ``record`` raises goes to
    ``fail``, never into training."""
    handle = ClipHandle(frozenset(id(p) for p in parameters), record, fail)
    with _LOCK:
        if not _LISTENERS:
            _install()
        _LISTENERS.append(handle)
    return handle


def log_clipping(
    model: torch.nn.Module, add: Callable[[Mapping[str, object]], object], fail: Callable[[Exception], object]
) -> ClipHandle:
    """:func:`watch_clipping` over ``model``'s parameters, each norm added as ``{GRAD_NORM: norm}`` (a
    watch's ``LogBook.add``: the step's ``log/grad_norm``)."""
    return watch_clipping(model.parameters(), lambda norm: add({GRAD_NORM: norm}), fail)


@functools.wraps(ORIGINAL)
def _clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    listeners = tuple(_LISTENERS)
    inner = _SAVED[0]
    if not listeners:
        return inner(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = inner(params, max_norm, norm_type, error_if_nonfinite, foreach)
    # a plain tensor only: a DTensor's (FSDP2) total may be a partial sum whose value needs a collective,
    # which monitoring never starts
    if type(total) is not torch.Tensor or not _is_two(norm_type):
        return total
    for listener in listeners:
        try:
            if any(id(p) in listener.ids for p in params):
                listener.record(total)
        except Exception as exc:  # never into the training step: counted and reported at close()
            listener.fail(exc)
    return total


def _is_two(norm_type: Any) -> bool:
    try:
        return float(norm_type) == 2.0
    except (TypeError, ValueError):
        return False


_SAVED: list[Callable[..., torch.Tensor]] = [ORIGINAL, ORIGINAL]
"""What the two attributes held when the wrapper went in (what it calls, and what goes back)."""


def _install() -> None:
    if torch.nn.utils.clip_grad_norm_ is not _clip_grad_norm_:  # (still in from a replaced restore)
        _SAVED[:] = [torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_]
    torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_


def _restore() -> None:
    if torch.nn.utils.clip_grad_norm_ is _clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = _SAVED[0]
    if torch.nn.utils.clip_grad.clip_grad_norm_ is _clip_grad_norm_:
        torch.nn.utils.clip_grad.clip_grad_norm_ = _SAVED[1]
