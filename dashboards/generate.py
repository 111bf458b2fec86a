"""Generate streamwatch's Grafana dashboards with grafana-foundation-sdk (pinned to 0.0.21).

``python dashboards/generate.py`` writes one JSON file per dashboard next to this script, and the
Kubernetes bundle (``kubernetes/``: PodMonitor, PrometheusRule, dashboard ConfigMaps; ``k8s_bundle.py``);
``python dashboards/generate.py --check`` writes nothing and exits 1, naming every file whose committed
content differs from what this script generates (a drift check for CI and for ``tests/test_dashboards.py``).

Conventions every panel follows (``tests/test_dashboards.py`` lints them):

* a unit on every panel, ``{{rank}}`` in every legend unless the query aggregates across ranks on purpose;
* every query selects ``job=~"$job"`` and ``run=~"$run"`` (and ``rank=~"$rank"`` where it is per rank);
* every ``rate``/``increase`` window is ``$__rate_interval``;
* the variables chain ``job`` → ``run`` → ``rank`` → ``layer``, all fed from ``streamwatch_info`` except
  ``layer``: the ``$worst`` layers of the selected ranks (a top-k query, :data:`WORST_LAYERS`), so the
  Layers dashboard opens on a few layers, never on every layer of a large model;
* per-layer rows are collapsed (their queries run when opened), the overview lists the firing alerts,
  and every dashboard annotates loss spikes, the first non-finite step and firing alerts;
* fixed UIDs, so links and provisioning survive regeneration.

Minimum Grafana version: :data:`MIN_GRAFANA` (the SDK's dashboard model, ``schemaVersion`` 42).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

with warnings.catch_warnings():
    # The SDK warns on import that the v1 dashboard model is superseded by dashboardv2; v1 is what Grafana
    # file provisioning, the JSON schema and every Grafana 10/11 import expect, so it is the one we use.
    warnings.filterwarnings("ignore", "Prefer using dashboardv2", DeprecationWarning)
    from grafana_foundation_sdk.builders import common as common_builder
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models import dashboard as dash_model
    from grafana_foundation_sdk.models import heatmap as heatmap_model
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = Path(__file__).resolve().parent
TAG = "streamwatch"
DATASOURCE = common.DataSourceRef(type_val="prometheus", uid="${datasource}")

# label selectors: per run (every rank) and per rank
RUN = 'job=~"$job",run=~"$run"'
RANK = f'{RUN},rank=~"$rank"'
RATE = "$__rate_interval"
BY_RANK = "job, run, rank"
MIN_GRAFANA = "12.0"
"""The oldest Grafana the dashboards are written for (grafana-foundation-sdk 0.0.21's model,
``schemaVersion`` 42); stated in dashboards/README.md, not run against a Grafana server here."""
SUMSQ = "streamwatch_tensor_sum_of_squares"
NONFINITE = "streamwatch_tensor_nonfinite_elements"
WORST_LAYERS = (
    f'topk($worst, (max by (layer) ({NONFINITE}{{{RANK},layer!="__all__"}}) > 0) + 1e15'
    f' or max by (layer) (streamwatch_tensor_l2{{{RANK},kind="param_grad",layer!="__all__"}})'
    f' or 0 * max by (layer) (streamwatch_tensor_elements{{{RANK},layer!="__all__"}}))'
)
"""The ``$worst`` worst layers of the selected ranks: layers holding non-finite values first, then the
largest parameter-gradient norm, then the layers without parameters."""


def per_rank_total(metric: str, selector: str) -> str:
    """The sum of ``metric{<selector>}`` over each rank's layers: the rank's ``layer="__all__"`` total
    where it serves one, else the sum of its layers. A rank without per-layer detail serves only totals,
    and a scrape over the series budget serves them beside its worst layers, which a plain sum would
    count twice."""
    series = f"{metric}{{{selector}"
    return f'sum by ({BY_RANK}) ({series},layer="__all__"}}) or sum by ({BY_RANK}) ({series}}})'


GRAD_SUMSQ = per_rank_total(SUMSQ, f'{RANK},kind="param_grad"')
"""Σ sumsq of each rank's parameter gradients (see :func:`per_rank_total`)."""
STEP_MEAN = (
    f"rate(streamwatch_step_duration_seconds_sum{{{RANK}}}[{RATE}])"
    f" / rate(streamwatch_step_duration_seconds_count{{{RANK}}}[{RATE}])"
)
"""Each rank's mean step time over the rate window (every step counted, not the last sampled one)."""
STEP_P90 = (
    f"histogram_quantile(0.9, sum by ({BY_RANK}, le) "
    f"(rate(streamwatch_step_duration_seconds_bucket{{{RANK}}}[{RATE}])))"
)


def _rate(counter: str) -> str:
    """``rate(counter{<rank selector>}[$__rate_interval])``."""
    return f"rate({counter}{{{RANK}}}[{RATE}])"


@dataclass(frozen=True)
class Q:
    """One query of a panel: PromQL and its legend."""

    expr: str
    legend: str
    fmt: PromQueryFormat = PromQueryFormat.TIME_SERIES


def _targets(queries: Sequence[Q]) -> list[prometheus.Dataquery]:
    """Prometheus targets with refIds A, B, C, ..."""
    out = []
    for i, q in enumerate(queries):
        target = (
            prometheus.Dataquery()
            .ref_id(chr(ord("A") + i))
            .expr(q.expr)
            .legend_format(q.legend)
            .range()
            .format(q.fmt)
            .datasource(DATASOURCE)
        )
        out.append(target)
    return out


def ts(
    title: str,
    unit: str,
    queries: Sequence[Q],
    *,
    w: int = 12,
    h: int = 8,
    description: str = "",
    stack: bool = False,
    log: bool = False,
) -> timeseries.Panel:
    """A time-series panel."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .grid_pos(dash_model.GridPos(h=h, w=w))
        .targets(_targets(queries))
        .line_width(1)
        .fill_opacity(10)
        .legend(
            common_builder.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_builder.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if stack:
        panel = panel.stacking(common_builder.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(
            60
        )
    if log:
        panel = panel.scale_distribution(
            common_builder.ScaleDistributionConfig().type(common.ScaleDistribution.LOG).log(10)
        )
    return panel


def single(
    title: str, unit: str, queries: Sequence[Q], *, w: int = 4, h: int = 4, description: str = ""
) -> stat.Panel:
    """A stat panel showing the last value of each series."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .grid_pos(dash_model.GridPos(h=h, w=w))
        .targets(_targets(queries))
        .reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
    )


def alerts_table(title: str, query: Q, *, w: int = 24, h: int = 6, description: str = "") -> table.Panel:
    """A table of the alerts of the selected runs (Prometheus' ``ALERTS`` series), one row each."""
    target = _targets([query])[0].instant().format(PromQueryFormat.TABLE)
    return (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit("none")
        .grid_pos(dash_model.GridPos(h=h, w=w))
        .targets([target])
    )


def heat(
    title: str, unit: str, queries: Sequence[Q], *, w: int = 12, h: int = 9, description: str = ""
) -> heatmap.Panel:
    """A heatmap of pre-bucketed series (one row per series or per ``le`` bucket), nothing calculated."""
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .grid_pos(dash_model.GridPos(h=h, w=w))
        .targets(_targets(queries))
        .calculate(False)
        .color(
            heatmap.HeatmapColorOptions()
            .mode(heatmap_model.HeatmapColorMode.SCHEME)
            .scheme("Spectral")
            .scale(heatmap_model.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
            .reverse(False)
        )
        .y_axis(heatmap.YAxisConfig().unit(unit).axis_placement(common.AxisPlacement.LEFT))
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.AUTO))
        .cell_gap(1)
        .show_value(common.VisibilityMode.AUTO)
        .tooltip(heatmap.HeatmapTooltip().mode(common.TooltipDisplayMode.SINGLE).y_histogram(False))
        .show_legend()
    )


def _variables() -> list[Any]:
    """Datasource, then job → run → rank → worst → layer, each fed from the previous ones."""
    ds_ref = DATASOURCE

    def query_var(name: str, label: str, query: str, *, include_all: bool = True) -> dash.QueryVariable:
        return (
            dash.QueryVariable(name)
            .label(label)
            .datasource(ds_ref)
            .query(query)
            .definition(query)
            .refresh(dash_model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash_model.VariableSort.NATURAL_ASC)
            .multi(True)
            .include_all(include_all)
        )

    worst_layers = f"query_result({WORST_LAYERS})"
    return [
        dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
        query_var("job", "job", "label_values(streamwatch_info, job)"),
        query_var("run", "run", 'label_values(streamwatch_info{job=~"$job"}, run)'),
        query_var("rank", "rank", 'label_values(streamwatch_info{job=~"$job",run=~"$run"}, rank)'),
        dash.CustomVariable("worst")
        .label("worst layers")
        .description("How many layers $layer offers: the worst of the selected ranks, by a top-k query")
        .values("5,10,20,50,1000")
        .current(dash_model.VariableOption(selected=True, text="5", value="5")),
        # the worst layers, worst first (no sort): "All" is these $worst layers, never every layer
        query_var("layer", "layer", worst_layers)
        .regex('/layer="([^"]+)"/')
        .sort(dash_model.VariableSort.DISABLED)
        .current(dash_model.VariableOption(selected=True, text="All", value="$__all"))
        .description(
            "The $worst worst layers: non-finite values first, then the largest parameter-gradient norm"
        ),
    ]


def _annotations() -> list[dash.AnnotationQuery]:
    """Events on every time axis: loss spikes, the first non-finite step, firing alerts."""

    def one(name: str, color: str, expr: str, title: str) -> dash.AnnotationQuery:
        target = prometheus.Dataquery().expr(expr).legend_format(title).range().datasource(DATASOURCE)
        return (
            dash.AnnotationQuery()
            .name(name)
            .datasource(DATASOURCE)
            .enable(True)
            .icon_color(color)
            .target(target)
        )

    return [
        one(
            "Loss spikes",
            "orange",
            f"increase(streamwatch_loss_spikes_total{{{RANK}}}[{RATE}]) > 0",
            "loss spike, rank {{rank}}",
        ),
        one(
            "First non-finite step",
            "red",
            f"streamwatch_first_nonfinite_step{{{RANK}}}",
            "first NaN/Inf at step {{value}}, rank {{rank}}",
        ),
        one(
            "Firing alerts",
            "purple",
            f'ALERTS{{alertstate="firing",{RUN}}}',
            "{{alertname}} rank {{rank}}",
        ),
    ]


def _base(uid: str, title: str, description: str) -> dash.Dashboard:
    """A dashboard with the shared settings, variables, annotations and links to its siblings."""
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(f"{description} Grafana {MIN_GRAFANA} or newer.")
        .tags([TAG])
        .editable()
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .tooltip(dash_model.DashboardCursorSync.CROSSHAIR)
        .variables(_variables())
        .annotations(_annotations())
        .link(
            dash.DashboardLink("streamwatch")
            .type(dash_model.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


# -- the dashboards ---------------------------------------------------------------------------------------


def overview() -> dash.Dashboard:
    """Training overview: loss, accuracy, throughput, step time, global grad norm, non-finite, drops."""
    run_grads = per_rank_total(SUMSQ, f'{RUN},kind="param_grad"')
    grad_norm = f"sqrt(sum by (job, run) ({run_grads}))"
    nonfinite = f"sum by ({BY_RANK}) ({NONFINITE}{{{RANK}}} > bool 0)"
    throughput = f"rate(streamwatch_samples_total{{{RANK}}}[{RATE}])"
    return (
        _base(
            "streamwatch-overview",
            "streamwatch / Training overview",
            "Loss, accuracy, throughput, step time and gradient health of a training run, per rank.",
        )
        .with_row(dash.Row("Now"))
        .with_panel(single("Step", "none", [Q(f"streamwatch_step{{{RANK}}}", "rank {{rank}}")]))
        .with_panel(
            single("Loss (train)", "none", [Q(f'streamwatch_loss{{{RANK},phase="train"}}', "rank {{rank}}")])
        )
        .with_panel(
            single(
                "Accuracy (train)",
                "percentunit",
                [Q(f'streamwatch_accuracy{{{RANK},phase="train"}}', "rank {{rank}}")],
            )
        )
        .with_panel(
            single(
                "Throughput",
                "suffix: samples/s",
                [Q(throughput, "rank {{rank}}")],
                description="Samples per second over the rate window (watch.step(batch_size=...)).",
            )
        )
        .with_panel(
            single(
                "Global grad norm",
                "none",
                [Q(grad_norm, "{{run}}")],
                description="√Σ sumsq of every parameter gradient over all layers and ranks (exact).",
            )
        )
        .with_panel(
            single(
                "Tensors with non-finite values",
                "none",
                [Q(nonfinite, "rank {{rank}}")],
                description="Tapped tensors whose last summary counted NaN or Inf values (0 when healthy).",
            )
        )
        .with_row(dash.Row("Training"))
        .with_panel(
            ts(
                "Loss",
                "none",
                [Q(f"streamwatch_loss{{{RANK}}}", "{{phase}} rank {{rank}}")],
                description="train from watch.step(), eval from metrics.TestAccuracy",
            )
        )
        .with_panel(
            ts("Accuracy", "percentunit", [Q(f"streamwatch_accuracy{{{RANK}}}", "{{phase}} rank {{rank}}")])
        )
        .with_panel(
            ts(
                "Throughput",
                "suffix: samples/s",
                [Q(throughput, "rank {{rank}}")],
                w=8,
                description="rate(streamwatch_samples_total): every step's samples, not the last step's.",
            )
        )
        .with_panel(
            ts(
                "Step time",
                "s",
                [Q(STEP_MEAN, "mean rank {{rank}}"), Q(STEP_P90, "p90 rank {{rank}}")],
                w=8,
                description="Mean and 90th percentile of every step's wall time over the rate window "
                "(streamwatch_step_duration_seconds).",
            )
        )
        .with_panel(
            ts(
                "Steps per second",
                "suffix: steps/s",
                [Q(f"rate(streamwatch_steps_total{{{RANK}}}[{RATE}])", "rank {{rank}}")],
                w=8,
            )
        )
        .with_row(dash.Row("Gradients and health"))
        .with_panel(
            ts(
                "Global gradient norm",
                "none",
                [Q(grad_norm, "{{run}}")],
                w=8,
                log=True,
                description="sqrt(Σ sumsq) over every param_grad of every layer and rank: exact, not a mean.",
            )
        )
        .with_panel(
            ts(
                "Learning rate",
                "none",
                [Q(f"streamwatch_learning_rate{{{RANK}}}", "group {{group}} rank {{rank}}")],
                w=8,
            )
        )
        .with_panel(
            ts(
                "Non-finite events",
                "none",
                [Q(nonfinite, "rank {{rank}}")],
                w=8,
                description="Number of tapped tensors with NaN/Inf in their last summary (0 when healthy).",
            )
        )
        .with_panel(
            ts(
                "Records dropped",
                "suffix: records/s",
                [
                    Q(
                        f"sum by ({BY_RANK}) (rate(streamwatch_records_dropped_total{{{RANK}}}[{RATE}]))",
                        "rank {{rank}}",
                    )
                ],
                w=24,
                h=6,
                description="Step records lost to backpressure (0 when healthy); see the health dashboard.",
            )
        )
        .with_row(dash.Row("Alerts"))
        .with_panel(
            alerts_table(
                "Firing and pending alerts",
                Q(f'ALERTS{{alertstate=~"firing|pending",{RUN}}}', "{{alertname}} rank {{rank}}"),
                description="streamwatch's alerts (dashboards/rules) for the selected runs; each has a "
                "runbook_url in docs/runbooks.md. Empty when healthy.",
            )
        )
    )


def _kind_panel(
    title: str, unit: str, kind: str, stats: Sequence[str], legend: str, **kw: Any
) -> timeseries.Panel:
    """A per-layer panel with one query per statistic (family ``streamwatch_tensor_<stat>``) of one kind
    of tensor."""
    queries = [
        Q(
            f'streamwatch_tensor_{s}{{{RANK},layer=~"$layer",kind="{kind}"}}',
            f"{s} {legend} rank {{{{rank}}}}",
        )
        for s in stats
    ]
    return ts(title, unit, queries, **kw)


def layers() -> dash.Dashboard:
    """Per-layer activations, gradients, weights and updates; a row per selected layer."""
    grad_by_layer = f'sqrt(sum by ({BY_RANK}, layer) ({SUMSQ}{{{RANK},layer=~"$layer",kind="param_grad"}}))'
    per_layer = (
        dash.Row("Layer $layer")
        .repeat("layer")
        .with_panel(
            _kind_panel(
                "Activations $layer", "none", "activation", ("rms", "stddev", "absmax"), "{{phase}}", w=8
            )
        )
        .with_panel(
            _kind_panel(
                "Output gradients $layer", "none", "output_grad", ("l2", "rms"), "{{phase}}", w=8, log=True
            )
        )
        .with_panel(
            _kind_panel(
                "Parameter gradients $layer",
                "none",
                "param_grad",
                ("l2", "absmax"),
                "{{param}}",
                w=8,
                log=True,
            )
        )
        .with_panel(_kind_panel("Weights $layer", "none", "param", ("l2", "rms"), "{{param}}", w=8))
        .with_panel(_kind_panel("Updates $layer", "none", "update", ("l2",), "{{param}}", w=8, log=True))
        .with_panel(
            _kind_panel(
                "Update/weight ratio $layer",
                "none",
                "update",
                ("update_ratio",),
                "{{param}}",
                w=8,
                log=True,
                description="‖Δw‖/‖w‖ of the last step; ~1e-3 is the usual healthy range.",
            )
        )
        .with_panel(
            _kind_panel(
                "Dead units $layer",
                "percentunit",
                "activation",
                ("dead_ratio", "zero_ratio"),
                "{{phase}}",
                w=12,
                description="Share of units that never activated in the last sampled step's batch.",
            )
        )
        .with_panel(
            _kind_panel(
                "Activation rate $layer",
                "percentunit",
                "activation",
                ("activation_ratio",),
                "{{phase}}",
                w=12,
            )
        )
        # collapsed (Row.with_panel() nests the panels, Grafana's format for a collapsed row): a model of
        # hundreds of layers opens at once, and a layer's eight queries run only when its row is opened
        .collapsed(True)
    )
    return (
        _base(
            "streamwatch-layers",
            "streamwatch / Layers",
            "Per-layer statistics of activations, gradients, weights and updates; a collapsed row per layer "
            "of the $worst worst layers.",
        )
        .with_row(dash.Row("All layers"))
        .with_panel(
            heat(
                "Gradient norm by layer",
                "none",
                [Q(grad_by_layer, "{{layer}} rank {{rank}}")],
                description="‖∇‖ of each layer's parameters (√Σ sumsq), one row per layer and rank.",
            )
        )
        .with_panel(
            heat(
                "Parameter-gradient values (histogram)",
                "none",
                [
                    Q(
                        'sum by (le) (streamwatch_tensor_values_bucket{job=~"$job",run=~"$run",'
                        'rank=~"$rank",layer=~"$layer",kind="param_grad"})',
                        "{{le}}",
                        PromQueryFormat.HEATMAP,
                    )
                ],
                description="metrics.Histogram buckets of the last sampled step (opt-in: empty without it), "
                "summed over the selected layers and ranks.",
            )
        )
        .with_panel(
            ts(
                "Mean over layers (rms)",
                "none",
                [Q(f"streamwatch_layer_mean_rms{{{RANK}}}", "{{kind}} rank {{rank}}")],
                w=8,
                log=True,
            )
        )
        .with_panel(
            ts(
                "Dead-unit rate by layer",
                "percentunit",
                [
                    Q(
                        f'streamwatch_tensor_dead_ratio{{{RANK},layer=~"$layer",kind="activation"}}',
                        "{{layer}} rank {{rank}}",
                    )
                ],
                w=8,
            )
        )
        .with_panel(
            ts(
                "Update/weight ratio, worst 5",
                "none",
                [
                    Q(
                        f'topk(5, streamwatch_tensor_update_ratio{{{RANK},layer=~"$layer"}})',
                        "{{layer}}.{{param}} rank {{rank}}",
                    )
                ],
                w=8,
                log=True,
            )
        )
        .with_row(per_layer)
    )


def cluster() -> dash.Dashboard:
    """Per-rank view of a distributed run: stragglers, ranks up, per-rank phase times and non-finite."""
    step = f"({STEP_MEAN})"
    return (
        _base(
            "streamwatch-cluster",
            "streamwatch / Cluster",
            "Ranks of a distributed run side by side: stragglers, missing ranks, phase times.",
        )
        .with_row(dash.Row("Ranks"))
        .with_panel(
            single(
                "Ranks reporting",
                "none",
                [
                    Q(
                        f"count by (job, run, world_size) (streamwatch_info{{{RUN}}})",
                        "{{run}} of {{world_size}}",
                    )
                ],
                w=6,
                description="Processes exporting streamwatch_info, against the world size they report.",
            )
        )
        .with_panel(
            single(
                "Slowest / median step time",
                "none",
                [
                    Q(
                        f"max by (job, run) ({step}) / quantile by (job, run) (0.5, {step})",
                        "{{run}}",
                    )
                ],
                w=6,
                description="1.0 means balanced; above ~1.2 one rank holds the others back.",
            )
        )
        .with_panel(
            single(
                "Slowest rank",
                "s",
                [Q(f"topk by (job, run) (1, {step})", "rank {{rank}}")],
                w=6,
            )
        )
        .with_panel(
            single(
                "Targets up",
                "none",
                [
                    Q(
                        f'up{{job=~"$job"}} * on (job, instance) group_left (run, rank) '
                        f"max by (job, instance, run, rank) (last_over_time(streamwatch_info{{{RANK}}}[1h]))",
                        "rank {{rank}}",
                    )
                ],
                w=6,
                description="Prometheus' up of each rank's endpoint (0: down, kept for an hour after the "
                "rank was last seen).",
            )
        )
        .with_row(dash.Row("Step time"))
        .with_panel(
            ts(
                "Step time per rank",
                "s",
                [Q(STEP_MEAN, "mean rank {{rank}}"), Q(STEP_P90, "p90 rank {{rank}}")],
                description="Mean and 90th percentile of every step's wall time over the rate window.",
            )
        )
        .with_panel(
            ts(
                "Slowest rank vs median",
                "none",
                [Q(f"max by (job, run) ({step}) / quantile by (job, run) (0.5, {step})", "{{run}}")],
                description="max / median of the ranks' mean step time over the rate window.",
            )
        )
        .with_panel(
            ts(
                "Step phases per rank",
                "s",
                [Q(f"streamwatch_step_phase_seconds{{{RANK}}}", "rank {{rank}} {{part}}")],
                w=24,
                h=9,
                stack=True,
                description="Host wall time of data_wait, forward, backward and optimizer in the last "
                "sampled step.",
            )
        )
        .with_row(dash.Row("Health per rank"))
        .with_panel(
            ts(
                "Non-finite tensors per rank",
                "none",
                [
                    Q(
                        f"sum by ({BY_RANK}) ({NONFINITE}{{{RANK}}} > bool 0)",
                        "rank {{rank}}",
                    )
                ],
                w=8,
            )
        )
        .with_panel(
            ts(
                "Gradient norm per rank",
                "none",
                [
                    Q(
                        f"sqrt({GRAD_SUMSQ})",
                        "rank {{rank}}",
                    )
                ],
                w=8,
                log=True,
            )
        )
        .with_panel(
            ts(
                "Loss per rank",
                "none",
                [Q(f'streamwatch_loss{{{RANK},phase="train"}}', "rank {{rank}}")],
                w=8,
            )
        )
    )


def health() -> dash.Dashboard:
    """streamwatch's own health: channel, drops, worker lag, overhead, errors, series."""
    return (
        _base(
            "streamwatch-health",
            "streamwatch / Health",
            "Is streamwatch itself keeping up? Queue, drops, worker lag, overhead, errors, series budget.",
        )
        .with_row(dash.Row("Channel and worker"))
        .with_panel(
            ts(
                "Queue length",
                "suffix: records",
                [
                    Q(f"streamwatch_queue_length{{{RANK}}}", "length rank {{rank}}"),
                    Q(f"streamwatch_queue_high_water{{{RANK}}}", "high water rank {{rank}}"),
                ],
                w=8,
            )
        )
        .with_panel(
            ts(
                "Records dropped by reason",
                "suffix: records/s",
                [
                    Q(
                        f"sum by ({BY_RANK}, reason) ({_rate('streamwatch_records_dropped_total')})",
                        "{{reason}} rank {{rank}}",
                    )
                ],
                w=8,
            )
        )
        .with_panel(
            ts(
                "Worker lag",
                "s",
                [Q(f"streamwatch_worker_lag_seconds{{{RANK}}}", "rank {{rank}}")],
                w=8,
                description="From a step boundary to the worker having processed its record.",
            )
        )
        .with_panel(
            ts(
                "Steps, samples, records",
                "suffix: /s",
                [
                    Q(f"rate(streamwatch_steps_total{{{RANK}}}[{RATE}])", "steps rank {{rank}}"),
                    Q(f"rate(streamwatch_steps_sampled_total{{{RANK}}}[{RATE}])", "sampled rank {{rank}}"),
                    Q(f"rate(streamwatch_records_total{{{RANK}}}[{RATE}])", "processed rank {{rank}}"),
                ],
                w=24,
                h=7,
            )
        )
        .with_row(dash.Row("Overhead"))
        .with_panel(
            ts(
                "Overhead per step",
                "percentunit",
                [
                    Q(
                        f"rate(streamwatch_overhead_seconds_total{{{RANK}}}[{RATE}])"
                        f" / rate(streamwatch_step_seconds_total{{{RANK}}}[{RATE}])",
                        "rank {{rank}}",
                    )
                ],
                description="streamwatch's time on the training thread / the steps' wall time, every step "
                "of the rate window.",
            )
        )
        .with_panel(
            ts(
                "Overhead, averaged",
                "percentunit",
                [Q(f"rate(streamwatch_overhead_seconds_total{{{RANK}}}[{RATE}])", "rank {{rank}}")],
                description="Seconds of streamwatch per second of wall time.",
            )
        )
        .with_panel(
            ts(
                "Sampling interval",
                "suffix: steps",
                [Q(f"streamwatch_sampling_interval{{{RANK}}}", "rank {{rank}}")],
                description="One step in this many is sampled: every= fixes it; with observe(overhead=...) "
                "the overhead governor chooses it from what sampling measurably costs.",
            )
        )
        .with_panel(
            ts(
                "Measured overhead (governor)",
                "percentunit",
                [Q(f"streamwatch_overhead_ratio{{{RANK}}}", "rank {{rank}}")],
                description="What monitoring costs as a fraction of the run's time, measured end to end by "
                "the overhead governor (observe(overhead=...) only; no series with a fixed every=). At or "
                "under the budget unless a ceiling (1000 steps, 60 s) forces more sampling.",
            )
        )
        .with_row(dash.Row("Errors and series"))
        .with_panel(
            ts(
                "Hook and sink errors",
                "none",
                [
                    Q(f"increase(streamwatch_hook_errors_total{{{RANK}}}[{RATE}])", "hook rank {{rank}}"),
                    Q(f"increase(streamwatch_sink_errors_total{{{RANK}}}[{RATE}])", "sink rank {{rank}}"),
                ],
                w=8,
            )
        )
        .with_panel(
            ts(
                "Tensors skipped by reason",
                "suffix: tensors/s",
                [
                    Q(
                        f"sum by ({BY_RANK}, reason) ({_rate('streamwatch_tensors_skipped_total')})",
                        "{{reason}} rank {{rank}}",
                    )
                ],
                w=8,
                description="Tensors not summarised (non-tensor, complex, sparse, empty, ...); "
                "no series until the first skip.",
            )
        )
        .with_panel(
            ts(
                "Series exported",
                "none",
                [
                    Q(f"streamwatch_series{{{RANK}}}", "exported rank {{rank}}"),
                    Q(f"streamwatch_series_wanted{{{RANK}}}", "wanted rank {{rank}}"),
                ],
                w=8,
                description="Per-layer series (streamwatch_tensor_*, histogram buckets, the detectors' "
                "per-layer families) per process: served, and wanted before the series budget "
                "(expose(series_budget=...)).",
            )
        )
    )


DASHBOARDS = {
    "streamwatch-overview.json": overview,
    "streamwatch-layers.json": layers,
    "streamwatch-cluster.json": cluster,
    "streamwatch-health.json": health,
}


def _flatten_rows(model: dict[str, Any]) -> dict[str, Any]:
    """Lay out expanded rows as Grafana stores them (panels after the row, ``row.panels`` empty); collapsed
    rows keep their panels nested (Grafana's format for them); number ids.

    The SDK nests a row's panels inside the row, which is Grafana's format for *collapsed* rows only: Grafana
    strips the nested panels of an expanded row. ``Row.with_panel`` therefore forces ``collapsed=True``; rows
    reset to ``collapsed(False)`` are flattened here. Panel ids are assigned in order (the SDK sets none).
    """
    flat: list[dict[str, Any]] = []
    for panel in model.get("panels", []):
        flat.append(panel)
        if panel.get("type") == "row" and not panel.get("collapsed", False):
            flat.extend(panel.get("panels", []))
            panel["panels"] = []
    ids = iter(range(1, 10_000))
    for panel in flat:
        panel["id"] = next(ids)
        for nested in panel.get("panels", []):  # a collapsed row's panels
            nested["id"] = next(ids)
    model["panels"] = flat
    return model


def build(name: str) -> dict[str, Any]:
    """The JSON model (a dict) of one dashboard, by file name."""
    model = json.loads(json.dumps(DASHBOARDS[name]().build(), cls=JSONEncoder))
    return _flatten_rows(model)


def _k8s_bundle() -> ModuleType:
    """``dashboards/k8s_bundle.py`` (a sibling file, not a package)."""
    spec = importlib.util.spec_from_file_location("streamwatch_k8s_bundle", HERE / "k8s_bundle.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render() -> dict[str, str]:
    """Every generated file's path (relative to ``dashboards/``) → its text, exactly as committed: the
    dashboards' JSON, and the Kubernetes bundle made from them and the rules (``k8s_bundle.py``)."""
    out = {
        name: json.dumps(build(name), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        for name in DASHBOARDS
    }
    rules = (HERE / "rules" / "streamwatch.rules.yml").read_text(encoding="utf-8")
    bundle: dict[str, str] = _k8s_bundle().bundle(dict(out), rules)
    return {**out, **bundle}


def check(directory: Path = HERE) -> list[str]:
    """File names whose committed content differs from the generated one (missing files included)."""
    stale = []
    for name, text in render().items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    """Write the dashboards, or with ``--check`` report the ones that drifted (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        for name in stale:
            print(f"dashboards/{name} differs from what dashboards/generate.py generates", file=sys.stderr)
        if stale:
            print(
                "run `make dashboards` (python dashboards/generate.py) and commit the result", file=sys.stderr
            )
            return 1
        return 0
    for name, text in render().items():
        (HERE / name).parent.mkdir(parents=True, exist_ok=True)
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"wrote dashboards/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
