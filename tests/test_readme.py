"""README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


def test_readme_examples_run_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {}
    for block in BLOCKS:
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    expected = "ChannelStatistics(capacity=64, len=0, reserved=0, sent=1000, received=1000, dropped_oldest=0"
    assert expected in printed
    assert "100 smoothed values" in printed
    assert "50 records; 0 dropped" in printed
    # the metric catalogue's examples: every opt-in metric produced a value, the served z-score exists
    assert (
        "['cca_similarity', 'condition_number', 'cosine', 'norm_p1', 'spectral_norm', 'update_ratio']"
        in printed
    )
    assert (
        "['streamwatch_hessian_max_eig', 'streamwatch_layer_mean', 'streamwatch_tensor_histogram']" in printed
    )
    assert "['streamwatch_grad_zscore']" in printed
