"""``observe(detail=...)``: which ranks keep per-layer series, the totals every other rank serves, and the
numbers of docs/scale.md.

* the policy: each mode picks the documented ranks; bad values, a callable that returns no bool and
  ``"local_rank0"`` without ``LOCAL_RANK`` are refused before anything is attached; a callable gets
  ``(rank, local_rank, world_size)``;
* the totals (``layer="__all__"``) against plain torch over every layer's tensors, for every kind; NaN
  rows, extremes, histograms and other opt-in values in :func:`reduce_record`; a mixed job's global norm
  is the same from a rank with or without detail;
* a reduced rank's run file replays exactly what the rank served;
* docs/scale.md: the series per rank of each mode for a LLaMA-2-7B-shaped model, the totals at 1 024 ranks,
  the bytes per series and the memory they imply are read from the doc and checked against a real render.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey, StepRecord, testing
from streamwatch._detail import DETAIL_MODES, keeps_detail, reduce_record
from streamwatch._families import ALL_LAYERS, DETECTOR_FAMILIES
from streamwatch._replay import Replay
from streamwatch._summary import COLUMNS, DERIVED
from streamwatch.sinks import RunFile, read_run
from streamwatch.sinks._prometheus import Exporter

DOC = Path(__file__).resolve().parents[1] / "docs" / "scale.md"
KINDS = ("activation", "output_grad", "param", "param_grad", "update")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _mlp() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer, watch: sw.Watch, steps: int = 1) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(loss=loss, batch_size=8)
    assert watch.flush()


def _tensor(watch: sw.Watch) -> dict[tuple[str, str, str, str], float]:
    """``{(layer, kind, param, stat): value}`` of the train-phase streamwatch_tensor samples."""
    return {
        (s.labels["layer"], s.labels["kind"], s.labels["param"], s.labels["stat"]): s.value
        for s in watch.snapshot()
        if s.name == "streamwatch_tensor" and s.labels["phase"] == "train"
    }


# -- the policy ---------------------------------------------------------------------------------------------


def test_each_mode_picks_the_documented_ranks() -> None:
    world, per_node = 16, 8

    def picked(detail: Any) -> list[int]:
        return [
            r for r in range(world) if keeps_detail(detail, rank=r, local_rank=r % per_node, world_size=world)
        ]

    assert DETAIL_MODES == ("all", "rank0", "local_rank0", "none")
    assert picked("all") == list(range(world))
    assert picked("rank0") == [0]
    assert picked("local_rank0") == [0, 8]
    assert picked("none") == []
    assert picked(lambda rank, local_rank, world_size: rank % 4 == world_size % 4) == [0, 4, 8, 12]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("rank_0", ValueError),
        ("", ValueError),
        (3, TypeError),
        (None, TypeError),
        (b"all", TypeError),
        (str, TypeError),
    ],
)
def test_a_bad_policy_is_refused_before_anything_is_attached(bad: object, error: type[Exception]) -> None:
    model, opt = _mlp()
    with pytest.raises(
        error, match=r"Expected `detail` to be one of \('all', 'rank0', 'local_rank0', 'none'\)"
    ):
        sw.observe(model, opt, detail=bad, every=1)  # type: ignore[arg-type]
    assert not model._forward_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    sw.observe(model, opt, every=1).close()  # the model was left unobserved


def test_a_callable_that_cannot_take_the_three_arguments_is_refused_naming_detail() -> None:
    model, opt = _mlp()
    with pytest.raises(
        TypeError, match=r"Expected `detail` to be a callable \(rank, local_rank, world_size\)"
    ):
        sw.observe(model, opt, detail=lambda rank: True, every=1)  # type: ignore[arg-type]
    assert not model._forward_hooks
    sw.observe(model, opt, detail=lambda *position: True, every=1).close()  # (any signature that binds)


def test_a_callable_that_raises_is_reported_naming_detail() -> None:
    # before: its bare ZeroDivisionError came out of observe(), naming nothing of streamwatch's
    model, opt = _mlp()
    with pytest.raises(
        ValueError, match=r"^`detail` \(a callable\) raised ZeroDivisionError for \(rank=0"
    ) as info:
        sw.observe(model, opt, detail=lambda rank, local_rank, world_size: 1 / 0, every=1)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert not model._forward_hooks
    sw.observe(model, opt, every=1).close()  # the model was left unobserved


def test_updates_asked_for_without_an_optimizer_are_warned_about() -> None:
    model, _ = _mlp()
    with pytest.warns(UserWarning, match=r"taps include 'update'.*observe\(model, optimizer"):
        sw.observe(model, taps=("activation", "update"), every=1).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default taps: updates where there is an optimizer, quietly
        sw.observe(model, every=1).close()


def test_a_callable_must_answer_with_a_bool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    model, opt = _mlp()
    with pytest.raises(TypeError, match=r"return a bool for \(rank=5, local_rank=1, world_size=8\), got 1"):
        sw.observe(model, opt, detail=lambda rank, local_rank, world_size: 1, every=1)  # type: ignore[arg-type,return-value]
    seen: list[tuple[int, int, int]] = []

    def policy(rank: int, local_rank: int, world_size: int) -> bool:
        seen.append((rank, local_rank, world_size))
        return False

    with sw.observe(model, opt, detail=policy, every=1) as watch:
        _train(model, opt, watch)
    assert seen == [(5, 1, 8)]  # called once, with torchrun's environment
    assert {layer for layer, *_ in _tensor(watch)} == {ALL_LAYERS}


def test_local_rank0_needs_the_local_rank_and_follows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    model, opt = _mlp()
    with pytest.raises(
        ValueError, match=r"detail='local_rank0' needs the local rank, but \$LOCAL_RANK is not set"
    ):
        sw.observe(model, opt, detail="local_rank0", every=1)
    for local_rank, layers in (("3", {ALL_LAYERS}), ("0", {"0", "1", "2", "3", "4"})):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with sw.observe(model, opt, detail="local_rank0", every=1) as watch:
            _train(model, opt, watch)
        assert {layer for layer, *_ in _tensor(watch)} == layers
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match=r"Expected \$LOCAL_RANK to be an integer"):
        sw.observe(model, opt, detail="local_rank0", every=1)


# -- the totals ---------------------------------------------------------------------------------------------


def test_the_totals_are_torch_over_every_layer() -> None:
    """A rank without detail: one row per kind whose statistics are those of every layer's tensors of that
    kind taken together, computed here with plain torch (float64)."""
    model, opt = _mlp()
    seen: dict[str, list[torch.Tensor]] = {"activation": [], "output_grad": []}

    def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen["activation"].append(out.detach().clone())
        out.register_hook(lambda grad: seen["output_grad"].append(grad.detach().clone()))

    for module in model:
        module.register_forward_hook(keep)
    params = list(model.parameters())
    with sw.observe(model, opt, detail="none", cadence={"param": 1, "update": 1}, every=1) as watch:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        before = [p.detach().clone() for p in params]
        grads = [p.grad.detach().clone() for p in params if p.grad is not None]
        opt.step()
        watch.step(loss=loss, batch_size=8)
        assert watch.flush()
    reference = {
        **seen,
        "param_grad": grads,
        "param": [p.detach() for p in params],
        "update": [p.detach() - b for p, b in zip(params, before, strict=True)],
    }
    got = _tensor(watch)
    assert {(layer, kind, param) for layer, kind, param, _ in got} == {(ALL_LAYERS, k, "") for k in KINDS}
    for kind, tensors in reference.items():
        flat = torch.cat([t.reshape(-1).double() for t in tensors])
        l1 = float(flat.abs().sum())  # float32 sums are exact to ~1e-7 of the sum of magnitudes
        tolerance = {"sum": 1e-6 * l1, "mean": 1e-6 * l1 / flat.numel()}
        want = {
            "count": float(flat.numel()),
            "sum": float(flat.sum()),
            "sumsq": float(flat.pow(2).sum()),
            "min": float(flat.min()),
            "max": float(flat.max()),
            "zeros": float((flat == 0).sum()),
            "nonfinite": 0.0,
            "l2": float(flat.norm()),
            "mean": float(flat.mean()),
            "rms": float(flat.pow(2).mean().sqrt()),
        }
        assert want["sumsq"] > 0
        assert kind != "activation" or want["zeros"] > 0  # ReLU zeros exist
        for stat, value in want.items():
            close = math.isclose(
                got[(ALL_LAYERS, kind, "", stat)], value, rel_tol=1e-6, abs_tol=tolerance.get(stat, 0)
            )
            assert close, (kind, stat, got[(ALL_LAYERS, kind, "", stat)], value)
        # per-unit activity is not computed without detail: no dead units, no activation rate
        assert not {stat for (_, k, _, stat) in got if k == kind} & {
            "dead_fraction",
            "activation_rate",
            "units",
        }
    ratio = got[(ALL_LAYERS, "update", "", "update_ratio")]
    assert math.isclose(
        ratio, math.sqrt(got[(ALL_LAYERS, "update", "", "sumsq")] / got[(ALL_LAYERS, "param", "", "sumsq")])
    )
    names = {s.name for s in watch.snapshot()}
    assert "streamwatch_layer_mean" not in names  # a mean over layers needs layers
    assert {"streamwatch_loss", "streamwatch_last_step_seconds", "streamwatch_step_phase_seconds"} <= names


def test_without_detail_the_update_ratio_is_over_the_stepped_weights_only(tmp_path: Path) -> None:
    """Fine-tuning a head on a frozen body (left in the optimizer's groups, without gradients: no
    update row): the ``__all__`` ratio divided the head's update by every weight, the body's too, and
    read out of band where every layer's was in it."""
    from streamwatch._plot import series

    path = tmp_path / "run.jsonl"
    model, _ = _mlp()
    body = model[0]
    for p in body.parameters():
        p.requires_grad_(False)
        p.data.mul_(30.0)  # a large pretrained body: the dilution is well out of the band
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    observed = sw.observe(
        model, opt, detail="none", cadence={"param": 1, "update": 1}, every=1, sinks=[RunFile(path)]
    )
    with observed as watch:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        stepped = [p for p in model.parameters() if p.requires_grad]  # the layers after the body
        before = [p.detach().clone() for p in stepped]
        opt.step()
        watch.step()
        assert watch.flush()
    after = [p.detach().double() for p in stepped]
    update = sum(float((a - b.double()).pow(2).sum()) for a, b in zip(after, before, strict=True))
    weight = sum(float(a.pow(2).sum()) for a in after)
    diluted = weight + sum(float(p.double().pow(2).sum()) for p in body.parameters())
    ratios = {
        s.name: s.value
        for s in watch.snapshot()
        if s.name in ("streamwatch_layer_update_ratio", "streamwatch_update_ratio_out_of_band")
        and s.labels["layer"] == ALL_LAYERS
    }
    served = [
        s.value
        for s in watch.snapshot()
        if s.name == "streamwatch_tensor"
        and s.labels["layer"] == ALL_LAYERS
        and s.labels["stat"] == "update_ratio"
    ]
    want = pytest.approx((update / weight) ** 0.5, rel=1e-5)
    assert ratios["streamwatch_layer_update_ratio"] == want  # the detector
    assert served == [want]  # the derived metric (the layers dashboard's panel)
    assert series(read_run(path))["update_ratio"] == {ALL_LAYERS: [want]}  # streamwatch plot
    assert (update / diluted) ** 0.5 < 0.1 * (update / weight) ** 0.5  # what it read before
    assert ratios["streamwatch_update_ratio_out_of_band"] == 0.0


def test_the_stepped_weights_stay_served_between_weight_samples_and_are_unknown_when_no_weight_is() -> None:
    """Updates sampled every step, weights one step in 10: a record with update rows and no weight
    rows carried NaN, which replaced the last known value (the series flapped); weights whose sums are all
    unknown gave 0, not unknown."""
    from streamwatch._detail import _stepped_weight_sumsq

    model, opt = _mlp()
    with sw.observe(model, opt, detail="none", cadence={"update": 1, "param": 10}, every=1) as watch:
        for step in range(12):
            _train(model, opt, watch)
            assert watch.flush()
            served = [
                s.value
                for s in watch.snapshot()
                if s.labels.get("layer") == ALL_LAYERS and s.labels.get("stat") == "stepped_weight_sumsq"
            ]
            assert len(served) == 1, step
            assert served[0] > 0
    keys = (SeriesKey("train", "a", "param", "w"), SeriesKey("train", "a", "update", "w"))
    table = testing.table(sumsq=[np.nan, 0.0], fill=0.0)
    stepped = _stepped_weight_sumsq(StepRecord(0, 0.0, 0, keys, table))
    assert stepped is not None
    assert np.isnan(stepped).tolist() == [True]
    assert _stepped_weight_sumsq(StepRecord(0, 0.0, 0, keys[1:], table[1:])) is None
    # a reduced record whose stepped weights' sum is unknown has no ratio (not the all-weights one)
    from streamwatch.metrics._derived import update_ratio

    totals = (SeriesKey("train", ALL_LAYERS, "param", ""), SeriesKey("train", ALL_LAYERS, "update", ""))
    reduced = testing.table(sumsq=[900.0, 4e-6], fill=0.0)
    unknown = {(totals[1], "stepped_weight_sumsq"): np.array([np.nan])}
    assert update_ratio(StepRecord(0, 0.0, 0, totals, reduced, extras=unknown)) == []
    known = {(totals[1], "stepped_weight_sumsq"): np.array([4.0])}
    assert [s.value for s in update_ratio(StepRecord(0, 0.0, 0, totals, reduced, extras=known))] == [
        pytest.approx(1e-3)
    ]


def test_a_mixed_job_gets_the_same_global_norms_from_either_kind_of_rank() -> None:
    """The same training observed with and without detail: the per-layer sums of squares add up to the
    total (what ``sum by (run, rank)`` over a rank's series returns in PromQL, either way)."""
    totals = {}
    for detail in ("all", "none"):
        model, opt = _mlp()
        with sw.observe(model, opt, detail=detail, every=1) as watch:
            _train(model, opt, watch, steps=2)
        sums: dict[str, float] = {}
        for (_, kind, _, stat), value in _tensor(watch).items():
            if stat == "sumsq":
                sums[kind] = sums.get(kind, 0.0) + value
        totals[detail] = sums
    assert totals["all"].keys() == totals["none"].keys() == set(KINDS)
    for kind in KINDS:  # float32 sums: activations are summed in another order with per-unit activity
        assert math.isclose(totals["all"][kind], totals["none"][kind], rel_tol=1e-6), kind


def test_reduce_record_leaves_unknown_values_out_and_adds_histograms() -> None:
    grad = [SeriesKey("train", layer, "param_grad", "weight") for layer in ("a", "b", "c")]
    evals = SeriesKey("eval", "a", "activation", "")
    nan = np.nan
    table = testing.table(  # row 1, a NaN gradient: only its count and flag
        count=[4, 2, 3, 5],
        sum=[2.0, nan, -3.0, 5.0],
        sumsq=[6.0, nan, 9.0, 5.0],
        min=[-1.0, nan, -3.0, 1.0],
        max=[2.0, nan, 0.5, 1.0],
        zeros=[1, nan, 0, 0],
        nonfinite=[0, 1, 0, 0],
        units=[nan, nan, nan, 4],
        dead=[nan, nan, nan, 1],
        samples=[nan, nan, nan, 2],
        active=[nan, nan, nan, 5],
    )
    extras = {
        (grad[0], "histogram"): np.array([0.0, 1.0, 3.0]),
        (grad[2], "histogram"): np.array([1.0, 0.0, 2.0]),
        (grad[0], "spectral_norm"): np.array([2.5]),
    }
    record = StepRecord(
        7, 1.5, 3, (*grad, evals), table, {"loss": 0.25}, extras, {"param_grad": (0.0, math.inf)}
    )
    reduced = reduce_record(record)
    assert reduced.keys == (
        SeriesKey("train", ALL_LAYERS, "param_grad", ""),
        SeriesKey("eval", ALL_LAYERS, "activation", ""),
    )
    assert (reduced.step, reduced.time, reduced.rank, reduced.scalars, reduced.edges) == (
        7,
        1.5,
        3,
        {"loss": 0.25},
        {"param_grad": (0.0, math.inf)},
    )
    row = dict(zip(COLUMNS, reduced.table[0].tolist(), strict=True))
    assert {k: row[k] for k in ("count", "sum", "sumsq", "min", "max", "zeros", "nonfinite")} == {
        "count": 9.0,
        "sum": -1.0,
        "sumsq": 15.0,
        "min": -3.0,
        "max": 2.0,
        "zeros": 1.0,
        "nonfinite": 1.0,
    }
    assert all(math.isnan(row[k]) for k in ("units", "dead", "samples", "active"))  # unknown, not 0
    np.testing.assert_array_equal(reduced.table[1], table[3])  # one row: itself (NaN where unknown)
    assert reduced.stat("activation_rate")[1] == 5 / (2 * 4)
    assert list(reduced.extras) == [(reduced.keys[0], "histogram")]  # per-layer opt-in values dropped
    assert reduced.extras[(reduced.keys[0], "histogram")].tolist() == [1.0, 1.0, 5.0]
    assert not reduced.table.flags.writeable


# -- the run file ------------------------------------------------------------------------------------------


def test_a_reduced_rank_s_run_file_replays_what_it_served(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    model, opt = _mlp()
    with sw.observe(model, opt, detail="none", sinks=[RunFile(path)], every=1) as watch:
        _train(model, opt, watch, steps=3)
    live = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in watch.snapshot()}
    run = read_run(path)
    assert len(run.records) == 3
    assert {key.layer for record in run.records for key in record.keys} == {ALL_LAYERS}
    with Replay(run, port=0, speed=0) as replay:
        assert replay.wait_until_done(timeout=30)
        replayed = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in replay.store.samples()}
    assert replayed == live


# -- docs/scale.md -------------------------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)


class _MLP(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj, self.act_fn = nn.Linear(f, d, bias=False), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attention(d), _MLP(d, f)
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(d), _RMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, blocks: int, d: int, f: int, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d, f) for _ in range(blocks))
        self.norm = _RMSNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama7BShape(nn.Module):
    """LLaMA-2-7B's modules and names (Hugging Face ``LlamaForCausalLM``: 32 blocks) at tiny widths."""

    vocab = 32

    def __init__(self, blocks: int = 32, d: int = 8, f: int = 16) -> None:
        super().__init__()
        self.model = _Decoder(blocks, d, f, self.vocab)
        self.lm_head = nn.Linear(d, self.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def _number(text: str) -> int:
    return int(text.strip().strip("*").replace(",", "").replace(" ", ""))


def _table(doc: str, header: str) -> dict[str, list[str]]:
    """The Markdown table whose header row starts with ``header``: first cell -> the other cells."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0].strip("*")] = cells[1:]
    return rows


def _render(watch: sw.Watch, budget: int) -> dict[str, int]:
    """Series in one scrape of ``watch`` by family name (what Prometheus would hold per rank)."""
    exporter = Exporter(watch.store, watch.statistics, serve=False, run="scale", series_budget=budget)
    try:
        body = exporter.collector.render().decode()
    finally:
        exporter.close()
    counts: dict[str, int] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


_STEP_VALUES = (
    "streamwatch_loss",
    "streamwatch_learning_rate",
    "streamwatch_last_step_seconds",
    "streamwatch_last_step_samples_per_second",
    "streamwatch_batch_size",
    "streamwatch_step_phase_seconds",
    "streamwatch_step",
)


_DETECTOR_VALUES = tuple(family.exposed for family in DETECTOR_FAMILIES)


def _groups(counts: dict[str, int]) -> dict[str, int]:
    """The doc's rows: tensor, layer means, step values, detectors, identity and self metrics, total."""
    # one family per statistic: streamwatch_tensor_<stat> (the histogram's streamwatch_tensor_values aside)
    tensor = sum(
        n
        for name, n in counts.items()
        if name.startswith("streamwatch_tensor_") and not name.startswith("streamwatch_tensor_values_")
    )
    means = sum(n for name, n in counts.items() if name.startswith("streamwatch_layer_mean_"))
    step = sum(counts.get(name, 0) for name in _STEP_VALUES)
    detectors = sum(counts.get(name, 0) for name in _DETECTOR_VALUES)
    total = sum(counts.values())
    return {
        "tensor": tensor,
        "layer_mean": means,
        "step": step,
        "detectors": detectors,
        "self": total - tensor - means - step - detectors,
        "total": total,
    }


def _observed_counts(
    detail: str, caplog: pytest.LogCaptureFixture
) -> tuple[dict[str, int], dict[str, int], sw.Watch]:
    torch.manual_seed(0)
    model = Llama7BShape()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with sw.observe(model, opt, detail=detail, every=1) as watch:  # type: ignore[arg-type]
        for _ in range(2):  # the second step's data wait is the fourth step part
            ids = torch.randint(0, model.vocab, (2, 4))
            loss = nn.functional.cross_entropy(model(ids).reshape(-1, model.vocab), ids.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss, batch_size=2)
        assert watch.flush()
        with caplog.at_level("WARNING", logger="streamwatch"):
            full, budgeted = _render(watch, 10**6), _render(watch, 5000)
    return full, budgeted, watch


def test_docs_scale_numbers_are_what_a_7b_shaped_model_serves(caplog: pytest.LogCaptureFixture) -> None:
    doc = DOC.read_text(encoding="utf-8")
    model = Llama7BShape()
    leaves = sum(1 for m in model.modules() if next(m.children(), None) is None)
    params = len(list(model.parameters()))
    found = re.search(r"\*\*(\d+) leaf modules\*\* and \*\*(\d+) parameter tensors\*\*", doc)
    assert found
    assert (int(found[1]), int(found[2])) == (leaves, params) == (323, 291)

    detail, budgeted, watch = _observed_counts("all", caplog)
    other, other_budgeted, _ = _observed_counts("none", caplog)
    assert other_budgeted == other  # the totals are far under any budget
    per_rank = _table(doc, "| series per rank |")
    rows = {
        "`streamwatch_tensor_*` (one family per statistic)": "tensor",
        "`streamwatch_layer_mean_*`": "layer_mean",
        "step values (loss, learning rate, step time, throughput, batch size, 4 step parts, step)": "step",
        "the detectors (`streamwatch.detectors.DEFAULT_DETECTORS`)": "detectors",
        "`streamwatch_info` and streamwatch's own metrics": "self",
        "total": "total",
    }
    assert set(per_rank) == set(rows)
    for title, group in rows.items():
        assert [_number(cell) for cell in per_rank[title]] == [
            _groups(detail)[group],
            _groups(other)[group],
        ], title

    # the breakdown of the per-layer tensor series, from the rows the store holds
    _, keys = watch.store.table()
    kinds = [key.kind for key in keys]
    breakdown = re.search(
        r"hold (\d+) activation and output-gradient rows × (\d+) statistics \(([\d ]+)\), (\d+) weight, "
        r"gradient and update rows × (\d+) statistics \(([\d ]+)\) less the (\d+) that are unknown and "
        r"absent here \(skewness, kurtosis and excess kurtosis of the (\d+) RMSNorm weights, all ones at "
        r"this step: no spread\) and (\d+) `update_ratio` values",
        " ".join(doc.split()),
    )
    assert breakdown
    forward = sum(kinds.count(k) for k in ("activation", "output_grad"))
    parameters = sum(kinds.count(k) for k in ("param", "param_grad", "update"))
    norms = sum(1 for k in keys if k.kind == "param" and "norm" in k.layer)
    shape = ("skewness", "kurtosis", "excess_kurtosis")
    every = len(COLUMNS) + len(DERIVED)  # per-unit activity: 4 columns and 2 derived statistics
    without_units = every - len(("units", "dead", "samples", "active", "dead_fraction", "activation_rate"))
    numbers = [_number(group) for group in breakdown.groups()]
    assert numbers == [
        forward,
        every,
        forward * every,
        parameters,
        without_units,
        parameters * without_units,
        norms * len(shape),
        norms,
        kinds.count("update"),
    ]
    served = forward * every + parameters * without_units - norms * len(shape) + kinds.count("update")
    assert served == _groups(detail)["tensor"]
    # over the default budget: the totals and the worst layers in core detail (the doc says how many)
    worst = re.search(r"the totals and the (\d+) worst of its (\d+) layers", " ".join(doc.split()))
    assert worst
    assert (
        f'one total per phase and kind (layer="__all__") and the {worst[1]} worst of {worst[2]} layers'
        in (caplog.text)
    )
    assert int(worst[2]) == leaves

    # bytes per series: Robust Perception's constants with our label count, and 15 s scrapes for 3 hours
    # a per-statistic family's: run, rank, phase, layer, kind, param, index; job, instance (host,
    # local_rank and world_size only on streamwatch_info; no stat label); its name as long as the
    # sums of squares'
    labels = 7 + 2
    name = "streamwatch_tensor_sum_of_squares"
    per_series = 2 * (732 + 32 * labels + 2 * len(name)) + (3 * 3600 // 15) * 2 * 1.5 * 2
    stated = re.search(r"Memory per active series: ([\d,]+) bytes", doc)
    assert stated
    assert _number(stated[1]) == per_series == 6492

    at_scale = _table(doc, "| mode | ranks with detail |")
    world, per_node = 1024, 8
    modes = {
        '`"all"`': ("all", _groups(detail)["total"]),
        '`"all"`, default `series_budget=5000`': ("all", _groups(budgeted)["total"]),
        '`"local_rank0"`': ("local_rank0", _groups(detail)["total"]),
        '`"rank0"`': ("rank0", _groups(detail)["total"]),
        '`"none"`': ("none", _groups(detail)["total"]),
    }
    assert set(at_scale) == set(modes)
    assert _groups(budgeted)["total"] == 5065  # the budget's 4 998 per-layer series and 67 others
    for title, (mode, per_detail) in modes.items():
        ranks, per_detail_cell, per_other_cell, active_cell, memory_cell = at_scale[title]
        chosen = sum(
            keeps_detail(mode, rank=r, local_rank=r % per_node, world_size=world) for r in range(world)
        )
        assert _number(ranks) == chosen, title
        want_other = _groups(other)["total"]
        assert (per_detail_cell == "—") == (chosen == 0), title
        assert (per_other_cell == "—") == (chosen == world), title
        if chosen:
            assert _number(per_detail_cell) == per_detail, title
        if chosen < world:
            assert _number(per_other_cell) == want_other, title
        active = chosen * per_detail + (world - chosen) * want_other
        assert _number(active_cell) == active, title
        assert memory_cell == f"{active * per_series / 2**30:.1f} GiB", title
