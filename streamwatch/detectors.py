"""Detectors: built-in pipelines that catch the first bad value of a run, served as metrics.

Each detector is a frozen description (like an operator) that opens into its own pipeline over the
:class:`streamwatch.StepRecord`\\ s the worker receives — ``source | map(extract) | filter | scan(fold) |
publish`` — and publishes its values into a :class:`streamwatch.SeriesStore` (the store makes them from
the latest state when it is read), so ``watch.snapshot()`` and ``/metrics`` serve them with everything
else. They run on the worker thread, read
records only (numpy, no torch), and never touch the model, the optimizer or the training thread.

* :class:`LossSpike` — the loss's robust z-score against an exponentially weighted baseline of its recent
  history: ``streamwatch_loss_zscore``, and ``streamwatch_loss_spikes_total`` counting the sampled steps
  above ``threshold`` (6).
* :class:`GradientSpike` — the global and every layer's gradient norm over its exponentially weighted
  mean: ``streamwatch_grad_norm_ratio{layer}`` (``layer="__all__"``: the global norm), and
  ``streamwatch_grad_norm_spikes_total{layer}`` counting the sampled steps above ``threshold`` (10).
* :class:`UpdateRatioBand` — every layer's update/weight ratio ‖Δw‖/‖w‖ against a band (1e-5 to 1e-1
  around the classic ~1e-3): ``streamwatch_layer_update_ratio{layer}`` and
  ``streamwatch_update_ratio_out_of_band{layer}`` (decades above, +, or below, −, the band; 0 inside).
* :class:`Drift` (opt-in) — a one-sided CUSUM of every step's log loss and log gradient norm before
  clipping, for the slow climbs a spike detector follows: ``streamwatch_drift_cusum{series}`` and
  ``streamwatch_drift_alarms_total{series}``.

``streamwatch.observe()`` runs :data:`DEFAULT_DETECTORS` on its worker (before the series store, so
``watch.flush()`` waits for their values); ``observe(detectors=[...])`` chooses and configures them,
``detectors=()`` turns them off, and :func:`attach` adds detectors to a running watch. ``streamwatch
replay`` runs the defaults on the replayed records.

The formulas, the defaults and why, and the alert rules on these series: docs/detectors.md.

A record without the value a detector reads (no loss, no gradient rows: steps that sampled other kinds)
is skipped — never read as zero — and so is a non-finite value (NaN/Inf: the ``StreamwatchNonFiniteValues``
alert's business, which rides out mixed-precision overflow steps; a detector's baseline stays finite).
A detector that raises stops only its own pipeline; the worker counts it
(``watch.statistics().pipeline_failures``, ``streamwatch_sink_errors_total``) and reports it like any
pipeline failure (a warning at the next ``watch.step()``, a :class:`streamwatch.PipelineError` at close).

Example:
    >>> import streamwatch as sw
    >>> from streamwatch import detectors
    >>> from streamwatch.testing import table
    >>> store = sw.SeriesStore(metrics=())
    >>> pipeline = detectors.LossSpike(warmup=4).pipeline(store)
    >>> for step, loss in enumerate([1.0, 1.2, 0.8, 1.1, 0.9, 5.0]):
    ...     pipeline.push(sw.StepRecord(step, 0.0, 0, (), table(0), {"loss": loss}))
    >>> {s.name: round(s.value, 2) for s in store.samples() if s.name != "streamwatch_step"}
    {'streamwatch_loss_spikes': 1.0, 'streamwatch_loss_zscore': 17.61}
"""

from streamwatch._detectors import (
    DEFAULT_DETECTORS,
    Detector,
    GradientSpike,
    LossSpike,
    UpdateRatioBand,
    attach,
    pipelines,
)
from streamwatch._drift import Drift

__all__ = [
    "DEFAULT_DETECTORS",
    "Detector",
    "Drift",
    "GradientSpike",
    "LossSpike",
    "UpdateRatioBand",
    "attach",
    "pipelines",
]
