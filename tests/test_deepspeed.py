"""DeepSpeed ZeRO (stages 1–3) on its CPU accelerator: real ``deepspeed.initialize`` runs, not fakes.

* ``torchrun`` jobs of two ranks on gloo (``tests/scripts/deepspeed_train.py``): each rank's
  ``param``, ``param_grad`` and ``update`` rows are its fragments of the optimizer's float32 partitions,
  and over the ranks they add up to the whole parameters DeepSpeed's own full-tensor accessors give
  (element counts exactly — stage 3's padding left out — sums and sums of squares to float32 rounding);
  streamwatch issues no collective of its own (each rank reads what it holds).
* A Hugging Face ``Trainer`` with ``deepspeed=`` (``tests/scripts/deepspeed_trainer.py``), which crashed in
  ``on_train_begin`` before (the callback refused Accelerate's ``DeepSpeedOptimizerWrapper``): every kind is
  recorded, the gradient norm of the ``param_grad`` rows is the one the Trainer logs, and the losses and
  norms it logs and its final weights (bit for bit) are those of the same run without the callback.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import streamwatch as sw
from tests.promserver import free_port
from tests.torchrun import ROOT, environment, run

SCRIPTS = Path(__file__).parent / "scripts"
KINDS = ("param", "param_grad", "update")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_ranks_fragments_add_up_to_the_whole_parameters(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("deepspeed")
    run(SCRIPTS / "deepspeed_train.py", 2, "--stage", str(stage), "--out", str(tmp_path), timeout=200)
    rows = [json.loads((tmp_path / f"rows-{rank}.json").read_text()) for rank in (0, 1)]
    reference = json.loads((tmp_path / "ref-0.json").read_text())
    assert reference == json.loads((tmp_path / "ref-1.json").read_text())  # (whole tensors: every rank's)
    assert [r["hook_errors"] for r in rows] == [0, 0]
    for k, whole in enumerate(reference):
        assert {name.split("/")[0] for name in whole} == set(KINDS)
        for name, want in whole.items():
            shares = [r["rows"][k].get(name) for r in rows]
            assert any(shares), f"step {k}: no rank has a row {name}"
            got = {c: sum(share[c] for share in shares if share) for c in ("count", "sum", "sumsq")}
            assert got["count"] == want["count"], (k, name, shares)
            assert math.isclose(got["sumsq"], want["sumsq"], rel_tol=1e-5, abs_tol=1e-12), (k, name)
            assert math.isclose(got["sum"], want["sum"], rel_tol=1e-4, abs_tol=1e-6), (k, name)
    if stage < 3:  # (rank 0's partition holds only the first weight's first rows: the rest are empty)
        assert rows[0]["skipped"].get("empty", 0) > 0
        assert all(share for share in rows[1]["rows"][0].values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_trainer_with_deepspeed_is_observed_with_every_kind(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("deepspeed")
    runs = {}
    for mode in ("plain", "watched"):
        out = tmp_path / f"{mode}.json"
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "deepspeed_trainer.py"), str(stage), str(out), mode],
            env={**environment(), "MASTER_PORT": str(free_port())},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=200,
            check=False,
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        runs[mode] = json.loads(out.read_text())
    assert runs["watched"]["trained"] == runs["plain"]["trained"]  # (losses, norms: training unchanged)
    assert runs["watched"]["weights"] == runs["plain"]["weights"]  # (bit for bit)
    assert len(runs["plain"]["weights"]) == 4
    result = runs["watched"]
    assert result["deepspeed"] is True
    assert len(result["norms"]) == len(result["logged"]) == 4
    for ours, logged in zip(result["norms"], result["logged"], strict=True):
        assert math.isclose(ours, logged, rel_tol=1e-5)
    layers = {f"{kind}/net.{i}/" for kind in ("activation", "output_grad") for i in (0, 1, 2)}
    params = {f"{kind}/net.{i}/{name}" for kind in KINDS for i in (0, 2) for name in ("weight", "bias")}
    assert result["kinds"] == [sorted(layers | params)] * 4
    assert result["skipped"] == {}


def test_a_zero_optimizer_this_version_cannot_read_is_warned_about_not_refused() -> None:
    """A DeepSpeed release whose ZeRO optimizer lacks what ``_zero`` reads: ``observe()`` warns, names the
    missing attribute, and reads the parameters as the model holds them; training goes on."""

    class Unknown:  # what a ZeRO optimizer has, without its groups of parameters
        __module__ = "deepspeed.runtime.zero.future"

        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner
            self.single_partition_of_fp32_groups: list[torch.Tensor] = []

    model = torch.nn.Linear(3, 2)
    zero = Unknown(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(RuntimeWarning, match="has no attribute .bf16_groups"):
        watch = sw.observe(model, zero, every=1)
    with watch:
        loss = model(torch.ones(4, 3)).sum()
        loss.backward()
        zero.optimizer.step()
        watch.step(loss=loss)
        assert watch.flush()
    kinds = {s.labels.get("kind") for s in watch.snapshot()}
    assert {"param", "param_grad", "update"} <= kinds
