"""``observe()``'s options, checked once into a frozen :class:`Options` before anything is attached.

Everything here is checked without the model: a trainer callback checks its ``observe()`` keyword
arguments when it is created (``StreamwatchCallback(every=0)`` fails there, not inside ``fit()``), and
``observe()`` checks the same way before it touches the model. What needs the model or the optimizer
(``select=`` matching no module, a metric that measures an optimizer step with none given) is checked
by the :class:`streamwatch.Watch`.

Example:
    >>> options = parse_options(**OBSERVE_DEFAULTS)
    >>> options.every, options.budget, sorted(options.taps)
    (1, 0.02, ['activation', 'output_grad', 'param', 'param_grad', 'update'])
    >>> parse_options(**{**OBSERVE_DEFAULTS, "every": 0})
    Traceback (most recent call last):
    ...
    ValueError: Expected `every` to be a positive integer, got 0
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from streamwatch._channel import OVERFLOW_POLICIES, OverflowPolicy
from streamwatch._detail import Detail, check_detail
from streamwatch._detectors import DEFAULT_DETECTORS, Detector, check_detectors
from streamwatch._governor import check_budget
from streamwatch._nonfinite import (
    DEFAULT_ESCALATE,
    Reaction,
    check_escalate,
    check_on_nonfinite,
    check_sentinel,
)
from streamwatch._pipeline import Sink
from streamwatch._select import Select, resolve_select
from streamwatch._taps import DEFAULT_CADENCE, DEFAULT_TAPS, KINDS
from streamwatch._validate import check_int
from streamwatch._worker import seconds_or_forever
from streamwatch.metrics._base import Metric
from streamwatch.metrics._derived import DEFAULT_METRICS, DERIVED

__all__ = ["DEFAULT_OVERHEAD", "OBSERVE_DEFAULTS", "STATS", "Options", "parse_options"]

STATS = ("dead", "nonfinite")
"""Optional summary statistics: ``dead`` (per-unit activity → dead-unit rate; on by default) and
``nonfinite`` (exact NaN/Inf counts, one more pass per tensor; off by default — a free 0/1 presence
flag is reported instead)."""

DEFAULT_OVERHEAD = 0.02
"""``observe()``'s default: the overhead governor holds monitoring to 2 % of the run's time."""

OBSERVE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "every": None,
        "overhead": None,
        "select": None,
        "taps": DEFAULT_TAPS,
        "cadence": None,
        "stats": ("dead",),
        "channel_last": None,
        "overflow": "drop_oldest",
        "capacity": 64,
        "sinks": (),
        "metrics": DEFAULT_METRICS,
        "close_timeout": 30.0,
        "detail": "all",
        "detectors": DEFAULT_DETECTORS,
        "on_nonfinite": "warn",
        "escalate": DEFAULT_ESCALATE,
        "sentinel": None,
        "start_step": 0,
    }
)
"""``observe()``'s keyword arguments and their defaults (its signature states the same values; a test
keeps the two equal)."""


@dataclass(frozen=True, slots=True)
class Options:
    """``observe()``'s keyword arguments, checked and in the form the Watch uses them.

    Attributes:
        every: one step in ``every`` is sampled (1 under the governor, which decides per step).
        budget: the overhead governor's budget (``overhead=``), None with a fixed ``every=``.
        select: which modules (``select=`` resolved); ``every_parameter``: ``select=None``, whose
            parameter taps take every parameter of the model, by owner.
        taps, taps_asked: the tap kinds, and whether ``taps=`` was given (the default asks for updates
            only where there is an optimizer).
        cadence: per kind, one sampled step in ``cadence[kind]`` samples it (the defaults merged).
        stats, channel_last, overflow, capacity, close_timeout (None: forever), detail, detectors,
        reaction (``on_nonfinite=``), escalate, start_step: as given, checked.
        sinks: the extra sinks (one sink given alone is a one-element tuple).
        derived: the worker-side metrics by name; metrics: the opt-in metric objects.
        sentinel: what the per-step sentinel checks; auto_grad_norm: the gradient norm joins it on
            trial (``sentinel=None`` under a governor).
    """

    every: int
    budget: float | None
    select: Select
    every_parameter: bool
    taps: frozenset[str]
    taps_asked: bool
    cadence: Mapping[str, int]
    stats: frozenset[str]
    channel_last: bool | None
    overflow: OverflowPolicy
    capacity: int
    sinks: tuple[Sink, ...]
    derived: tuple[str, ...]
    metrics: tuple[Metric, ...]
    close_timeout: float | None
    detail: Detail
    detectors: tuple[Detector, ...]
    reaction: Reaction
    escalate: int
    sentinel: frozenset[str]
    auto_grad_norm: bool
    start_step: int


def parse_options(
    *,
    every: object,
    overhead: object,
    select: object,
    taps: object,
    cadence: object,
    stats: object,
    channel_last: object,
    overflow: object,
    capacity: object,
    sinks: object,
    metrics: object,
    close_timeout: object,
    detail: object,
    detectors: object,
    on_nonfinite: object,
    escalate: object,
    sentinel: object,
    start_step: object,
) -> Options:
    """Check ``observe()``'s keyword arguments (without the model); the first bad one raises a
    ``TypeError`` or ``ValueError`` naming it, what it was, and what to pass.

    Example:
        >>> parse_options(**{**OBSERVE_DEFAULTS, "every": 4}).budget is None  # every= fixes the interval
        True
    """
    if every is not None and overhead is not None:
        raise ValueError(
            f"Expected `every` or `overhead`, got both (every={every!r}, overhead={overhead!r}): pass "
            "one: every= fixes the interval, overhead= sets a budget"
        )
    if every is None and overhead is None:
        overhead = DEFAULT_OVERHEAD  # the default is a budget, not an interval
    if every is None:
        every = 1
    every = check_int(every, "every")
    budget = None if overhead is None else check_budget(overhead, "overhead")
    checked_start = check_start_step(start_step)
    chosen_detectors = check_detectors(detectors)
    reaction = check_on_nonfinite(on_nonfinite)
    checked_escalate = check_escalate(escalate)
    checks = check_sentinel(("loss",) if sentinel is None else sentinel)
    chosen_taps = _names(taps, "taps", KINDS)
    chosen_stats = _names(stats, "stats", STATS)
    merged = _cadence(cadence)
    if channel_last is not None and not isinstance(channel_last, bool):
        raise TypeError(
            f"Expected `channel_last` to be True, False or None (chosen per module), got {channel_last!r}"
        )
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"Expected `overflow` to be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    capacity = check_int(capacity, "capacity")
    timeout = seconds_or_forever(close_timeout, "close_timeout")
    checked_detail = check_detail(detail)
    chosen_sinks = _sinks(sinks)
    derived, objects = _split_metrics(metrics, chosen_taps, governed=budget is not None)
    return Options(
        every=every,
        budget=budget,
        select=resolve_select(select),
        every_parameter=select is None,
        taps=chosen_taps,
        taps_asked=taps is not DEFAULT_TAPS,
        cadence=MappingProxyType(merged),
        stats=chosen_stats,
        channel_last=channel_last,
        overflow=overflow,  # type: ignore[arg-type]  # (one of OVERFLOW_POLICIES: checked above)
        capacity=capacity,
        sinks=tuple(chosen_sinks),
        derived=tuple(derived),
        metrics=tuple(objects),
        close_timeout=timeout,
        detail=checked_detail,
        detectors=chosen_detectors,
        reaction=reaction,
        escalate=checked_escalate,
        sentinel=checks,
        auto_grad_norm=sentinel is None and budget is not None,
        start_step=checked_start,
    )


def check_start_step(value: object) -> int:
    """``start_step``, checked.

    Example:
        >>> check_start_step(1200)
        1200
        >>> check_start_step(-1)
        Traceback (most recent call last):
        ...
        ValueError: Expected `start_step` to be an integer >= 0 (the steps already done when resuming), got -1
    """
    return check_int(value, "start_step", minimum=0, note="the steps already done when resuming")


def _names(value: object, name: str, allowed: tuple[str, ...]) -> frozenset[str]:
    """``taps=`` / ``stats=``: a collection of known names, read once (a generator is fine)."""
    if isinstance(value, str):
        raise ValueError(f"Expected `{name}` to be a collection of {allowed}, got {value!r}")
    if not isinstance(value, Iterable):
        raise TypeError(f"Expected `{name}` to be a collection of {allowed}, got {value!r}")
    try:
        chosen = frozenset(value)
    except TypeError:  # unhashable entries
        raise TypeError(f"Expected `{name}` to be a collection of {allowed}, got {value!r}") from None
    if chosen - set(allowed):
        shown = value if isinstance(value, Collection) else sorted(chosen, key=repr)
        raise ValueError(f"Expected `{name}` to be a collection of {allowed}, got {shown!r}")
    return chosen


def _cadence(cadence: object) -> dict[str, int]:
    """``cadence=`` merged over the defaults."""
    merged = dict(DEFAULT_CADENCE)
    if cadence is None:
        return merged
    if not isinstance(cadence, Mapping):
        raise TypeError(
            f"Expected `cadence` to be a mapping of tap kinds to positive integers (or None), got {cadence!r}"
        )
    for kind, n in cadence.items():
        if kind not in KINDS or isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Expected `cadence` to map tap kinds to positive integers, got {kind!r}: {n!r}")
        merged[kind] = n
    return merged


def _sinks(sinks: object) -> list[Sink]:
    """``sinks=``: a collection of sinks, or one sink (read as a one-element list)."""
    if isinstance(sinks, Sink):
        return [sinks]
    if isinstance(sinks, str | bytes | Mapping) or not isinstance(sinks, Iterable):
        raise TypeError(f"Expected `sinks` to be a Sink or a collection of Sinks, got {sinks!r}")
    out = list(sinks)
    for sink in out:
        if not isinstance(sink, Sink):
            raise TypeError(f"Expected every entry of `sinks` to be a Sink, got {sink!r}")
    return out


def _split_metrics(
    metrics: object, taps: frozenset[str], *, governed: bool
) -> tuple[list[str], list[Metric]]:
    """Names of worker-side metrics and opt-in metric objects, validated before anything is attached
    (whether a metric needs an optimizer is the Watch's to check: it has the optimizer)."""
    if isinstance(metrics, Metric):
        raise TypeError(
            f"Expected `metrics` to be a collection of names and metric objects, got the single metric "
            f"{metrics!r}: `metrics=` replaces the defaults, so pass "
            f"metrics=[*streamwatch.DEFAULT_METRICS, {metrics!r}] to add it to them"
        )
    if isinstance(metrics, str | bytes | Mapping) or not isinstance(metrics, Iterable):
        raise TypeError(f"Expected `metrics` to be a collection of names and metric objects, got {metrics!r}")
    names: list[str] = []
    objects: list[Metric] = []
    for metric in metrics:
        if isinstance(metric, str):
            if metric not in DERIVED:
                raise ValueError(
                    f"Unknown metric {metric!r}: the names are {sorted(DERIVED)}; opt-in metrics are objects "
                    "from streamwatch.metrics (e.g. streamwatch.metrics.SpectralNorm())"
                )
            if metric not in names:
                names.append(metric)
        elif isinstance(metric, Metric):
            if metric.binding is not None or metric in objects:
                raise RuntimeError(
                    f"{metric!r} is already bound to an observed model; create a new one per observe()"
                )
            if governed and metric.needs_prepare:
                raise ValueError(
                    f"{metric!r} acts on the step before each step it samples, which the overhead governor "
                    "(observe()'s default, or overhead=) cannot know in advance: it decides when a step "
                    "begins. Pass every=N (a fixed interval) to use it"
                )
            missing = [kind for kind in metric.kinds if kind not in taps]
            if missing:
                raise ValueError(
                    f"{metric!r} reads {missing} tensors, which are not tapped; add them to `taps=` "
                    f"(now {sorted(taps)})"
                )
            binned = set(metric.edges())
            for other in objects:  # one record holds one histogram per tensor: a second would replace it
                shared = sorted(binned & set(other.edges()))
                if shared:
                    raise ValueError(
                        f"{metric!r} and {other!r} both bin {shared} tensors into histograms, and a record "
                        "holds one histogram per tensor (the second would silently replace the first): "
                        "pass one Histogram per kind (kinds=(...) takes several kinds)"
                    )
            objects.append(metric)
        else:
            raise TypeError(
                f"Expected a metric name or a streamwatch.metrics object in `metrics`, got {metric!r}"
            )
    return names, objects
