"""What both trainer callbacks share: their ``observe()`` options and where they serve and record,
checked when they are made; the Watch made from them when training begins (with its ``/metrics``
endpoint and run file); the values the trainer logs, served beside the watch's series; the rank check;
and closing at the end without raising.

Example:
    >>> observe_options({"every": 4}, "StreamwatchCallback").every
    4
    >>> serving_options(True, "127.0.0.1", None, "StreamwatchCallback").port
    16400
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from streamwatch._detail import position
from streamwatch._exceptions import PipelineError
from streamwatch._families import LOGGED_PREFIX, LOGGED_REFUSED, logged_sample
from streamwatch._observe import Watch
from streamwatch._options import OBSERVE_DEFAULTS, Options, check_start_step, parse_options
from streamwatch._record import Sample
from streamwatch._store import SeriesStore
from streamwatch._validate import check_int
from streamwatch.sinks._prometheus import DEFAULT_PORT, Exporter
from streamwatch.sinks._runreader import RUN_FILE, rank_file
from streamwatch.sinks._runwriter import RunFile

__all__ = [
    "LOGGED_CAP",
    "Logged",
    "Serving",
    "check_rank",
    "close_at_end",
    "make_watch",
    "observe_options",
    "serving_options",
    "start_watch",
]

LOGGED_CAP = 64
"""The most distinct ``streamwatch_logged_*`` series a callback serves (a bounded series count: a
trainer that logs a new name every step cannot grow /metrics without end)."""

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


@dataclasses.dataclass(frozen=True, slots=True)
class Serving:
    """Where a callback's watch serves ``/metrics`` and records its steps.

    Attributes:
        port: the base port (``port + LOCAL_RANK`` per process; 0: any free port); None: no endpoint.
        host: the interface to bind.
        run_dir: the directory of the run file (None: none). One process writes ``run.jsonl``; in a
            job of several, each rank writes ``run-rank{N}.jsonl`` (a run file has one writer).
    """

    port: int | None
    host: str
    run_dir: Path | None


def serving_options(expose: object, host: object, run_dir: object, owner: str) -> Serving:
    """A callback's ``expose=``, ``host=`` and ``run_dir=``, checked when it is made: ``expose`` True (the
    default port, 16400), False (no endpoint) or a base port; ``run_dir`` a path or None.

    Example:
        >>> serving_options(9500, "0.0.0.0", "runs/a", "StreamwatchCallback")
        Serving(port=9500, host='0.0.0.0', run_dir=PosixPath('runs/a'))
        >>> serving_options("yes", "127.0.0.1", None, "StreamwatchCallback")
        Traceback (most recent call last):
        ...
        TypeError: Expected `expose` to be True, False or a port number, got 'yes'
    """
    if isinstance(expose, bool):
        port = DEFAULT_PORT if expose else None
    elif isinstance(expose, numbers.Integral):
        port = check_int(expose, "expose", minimum=0, maximum=65535, note="a base port")
    else:
        raise TypeError(f"Expected `expose` to be True, False or a port number, got {expose!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"Expected `host` to be an interface address such as '127.0.0.1', got {host!r}")
    if run_dir is not None and not isinstance(run_dir, str | os.PathLike):
        raise TypeError(f"Expected `run_dir` to be a path (str or os.PathLike) or None, got {run_dir!r}")
    return Serving(port, host, None if run_dir is None else Path(os.fspath(run_dir)))


def start_watch(
    model: Any, optimizer: Any, options: Options, start_step: int, serving: Serving
) -> tuple[Watch, Exporter | None]:
    """:func:`make_watch`, with a run file in ``serving.run_dir`` (made if missing) among its sinks and its
    ``/metrics`` endpoint started (``watch.expose(serving.port, host=serving.host)``). If either fails (a
    port in use, a directory that cannot be written), nothing is left attached and the error is raised:
    the user asked for it."""
    run_file = None
    if serving.run_dir is not None:
        rank, _, world_size = position()
        serving.run_dir.mkdir(parents=True, exist_ok=True)
        run_file = RunFile(serving.run_dir / (rank_file(rank) if world_size > 1 else RUN_FILE))
        options = dataclasses.replace(options, sinks=(*options.sinks, run_file))
    try:
        watch = make_watch(model, optimizer, options, start_step)
    except BaseException:
        if run_file is not None:
            run_file.close()
        raise
    if serving.port is None:
        return watch, None
    try:
        return watch, watch.expose(serving.port, host=serving.host)
    except BaseException:
        watch.close()
        raise


def _number(value: object) -> float | None:
    """A logged value as a float: a real number, or a one-element real tensor (read from its device);
    None for anything else.

    Example:
        >>> _number(0.5), _number(torch.tensor([2.0])), _number(True), _number("x"), _number(torch.ones(2))
        (0.5, 2.0, None, None, None)
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


class Logged:
    """What a trainer logs, served beside the watch's own series: each value as :func:`logged_sample`
    names it (``eval_loss`` → ``streamwatch_loss{phase="eval"}``, ``val/acc`` →
    ``streamwatch_logged_val_acc``), put in the watch's store (``watch.store.put``), so ``/metrics``,
    ``watch.snapshot()`` and the live view have it at once. Values that are not one real number are
    passed over. At most ``cap`` distinct ``streamwatch_logged_*`` series: a value under a new name past
    the cap, or under a name that cannot be made a metric name, is refused, counted in
    ``streamwatch_logged_values_refused_total`` and warned about once.

    Example:
        >>> store = SeriesStore(metrics=())
        >>> logged = Logged(store, "StreamwatchCallback", cap=1)
        >>> with warnings.catch_warnings(record=True) as warned:
        ...     warnings.simplefilter("always")
        ...     logged.put({"eval_loss": 0.5, "val/acc": 0.75, "epoch": 1.0, "note": "text"})
        >>> sorted((s.name, s.value) for s in store.samples())  # doctest: +NORMALIZE_WHITESPACE
        [('streamwatch_logged_val_acc', 0.75), ('streamwatch_logged_values_refused', 1.0),
         ('streamwatch_loss', 0.5)]
        >>> "'epoch'" in str(warned[0].message)
        True
    """

    def __init__(self, store: SeriesStore, owner: str, cap: int = LOGGED_CAP) -> None:
        self.store = store
        self.owner = owner
        self.cap = cap
        self.names: set[str] = set()  # the streamwatch_logged_* series served
        self.refused = 0
        self._warned = False

    def put(self, values: Mapping[str, object]) -> None:
        """Serve ``values`` (name → value) as the latest of their series. Thread-safe (the store's lock)."""
        samples: list[Sample] = []
        refused: list[str] = []
        for key, value in values.items():
            number = _number(value)
            if number is None:
                continue
            sample = logged_sample(str(key), number)
            if sample is not None and sample.name.startswith(LOGGED_PREFIX) and sample.name not in self.names:
                if len(self.names) >= self.cap:
                    sample = None
                else:
                    self.names.add(sample.name)
            if sample is None:
                refused.append(str(key))
            else:
                samples.append(sample)
        if refused:
            self.refused += len(refused)
            samples.append(Sample(LOGGED_REFUSED.name, {}, float(self.refused)))
            self._warn(refused)
        if samples:
            self.store.put(samples)

    def _warn(self, refused: list[str]) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"{self.owner}: the trainer logged {', '.join(map(repr, refused))}, which /metrics does not "
            f"serve: at most {self.cap} distinct logged names are served (streamwatch_logged_<name>), and "
            "a name must leave a metric name once its other characters become _ and must not end in "
            "_total, _count, _sum or _bucket; refused values are counted in "
            "streamwatch_logged_values_refused_total (warned once)",
            RuntimeWarning,
            stacklevel=3,
        )


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
