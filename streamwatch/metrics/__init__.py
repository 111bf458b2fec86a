"""The metric catalogue beyond the per-tensor summaries: worker-side metrics derived from step records,
and opt-in metrics that read tensors (or run the model) on the steps they sample.

Pass them to :func:`streamwatch.observe`::

    watch = sw.observe(model, opt, metrics=[*sw.DEFAULT_METRICS,
                                            sw.metrics.SpectralNorm(every=10),
                                            sw.metrics.Histogram(kinds=("param_grad",), every=50)])

Every value they compute is served by ``watch.snapshot()`` (and ``/metrics``) as a ``stat`` of the series
it belongs to; docs/metrics.md lists them all with their cost.
"""

from streamwatch.metrics._base import Binding, Metric
from streamwatch.metrics._derived import DERIVED, layer_mean, update_ratio
from streamwatch.metrics._histogram import Buckets, histogram
from streamwatch.metrics._probe import ActivationSimilarity, HessianMaxEig, TestAccuracy
from streamwatch.metrics._tensor import ConditionNumber, GradientCosine, Histogram, PNorm, SpectralNorm

__all__ = [
    "DERIVED",
    "ActivationSimilarity",
    "Binding",
    "Buckets",
    "ConditionNumber",
    "GradientCosine",
    "HessianMaxEig",
    "Histogram",
    "Metric",
    "PNorm",
    "SpectralNorm",
    "TestAccuracy",
    "histogram",
    "layer_mean",
    "update_ratio",
]
