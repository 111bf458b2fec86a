"""The documentation is true: README's and docs/'s Python examples run as written, links resolve.

* Every ```python block of ``README.md`` and of each ``docs/*.md`` runs: the blocks of one file in order,
  in one shared namespace (a later block may use what an earlier one defined), one test case per file.
  A block that cannot run in the test suite (it needs a GPU, ``torchrun``, a network) is better written
  as a ```text or ```bash block; if it must stay ```python, put the line ``<!-- docs-test: skip -->``
  directly above its opening fence and it is not run.
* Some blocks' printed output is checked too (``EXPECTED``); README's first block is the quickstart that
  ``.ci/smoke.py`` runs in a fresh install, so it must define ``watch``.
* ``README.md`` has at most 200 lines.
* Every relative link in ``README.md``, ``CONTRIBUTING.md`` and ``docs/*.md`` points to a file in the
  repository, and its ``#anchor``, if any, to a heading of that file (GitHub's heading ids).
* The documentation refers to nothing outside the repository, and no file mentions the kernel cache
  directory that streamwatch no longer has.
"""

from __future__ import annotations

import gc
import os
import re
from pathlib import Path

import pytest

import streamwatch as sw

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, ROOT / "CONTRIBUTING.md", *DOCS]
SKIP_MARKER = "<!-- docs-test: skip -->"
README_MAX_LINES = 200

# Printed output that must appear when a file's blocks run (keyed by the path from the repository root).
EXPECTED = {
    "README.md": [
        "50 steps; 0 dropped; budget 0.02",  # the quickstart, under the default governor
        "True True",  # the exporter served the loss on a free port
    ],
    "docs/metrics.md": [
        # every opt-in metric produced a value, and the served z-score exists
        "['cca_similarity', 'condition_number', 'cosine', 'norm_p1', 'spectral_norm', 'update_ratio']",
        "['streamwatch_hessian_max_eig', 'streamwatch_layer_mean', 'streamwatch_tensor_histogram']",
        "['streamwatch_grad_zscore']",
    ],
    "docs/governor.md": [
        # observe(overhead=0.05): the first sampled steps are fixed whatever the timing (calibration)
        "first sampled steps: [0, 3, 6, 9, 12]",
        "weights on the first: True",
        "records with rows = sampled steps: True",
        "budget: 0.05 interval >= 1: True",
    ],
    "docs/nonfinite.md": [
        # the unsampled fault escalated the sampling and its recurrence was recorded with its origin
        "13 2 activation forward True",
        "trips 2 escalations 1 sampled 21",
    ],
    "docs/observe.md": ["lines [['streamwatch'], ['step', '50'], ['step', '100']]"],
    "docs/integrations.md": [
        "served during the fit: True",  # Lightning's self.log value, scraped from inside fit()
        "the last step's loss is the one the Trainer logged: True",
    ],
    "docs/architecture.md": [
        "ChannelStatistics(capacity=64, len=0, reserved=0, sent=1000, received=1000, dropped_oldest=0",
        "100 smoothed values",
    ],
}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")


def fenced_blocks(text: str) -> list[tuple[str, int, str, bool]]:
    """``(language, first code line (0-based), code, skipped)`` for every fenced code block."""
    lines = text.splitlines(keepends=True)
    blocks = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2).lower()
        skipped = i > 0 and lines[i - 1].strip() == SKIP_MARKER
        start = i + 1
        end = start
        while end < len(lines) and not lines[end].lstrip(" ").startswith(fence):
            end += 1
        blocks.append((language, start, "".join(lines[start:end]), skipped))
        i = end + 1
    return blocks


def python_blocks(path: Path) -> list[tuple[int, str]]:
    return [
        (start, code)
        for language, start, code, skipped in fenced_blocks(path.read_text(encoding="utf-8"))
        if language == "python" and not skipped
    ]


def prose(text: str, code_spans: bool = False) -> str:
    """``text`` without its fenced code blocks, and without inline code spans unless ``code_spans``."""
    lines = text.splitlines(keepends=True)
    for _language, start, code, _skipped in fenced_blocks(text):
        for j in range(start - 1, start + code.count("\n") + 1):
            if j < len(lines):
                lines[j] = "\n"
    text = "".join(lines)
    return text if code_spans else re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


WITH_EXAMPLES = [path for path in [README, *DOCS] if python_blocks(path)]


def test_readme_has_examples() -> None:
    assert len(python_blocks(README)) >= 2
    assert set(EXPECTED) <= {relative(path) for path in WITH_EXAMPLES}


@pytest.mark.parametrize("path", WITH_EXAMPLES, ids=relative)
def test_examples_run_in_order(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_example_{path.stem}"}
    for index, (start, code) in enumerate(python_blocks(path)):
        # padded with newlines so that a traceback names the Markdown file's own line numbers
        exec(compile("\n" * start + code, str(path), "exec"), namespace)
        if path == README and index == 0:
            assert isinstance(namespace.get("watch"), sw.Watch), (
                "README's first block (the quickstart) defines `watch`"
            )
    namespace.clear()
    gc.collect()  # an endpoint or server an example left open warns here, in the file's own test case
    printed = capsys.readouterr().out
    for expected in EXPECTED.get(relative(path), []):
        assert expected in printed


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def github_anchors(path: Path) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(path.read_text(encoding="utf-8"), code_spans=True).splitlines():
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def links(path: Path) -> list[str]:
    return re.findall(
        r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(path.read_text("utf-8"))
    )


def test_markdown_files_exist() -> None:
    assert all(path.is_file() for path in MARKDOWN)
    assert DOCS, "docs/ has Markdown files"


@pytest.mark.parametrize("path", MARKDOWN, ids=relative)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (linked.suffix != ".md" or anchor not in github_anchors(linked)):
            broken.append(f"{target}: no heading #{anchor} in {relative(linked)}")
    assert not broken, f"{relative(path)}: {broken}"


def test_links_checker_sees_links_and_anchors() -> None:
    assert "docs/observe.md" in links(README)
    assert "quickstart-observe-a-model" in github_anchors(README)
    assert "observe-overhead-on-a-cpu-training-step" in github_anchors(ROOT / "docs/performance.md")


# Phrases that point outside the repository (the project's workspace, its planning documents).
OUTSIDE = [r"\.\./shared", r"\bDESIGN\b", r"\bthe brief\b", r"\bissue \d+", r"\bthe issue's\b"]


@pytest.mark.parametrize("path", MARKDOWN, ids=relative)
def test_documentation_refers_only_to_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [pattern for pattern in OUTSIDE if re.search(pattern, text)]
    assert not found, f"{relative(path)} refers outside the repository: {found}"


# Built from pieces so that this file does not match itself.
GONE = ["~/.cache/" + "streamwatch", "STREAMWATCH_" + "CACHE_DIR"]
_NOT_SOURCE = {".git", ".venv", "build", "dist", "runs", "__pycache__"}


def repository_files() -> list[Path]:
    files = []
    for directory, subdirectories, names in os.walk(ROOT):
        subdirectories[:] = [
            d
            for d in subdirectories
            if d not in _NOT_SOURCE and not d.endswith(".egg-info") and not (d.startswith(".") and d != ".ci")
        ]
        files.extend(Path(directory) / name for name in names)
    return files


def test_no_file_mentions_the_kernel_cache() -> None:
    offenders = []
    for path in repository_files():
        if path.suffix in {".so", ".pyd", ".png", ".pyc"} or path.stat().st_size > 5_000_000:
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        offenders += [f"{relative(path)}: {gone}" for gone in GONE if gone in text]
    assert not offenders, "the fused kernel is built at install time; nothing is cached at run time"
