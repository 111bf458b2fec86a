"""The one mapping from streamwatch's data to Prometheus families: names, types, help, label names and
the labels nobody else may use. Every family the exporter serves (live, from a caller's registry, reduced
to fit the series budget, or replayed) is one of :data:`FAMILIES` or a family a user serves through
``watch.serve()``, which :func:`check_served` keeps from clashing with them.

Naming: namespace ``streamwatch_``, base units (seconds, ratios), counters end in ``_total`` (the
``Family.name`` is the name without it, as OpenMetrics and prometheus_client's parser have it); one
family per statistic (:func:`tensor_family`: ``streamwatch_tensor_l2``, never a ``stat`` label on
/metrics); every series carries ``run`` and ``rank`` (:data:`SERIES_IDENTITY`), and ``streamwatch_info``
the whole identity :data:`IDENTITY` — both added by the exporter.

Step-level values of a :class:`streamwatch.StepRecord` (its ``scalars``) become samples here, in
:func:`scalar_sample`: the record's names (``loss``, ``part/forward``, ``lr/0``, ``eval/accuracy``,
...) are the run file's, so they are read in this one place.

Example:
    >>> FAMILIES["streamwatch_steps"].exposed, FAMILIES["streamwatch_steps"].type
    ('streamwatch_steps_total', 'counter')
    >>> scalar_sample("lr/0", 0.1)
    Sample(name='streamwatch_learning_rate', labels={'group': '0'}, value=0.1)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from streamwatch._record import Sample, SeriesKey, StepRecord

__all__ = [
    "ALL_LAYERS",
    "DATA_FAMILIES",
    "DETECTOR_FAMILIES",
    "DRIFT_ALARMS",
    "DRIFT_CUSUM",
    "FAMILIES",
    "FIRST_NONFINITE_INFO",
    "FIRST_NONFINITE_STEP",
    "HISTOGRAM_SAMPLE",
    "IDENTITY",
    "INFO",
    "LAYER_MEAN",
    "LAYER_MEAN_FAMILIES",
    "LAYER_MEAN_PREFIX",
    "LOGGED",
    "LOGGED_PREFIX",
    "LOGGED_REFUSED",
    "PER_LAYER_FAMILIES",
    "RESERVED_LABELS",
    "SELF_FAMILIES",
    "SERIES_IDENTITY",
    "STEP",
    "STEPPED_WEIGHT_SUMSQ",
    "STEP_DURATION",
    "TENSOR",
    "TENSOR_FAMILIES",
    "TENSOR_PREFIX",
    "TENSOR_VALUES",
    "TRAINER_LOGS",
    "Family",
    "check_served",
    "exposed_sample",
    "logged_sample",
    "scalar_sample",
    "served_family",
    "stepped_weight_sumsq",
    "tensor_family",
]

IDENTITY = ("run", "rank", "local_rank", "world_size", "host")
"""The process identity: all of it on ``streamwatch_info``, :data:`SERIES_IDENTITY` on every series
(Prometheus adds ``job`` and ``instance``)."""

RESERVED_LABELS = frozenset({*IDENTITY, "le", "quantile"})
"""Labels a served family may not use (besides any starting with ``__``): the identity, and the labels
Prometheus gives a meaning (histogram and summary buckets)."""

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_SAMPLE_SUFFIXES = ("_total", "_count", "_sum", "_bucket")

FamilyType = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True, slots=True)
class Family:
    """A Prometheus metric family streamwatch serves.

    Attributes:
        name: the family's name (a counter's without its ``_total``).
        type: ``gauge``, ``counter`` or ``histogram``.
        help: its HELP text.
        labels: its labels besides the identity (a histogram's ``le`` aside).
    """

    name: str
    type: FamilyType
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exposed(self) -> str:
        """The name of its samples and of its HELP/TYPE lines in the text format (``_total`` for
        counters; a histogram's samples add ``_bucket``)."""
        return f"{self.name}_total" if self.type == "counter" else self.name


def _gauge(name: str, help: str, *labels: str) -> Family:
    return Family(f"streamwatch_{name}", "gauge", help, labels)


def _counter(name: str, help: str, *labels: str) -> Family:
    return Family(f"streamwatch_{name}", "counter", help, labels)


_TENSOR_KEY = ("phase", "layer", "kind", "param", "index")

ALL_LAYERS = "__all__"
"""The ``layer`` of a row that totals every layer of one phase and kind: what ranks without per-layer
detail serve (``observe(detail=...)``, docs/scale.md), and a scrape over the series budget falls back to."""

STEPPED_WEIGHT_SUMSQ = "stepped_weight_sumsq"
"""The ``stat`` of the extra a reduced record's ``update`` total carries: the sum of squares of the
weights that have an update row, the update/weight ratio's denominator (every weight's would count a
frozen backbone's, which has no update, and dilute the ratio out of its band)."""


def stepped_weight_sumsq(record: StepRecord, key: SeriesKey) -> float | None:
    """The :data:`STEPPED_WEIGHT_SUMSQ` that ``record``'s update row ``key`` carries (a reduced record's
    ``__all__`` total); None if it carries none. An update/weight ratio divides by it rather than every
    weight's; a NaN (no stepped weight's sum known) makes the ratio unknown, never the diluted one.

    Example:
        >>> import numpy as np
        >>> from streamwatch import SeriesKey, StepRecord
        >>> from streamwatch.testing import table
        >>> key = SeriesKey("train", ALL_LAYERS, "update", "")
        >>> extras = {(key, STEPPED_WEIGHT_SUMSQ): np.array([4.0])}
        >>> record = StepRecord(0, 0.0, 0, (key,), table(1), extras=extras)
        >>> empty = StepRecord(0, 0.0, 0, (), table(0))
        >>> stepped_weight_sumsq(record, key), stepped_weight_sumsq(empty, key)
        (4.0, None)
    """
    value = record.extras.get((key, STEPPED_WEIGHT_SUMSQ))
    if value is None or not len(value):
        return None
    return float(value[0])


INFO = _gauge(
    "info", "Process identity of a streamwatch exporter (host, local_rank, world_size live here)", "version"
)
TENSOR = _gauge(
    "tensor",
    "Statistics of a tapped tensor, by stat (snapshot() only; /metrics serves one family per statistic)",
    *_TENSOR_KEY,
    "stat",
)
"""The per-tensor statistics as ``watch.snapshot()`` holds them (a ``stat`` label); the exporter serves
each statistic as a family of its own (:func:`tensor_family`), so ``sum()`` over a family's labels adds
values of one unit."""

_TENSOR_STATS: Mapping[str, tuple[str, str]] = {
    # stat: (family suffix, help); base units: a family of the tensor's unit has no unit suffix (it has
    # none of its own), element and unit counts say what they count, ratios end in _ratio
    "count": ("elements", "Elements of the tensor"),
    "sum": ("sum_of_values", "Sum of the elements (the tensor's unit)"),
    "sumsq": ("sum_of_squares", "Sum of the squared elements (a norm is the square root of a sum of them)"),
    "min": ("min", "Smallest element (NaN if any is NaN)"),
    "max": ("max", "Largest element (NaN if any is NaN)"),
    "zeros": ("zero_elements", "Elements equal to zero"),
    "nonfinite": ("nonfinite_elements", "NaN and infinite elements (an exact count, or a 0/1 flag)"),
    "units": ("units", "Units (neurons, channels) whose per-unit activity was taken"),
    "dead": ("dead_units", "Units inactive for every sample of the batch"),
    "samples": ("activity_samples", "Samples behind the per-unit activity (the batch)"),
    "active": ("active_unit_samples", "(sample, unit) pairs in which the unit was active"),
    "sumabs": ("sum_of_magnitudes", "Sum of the elements' magnitudes"),
    "sumcube": ("sum_of_cubes", "Sum of the cubed elements"),
    "sumfourth": ("sum_of_fourth_powers", "Sum of the elements' fourth powers"),
    "mean": ("mean", "Mean of the elements"),
    "var": ("variance", "Population variance of the elements (the tensor's unit squared)"),
    "std": ("stddev", "Population standard deviation of the elements"),
    "l2": ("l2", "L2 norm of the tensor"),
    "rms": ("rms", "Root mean square of the elements"),
    "absmax": ("absmax", "Largest magnitude of an element (the infinity norm)"),
    "zero_fraction": ("zero_ratio", "Fraction of the elements equal to zero"),
    "dead_fraction": ("dead_ratio", "Fraction of the units inactive for every sample"),
    "activation_rate": ("activation_ratio", "Fraction of (sample, unit) pairs in which the unit was active"),
    "mean_abs": ("mean_magnitude", "Mean magnitude of the elements"),
    "skewness": ("skewness", "Skewness of the elements (population)"),
    "kurtosis": ("kurtosis", "Pearson's kurtosis of the elements (population)"),
    "excess_kurtosis": ("excess_kurtosis", "Kurtosis minus 3 (0 for a normal distribution)"),
    # the opt-in metrics' values (streamwatch.metrics) and the reduced records' extra
    "cosine": ("cosine_previous", "Cosine similarity to the same tensor at the previous sampled step"),
    "spectral_norm": ("spectral_norm", "Largest singular value of the weight (power iteration)"),
    "condition_number": ("condition_number", "Largest over smallest singular value of the weight"),
    "cca_similarity": (
        "cca_similarity",
        "Mean CCA correlation of the activations with the probe's reference",
    ),
    "update_ratio": ("update_ratio", "Norm of the update over the norm of the weight"),
    STEPPED_WEIGHT_SUMSQ: (
        "stepped_weight_sum_of_squares",
        "Sum of the squared weights that have an update (the update ratio's denominator)",
    ),
}
TENSOR_VALUES = Family(
    "streamwatch_tensor_values",
    "histogram",
    "Values of a tapped tensor in fixed log-spaced buckets (non-finite values excluded: see "
    "streamwatch_tensor_nonfinite_elements)",
    _TENSOR_KEY,
)
LAYER_MEAN = _gauge(
    "layer_mean",
    "Mean over layers of a per-layer statistic, by stat (snapshot() only; /metrics: layer_mean_<stat>)",
    "phase",
    "kind",
    "stat",
)

STEP = _gauge("step", "Index of the last step processed by the worker")

# Where the run's first NaN/Inf started (streamwatch._nonfinite, docs/nonfinite.md).
FIRST_NONFINITE_INFO = _gauge(
    "first_nonfinite_info",
    "1 for the first tensor (in execution order) of the first step with a non-finite value",
    *_TENSOR_KEY,
    "direction",
    "certain",
)
FIRST_NONFINITE_STEP = _gauge("first_nonfinite_step", "The first step with a non-finite value")

# The built-in detectors' families (streamwatch.detectors, docs/detectors.md).
LOSS_ZSCORE = _gauge("loss_zscore", "Robust z-score of the loss against its EWM baseline (LossSpike)")
LOSS_SPIKES = _counter("loss_spikes", "Sampled steps whose loss z-score exceeded the LossSpike threshold")
GRAD_NORM_RATIO = _gauge(
    "grad_norm_ratio",
    "Gradient norm over its EWM baseline per layer, layer __all__ the global norm (GradientSpike)",
    "layer",
)
GRAD_NORM_SPIKES = _counter(
    "grad_norm_spikes", "Sampled steps whose grad norm ratio exceeded the GradientSpike threshold", "layer"
)
LAYER_UPDATE_RATIO = _gauge(
    "layer_update_ratio", "||update|| / ||weight|| over a layer's parameters (UpdateRatioBand)", "layer"
)
UPDATE_RATIO_OUT_OF_BAND = _gauge(
    "update_ratio_out_of_band",
    "Decades a layer's update/weight ratio lies above (+) or below (-) the UpdateRatioBand band, 0 inside",
    "layer",
)
DRIFT_CUSUM = _gauge(
    "drift_cusum", "One-sided CUSUM of every step's log loss or log pre-clip grad norm (Drift)", "series"
)
DRIFT_ALARMS = _counter("drift_alarms", "Times the Drift detector's CUSUM passed its threshold", "series")
DETECTOR_FAMILIES = (
    LOSS_ZSCORE,
    LOSS_SPIKES,
    GRAD_NORM_RATIO,
    GRAD_NORM_SPIKES,
    LAYER_UPDATE_RATIO,
    UPDATE_RATIO_OUT_OF_BAND,
    DRIFT_CUSUM,
    DRIFT_ALARMS,
)

PER_LAYER_FAMILIES = (
    TENSOR,
    TENSOR_VALUES,
    GRAD_NORM_RATIO,
    GRAD_NORM_SPIKES,
    LAYER_UPDATE_RATIO,
    UPDATE_RATIO_OUT_OF_BAND,
)
"""The families with series per layer, which the series budget bounds (``expose(series_budget=...)``,
docs/prometheus.md): every one of their series counts, a histogram's per ``le`` bucket, the
``layer="__all__"`` totals too; ``streamwatch_series`` and ``streamwatch_series_wanted`` count them."""

LOGGED = "log/"
"""The prefix of a record's scalars that ``watch.log()`` recorded (``log/val_loss``)."""

LOGGED_PREFIX = "streamwatch_logged_"
"""The name a value a trainer logged gets (``self.log("val_acc", ...)`` in Lightning, a Hugging Face
Trainer's ``logs``): ``streamwatch_logged_val_acc``, unless :data:`TRAINER_LOGS` names its family
(:func:`logged_sample`)."""

LOGGED_REFUSED = _counter(
    "logged_values_refused",
    "Values a trainer logged that were not served: their names were past the cap on distinct names, or "
    "could not be made a metric name",
)

TRAINER_LOGS: Mapping[str, tuple[str, Mapping[str, str]]] = {
    "loss": ("streamwatch_loss", {"phase": "train"}),
    "eval_loss": ("streamwatch_loss", {"phase": "eval"}),
    "eval_accuracy": ("streamwatch_accuracy", {"phase": "eval"}),
    "learning_rate": ("streamwatch_learning_rate", {"group": "0"}),
    "grad_norm": ("streamwatch_grad_norm", {}),
}
"""Logged names with a family of their own: the Hugging Face Trainer's (its ``logs``: the training loss,
the evaluation loss and accuracy, the first parameter group's learning rate, the gradient norm before
clipping), whichever trainer logged them."""

HISTOGRAM_SAMPLE = "streamwatch_tensor_histogram"
"""The name ``snapshot()`` gives a histogram's bucket counts (label ``bucket``: the index in
``streamwatch.metrics.Buckets`` order); the exporter serves them as :data:`TENSOR_VALUES`."""

DATA_FAMILIES: tuple[Family, ...] = (
    TENSOR,
    LAYER_MEAN,
    _gauge("loss", "The step's loss", "phase"),
    _gauge("accuracy", "Accuracy (ratio): train from the step's outputs, eval from the evaluation", "phase"),
    _gauge("correct", "Correct predictions in the last step", "phase"),
    _gauge("predictions", "Predictions in the last step (the denominator of the train accuracy)", "phase"),
    _gauge("learning_rate", "Learning rate of a parameter group", "group"),
    _gauge("last_step_seconds", "Wall time of the last step (seconds; rate() the step counters instead)"),
    _gauge(
        "last_step_samples_per_second",
        "Training throughput of the last step (samples per second; rate() streamwatch_samples_total instead)",
    ),
    _gauge("batch_size", "Samples in the last step"),
    _gauge("step_phase_seconds", "Host wall time of a part of the last sampled step (seconds)", "part"),
    _gauge("hessian_max_eig", "Largest-magnitude eigenvalue of the loss Hessian"),
    _gauge("grad_norm", "Global gradient norm a trainer logged (grad_norm: before clipping)"),
    LOGGED_REFUSED,
    *DETECTOR_FAMILIES,
    FIRST_NONFINITE_INFO,
    FIRST_NONFINITE_STEP,
    STEP,
    TENSOR_VALUES,
)
"""Families of the run's data, in exposition order: the same live and replayed."""

STEP_DURATION = Family(
    "streamwatch_step_duration_seconds",
    "histogram",
    "Wall time of every step (watch.step() to watch.step()), seconds",
)
"""Every step's wall time, counted on the training thread into the fixed buckets of
:data:`streamwatch._steptimes.STEP_BUCKETS` (a 15 s scrape sees all of the steps, not the last one)."""

SELF_FAMILIES: tuple[Family, ...] = (
    INFO,
    _counter("steps", "Steps seen (watch.step() calls)"),
    _counter("step_seconds", "Wall time of every step seen, summed (seconds)"),
    _counter("samples", "Samples trained on (watch.step(batch_size=...)), summed over every step"),
    STEP_DURATION,
    _counter("steps_sampled", "Steps whose record with layer rows was sent to the worker"),
    _counter("records", "Records the worker turned into step records"),
    _counter("records_dropped", "Records dropped, by reason", "reason"),
    _gauge("queue_length", "Records waiting for the worker"),
    _gauge("queue_high_water", "Most records ever waiting for the worker"),
    _gauge("worker_lag_seconds", "From the step boundary to the worker having processed its record (latest)"),
    _counter("hook_errors", "Exceptions caught inside hooks and metrics"),
    _counter("sink_errors", "Pipelines and sinks stopped by an exception"),
    _counter("tensors_skipped", "Tensors not summarised, by reason", "reason"),
    _gauge(
        "series",
        "Per-layer series exported (the streamwatch_tensor_* statistics and values buckets, the detectors' "
        "per-layer families), after the series budget",
    ),
    _gauge("series_wanted", "Per-layer series before the series budget (as streamwatch_series counts them)"),
    _counter("series_reduced", "Scrapes that reduced series to fit the budget"),
    _gauge(
        "overhead_last_step_seconds",
        "streamwatch's own time on the training thread in the last step (in-process estimate)",
    ),
    _counter(
        "overhead_seconds", "streamwatch's own time on the training thread, all steps (in-process estimate)"
    ),
    _gauge(
        "sampling_interval", "One step in this many is sampled (every=, or the overhead governor's choice)"
    ),
    _gauge(
        "overhead_ratio",
        "Monitoring's measured cost as a fraction of the run's time (overhead governor; absent otherwise)",
    ),
    _counter("sentinel_trips", "Steps whose per-step sentinel found a non-finite loss (or gradient norm)"),
    _counter("escalations", "Times the sentinel escalated sampling to every step (observe(escalate=...))"),
    _gauge("escalated", "1 while sampling is escalated to every step after a sentinel trip, else 0"),
)
"""Families about the serving process: its identity and how its monitoring is doing."""

SERIES_IDENTITY = ("run", "rank")
"""The identity labels every series carries; the rest of :data:`IDENTITY` (``host``, ``local_rank``,
``world_size``) is on ``streamwatch_info`` alone, joined where a query needs it::

    streamwatch_tensor_l2 * on (job, run, rank) group_left (host) streamwatch_info
"""

LAYER_MEAN_PREFIX = "streamwatch_layer_mean_"
TENSOR_PREFIX = "streamwatch_tensor_"


def _tensor_families() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for stat, (suffix, help_text) in _TENSOR_STATS.items():
        out[stat] = Family(f"{TENSOR_PREFIX}{suffix}", "gauge", help_text, _TENSOR_KEY)
    return out


TENSOR_FAMILIES: Mapping[str, Family] = _tensor_families()
"""The family of each known per-tensor statistic (``stat`` of ``snapshot()``) on /metrics."""

LAYER_MEAN_FAMILIES: Mapping[str, Family] = {
    stat: Family(
        f"{LAYER_MEAN_PREFIX}{TENSOR_FAMILIES[stat].name[len(TENSOR_PREFIX) :]}",
        "gauge",
        f"Mean over layers of the per-layer {TENSOR_FAMILIES[stat].name}, per phase and kind",
        ("phase", "kind"),
    )
    for stat in ("mean", "l2", "rms")
}
"""The family of each statistic ``streamwatch_layer_mean`` averages over layers, on /metrics."""

FAMILIES: Mapping[str, Family] = {
    f.name: f
    for f in (*SELF_FAMILIES, *DATA_FAMILIES, *TENSOR_FAMILIES.values(), *LAYER_MEAN_FAMILIES.values())
}
"""Every built-in family by name (the per-statistic families of opt-in metrics with a name of their
own, such as ``norm_p1``, are made by :func:`tensor_family`)."""

_TAKEN = frozenset(
    {HISTOGRAM_SAMPLE}
    | {f.name for f in FAMILIES.values()}
    | {f.exposed for f in FAMILIES.values()}
    | {
        f"{f.name}{s}"
        for f in FAMILIES.values()
        if f.type == "histogram"
        for s in ("_bucket", "_count", "_sum")
    }
)

_SCALARS: Mapping[str, tuple[str, Mapping[str, str]]] = {
    "loss": ("streamwatch_loss", {"phase": "train"}),
    "accuracy": ("streamwatch_accuracy", {"phase": "train"}),
    "correct": ("streamwatch_correct", {"phase": "train"}),
    "total": ("streamwatch_predictions", {"phase": "train"}),  # a gauge: "_total" is for counters
    "eval/loss": ("streamwatch_loss", {"phase": "eval"}),
    "eval/accuracy": ("streamwatch_accuracy", {"phase": "eval"}),
    "step_seconds": ("streamwatch_last_step_seconds", {}),
    "samples_per_second": ("streamwatch_last_step_samples_per_second", {}),
    "batch_size": ("streamwatch_batch_size", {}),
    "hessian_max_eig": ("streamwatch_hessian_max_eig", {}),
}
_PREFIXED = {
    "part/": ("streamwatch_step_phase_seconds", "part"),
    "lr/": ("streamwatch_learning_rate", "group"),
}


def scalar_sample(name: str, value: float) -> Sample | None:
    """The sample of a record's step-level value ``name`` (``StepRecord.scalars``).

    Example:
        >>> scalar_sample("part/forward", 0.5)
        Sample(name='streamwatch_step_phase_seconds', labels={'part': 'forward'}, value=0.5)
        >>> scalar_sample("eval/accuracy", 0.75).labels
        {'phase': 'eval'}
        >>> scalar_sample("log/val/acc", 0.5).name  # watch.log(): the scalars' log/ names
        'streamwatch_logged_val_acc'

    None for a ``log/`` name that cannot be served (``watch.log()`` refuses those).
    """
    known = _SCALARS.get(name)
    if known is not None:
        return Sample(known[0], dict(known[1]), value)
    if name.startswith(LOGGED):  # watch.log(): a trainer's well-known name, else streamwatch_logged_<name>
        return logged_sample(name[len(LOGGED) :], value)
    for prefix, (family, label) in _PREFIXED.items():
        if name.startswith(prefix):
            return Sample(family, {label: name[len(prefix) :]}, value)
    if name.startswith("eval/"):
        return Sample(f"streamwatch_{name[5:]}", {"phase": "eval"}, value)
    return Sample(f"streamwatch_{name}", {}, value)


def logged_sample(name: str, value: float) -> Sample | None:
    """The sample of a value a trainer logged as ``name``: its family in :data:`TRAINER_LOGS`, else
    ``streamwatch_logged_<name>`` with every run of characters other than letters, digits and ``_``
    made one ``_`` (``val/acc`` → ``streamwatch_logged_val_acc``); None for a name that cannot be made a
    metric name (nothing left, or an ending promtool refuses on a gauge: ``_total``, ``_count``,
    ``_sum``, ``_bucket``), or a built-in family's.

    Example:
        >>> logged_sample("eval_loss", 0.5)
        Sample(name='streamwatch_loss', labels={'phase': 'eval'}, value=0.5)
        >>> logged_sample("val/acc", 0.75).name, logged_sample("tokens_total", 8.0), logged_sample("//", 1.0)
        ('streamwatch_logged_val_acc', None, None)
    """
    known = TRAINER_LOGS.get(name)
    if known is not None:
        return Sample(known[0], dict(known[1]), value)
    body = re.sub(r"[^a-zA-Z0-9_]+", "_", name).strip("_")
    full = f"{LOGGED_PREFIX}{body}"
    if not body or body.endswith(_SAMPLE_SUFFIXES) or full in _TAKEN:
        return None
    return Sample(full, {}, value)


@functools.lru_cache(maxsize=1024)
def tensor_family(stat: str) -> Family:
    """The family ``/metrics`` serves the per-tensor statistic ``stat`` in (``snapshot()``'s
    ``streamwatch_tensor{stat=...}``): :data:`TENSOR_FAMILIES`, else ``streamwatch_tensor_<stat>``
    with every run of characters other than letters, digits and ``_`` made one ``_`` (an opt-in
    metric's name, ``norm_p0.5`` → ``streamwatch_tensor_norm_p0_5``), ``_value`` appended where that
    would end like a counter's or histogram's samples or be a built-in family's name.

    Example:
        >>> tensor_family("dead_fraction").name, tensor_family("sumsq").name
        ('streamwatch_tensor_dead_ratio', 'streamwatch_tensor_sum_of_squares')
        >>> tensor_family("norm_p0.5").name, tensor_family("values").name
        ('streamwatch_tensor_norm_p0_5', 'streamwatch_tensor_values_value')
    """
    known = TENSOR_FAMILIES.get(stat)
    if known is not None:
        return known
    body = re.sub(r"[^a-zA-Z0-9_]+", "_", stat).strip("_") or "unnamed"
    name = f"{TENSOR_PREFIX}{body}"
    if body.endswith(_SAMPLE_SUFFIXES) or name in _TAKEN:
        name = f"{name}_value"
    if body.startswith("norm_p"):
        help_text = f"L{stat[6:]} norm of the tensor (metrics.Norm)"
    else:
        help_text = f"{stat} of the tensor (an opt-in metric)"
    return Family(name, "gauge", help_text, _TENSOR_KEY)


def exposed_sample(sample: Sample) -> Sample:
    """``sample`` (of ``watch.snapshot()``) as ``/metrics`` serves it: a per-tensor statistic or a mean
    over layers in the family of its ``stat`` (:func:`tensor_family`, :data:`LAYER_MEAN_FAMILIES`),
    without the ``stat`` label; any other sample as it is.

    Example:
        >>> exposed_sample(Sample("streamwatch_tensor", {"layer": "fc", "stat": "l2"}, 2.0))
        Sample(name='streamwatch_tensor_l2', labels={'layer': 'fc'}, value=2.0)
        >>> exposed_sample(Sample("streamwatch_layer_mean", {"kind": "param", "stat": "rms"}, 1.0)).name
        'streamwatch_layer_mean_rms'
    """
    if sample.name == TENSOR.name or sample.name == LAYER_MEAN.name:
        labels = dict(sample.labels)
        stat = labels.pop("stat")
        if sample.name == TENSOR.name:
            family = tensor_family(stat)
        else:
            family = LAYER_MEAN_FAMILIES.get(stat) or Family(f"{LAYER_MEAN_PREFIX}{stat}", "gauge", "")
        return Sample(family.name, labels, sample.value)
    return sample


def served_family(name: str) -> Family:
    """The family of the sample ``name``: a built-in one, or a user's gauge (``watch.serve()``).

    Example:
        >>> served_family("streamwatch_tenfold").help
        'streamwatch_tenfold (served by a streamwatch pipeline)'
    """
    family = FAMILIES.get(name)
    if family is not None:
        return family
    if name.startswith(LOGGED_PREFIX):
        return Family(name, "gauge", f"The latest value the trainer logged as {name[len(LOGGED_PREFIX) :]}")
    return Family(name, "gauge", f"{name} (served by a streamwatch pipeline)")


def check_served(name: object, labels: object) -> tuple[str, dict[str, str]]:
    """``watch.serve(name, labels)``'s arguments: the family name ``streamwatch_<name>`` and the labels,
    or a ``ValueError``/``TypeError`` naming the clash.

    Refused: names that are not Prometheus metric names, that end like a counter's or a histogram's
    samples (``_total``, ``_count``, ``_sum``, ``_bucket``), or that are a built-in family's; label
    keys or values that are not strings, label names that are not Prometheus label names, start with
    ``__`` or are reserved (:data:`RESERVED_LABELS`).

    Example:
        >>> check_served("tenfold", {"model": "a"})
        ('streamwatch_tenfold', {'model': 'a'})
        >>> check_served("queue_length", None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected `name` not to be a built-in family's, got 'queue_length': ... pick another name
    """
    if not isinstance(name, str):
        raise TypeError(f"Expected `name` to be a str (a metric name of letters, digits and _), got {name!r}")
    full = f"streamwatch_{name}"
    if not name or not _NAME.fullmatch(full) or ":" in name:
        raise ValueError(f"Expected `name` to be a metric name of letters, digits and _, got {name!r}")
    if name.endswith(_SAMPLE_SUFFIXES):
        raise ValueError(
            f"Expected `name` not to end in {', '.join(_SAMPLE_SUFFIXES)} (the suffixes of counter and "
            f"histogram samples; promtool rejects a gauge named so), got {name!r}"
        )
    if full in _TAKEN:
        raise ValueError(
            f"Expected `name` not to be a built-in family's, got {name!r}: {full} is served by streamwatch "
            "itself; pick another name"
        )
    if full.startswith((TENSOR_PREFIX, LAYER_MEAN_PREFIX)):
        raise ValueError(
            f"Expected `name` not to start with tensor_ or layer_mean_ (the per-statistic families of "
            f"tapped tensors), got {name!r}; pick another name"
        )
    if labels is None:
        return full, {}
    if not isinstance(labels, Mapping):
        raise TypeError(f"Expected `labels` to be a mapping of str to str (or None), got {labels!r}")
    checked: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"Expected `labels` to map str to str, got {key!r}: {value!r}")
        if not _LABEL.fullmatch(key) or key.startswith("__"):
            raise ValueError(
                f"Expected `labels` to have Prometheus label names (letters, digits and _, not starting "
                f"with __), got {key!r}"
            )
        if key in RESERVED_LABELS:
            raise ValueError(
                f"Expected `labels` not to use the reserved label {key!r}: streamwatch sets "
                f"{', '.join(IDENTITY)} on every series, and le/quantile belong to histograms and summaries"
            )
        checked[key] = value
    return full, checked
