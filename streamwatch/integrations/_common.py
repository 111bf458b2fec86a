"""What both trainer callbacks share: their ``observe()`` options checked when they are made, the Watch
made from them when training begins, the rank check, and closing at the end without raising.

Example:
    >>> observe_options({"every": 4}, "StreamwatchCallback").every
    4
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from streamwatch._detail import position
from streamwatch._exceptions import PipelineError
from streamwatch._observe import Watch
from streamwatch._options import OBSERVE_DEFAULTS, Options, check_start_step, parse_options

__all__ = ["check_rank", "close_at_end", "make_watch", "observe_options"]

_OBSERVE_KEYWORDS = frozenset(OBSERVE_DEFAULTS) - {"start_step"}


def observe_options(kwargs: Mapping[str, Any], owner: str) -> Options:
    """``observe()``'s keyword arguments for a callback, checked — names and values — when the callback
    is created: a bad value fails there, not inside ``fit()``/``train()``. The callback makes each run's
    Watch from the options (:func:`make_watch`), so an argument read once (a generator of tap kinds) is
    read here, once.

    Example:
        >>> observe_options({"every": 2}, "StreamwatchCallback").every
        2
        >>> for bad in ({"evry": 2}, {"every": 0}):
        ...     try:
        ...         observe_options(bad, "StreamwatchCallback")
        ...     except (TypeError, ValueError) as err:
        ...         print(str(err).split(":")[0])
        StreamwatchCallback got unknown keyword argument(s) ['evry']
        Expected `every` to be a positive integer, got 0
    """
    if "start_step" in kwargs:
        raise TypeError(
            f"{owner} numbers steps from the trainer's own step count (a resumed run goes on from its "
            "checkpoint's): start_step is not one of its arguments"
        )
    unknown = sorted(set(kwargs) - _OBSERVE_KEYWORDS)
    if unknown:
        raise TypeError(
            f"{owner} got unknown keyword argument(s) {unknown}: it takes streamwatch.observe()'s keyword "
            f"arguments ({', '.join(sorted(_OBSERVE_KEYWORDS))}); the model and the optimizer come from "
            "the trainer"
        )
    return parse_options(**{**OBSERVE_DEFAULTS, **kwargs})


def make_watch(model: Any, optimizer: Any, options: Options, start_step: int) -> Watch:
    """``observe(model, optimizer, **kwargs, start_step=start_step)`` from a callback's options."""
    return Watch(model, optimizer, dataclasses.replace(options, start_step=check_start_step(start_step)))


def check_rank(trainer_rank: int, where: str) -> None:
    """Warn if the rank ``observe()`` labels records with differs from the trainer's global rank.

    ``observe()`` takes the rank from ``torch.distributed`` when a process group is initialised (else
    ``$RANK``, else 0). Lightning and the Hugging Face Trainer initialise the process group before their
    callbacks create the watch, so the two agree; a strategy that runs without ``torch.distributed``
    could make them differ, and the records would then carry the wrong ``rank``.
    """
    rank = position()[0]
    if rank != trainer_rank:
        warnings.warn(
            f"streamwatch: the trainer's global rank is {trainer_rank} ({where}) but streamwatch labels this "
            f"process' records rank={rank} (it reads torch.distributed, else $RANK): the per-rank series "
            "of this process are mislabelled; initialise torch.distributed or set RANK",
            RuntimeWarning,
            stacklevel=3,
        )


def close_at_end(watch: Watch | None, owner: str) -> None:
    """Close ``watch`` when the trainer's run has ended normally. A pipeline that failed during the run
    (warned when it failed) is warned about again here, not raised: the training finished, and an
    exception out of the trainer's last event would mark the run failed and skip what the script does
    next (saving the model, the other callbacks' teardown). ``callback.close()`` raises it as usual."""
    if watch is None:
        return
    try:
        watch.close()
    except PipelineError as error:
        warnings.warn(
            f"streamwatch ({owner}): the run finished, but part of its monitoring failed: {error}",
            RuntimeWarning,
            stacklevel=3,
        )
