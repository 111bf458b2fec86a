"""The metric catalogue beyond the per-tensor summaries: worker-side metrics derived from step records,
and opt-in metrics that read tensors (or run the model) on the steps they sample.

Pass them to :func:`streamwatch.observe`::

    watch = sw.observe(model, opt, metrics=[*sw.DEFAULT_METRICS,
                                            sw.metrics.SpectralNorm(every=10),
                                            sw.metrics.Histogram(kinds=("param_grad",), every=50)])

Every value they compute is served by ``watch.snapshot()`` (and ``/metrics``) as a ``stat`` of the series
it belongs to; docs/metrics.md lists them all with their cost.
"""

from streamwatch.metrics._base import Metric
from streamwatch.metrics._derived import layer_mean, update_ratio
from streamwatch.metrics._histogram import Buckets, histogram
from streamwatch.metrics._optstate import OptimizerState
from streamwatch.metrics._probe import ActivationSimilarity, HessianMaxEig, TestAccuracy
from streamwatch.metrics._tensor import ConditionNumber, GradientCosine, Histogram, PNorm, SpectralNorm

__all__ = [
    "ActivationSimilarity",
    "Buckets",
    "ConditionNumber",
    "GradientCosine",
    "HessianMaxEig",
    "Histogram",
    "Metric",
    "OptimizerState",
    "PNorm",
    "SpectralNorm",
    "TestAccuracy",
    "histogram",
    "layer_mean",
    "update_ratio",
]

_MOVED = {
    "Binding": ("streamwatch.metrics._base", "what an opt-in metric is bound to by observe()"),
    "DERIVED": ("streamwatch.metrics._derived", "the registry of worker-side metric names"),
}


def __getattr__(name: str) -> object:
    """Names that left the public namespace (internals): still importable, with a ``DeprecationWarning``
    saying where they live now (removed in a later release)."""
    from streamwatch._deprecated import moved_name

    return moved_name(__name__, _MOVED, name)
