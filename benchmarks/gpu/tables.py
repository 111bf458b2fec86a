"""``results.md``: the GPU script's results as Markdown tables (only from the results dictionary)."""

from __future__ import annotations

from typing import Any

from overhead import VARIANTS


def _num(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += [
        "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows
    ]
    return [*lines, ""]


def _result(data: dict[str, Any], name: str) -> tuple[str, dict[str, Any]]:
    entry = data["sections"].get(name)
    if entry is None:
        return "not run", {}
    return str(entry.get("status")), entry.get("result") or {}


def environment(data: dict[str, Any]) -> list[str]:
    _, env = _result(data, "environment")
    gpu = env.get("gpu") or {}
    gpu = gpu if isinstance(gpu, dict) else {"name": gpu}
    rows = [
        [
            "GPU",
            f"{gpu.get('name', '—')} ({gpu.get('memory_gib', '—')} GiB, sm {gpu.get('capability', '—')})",
        ],
        ["driver, max SM clock, power limit", env.get("driver", "—")],
        ["torch / CUDA / triton", f"{env.get('torch')} / {env.get('cuda_runtime')} / {env.get('triton')}"],
        ["python", env.get("python", "—")],
        ["streamwatch (commit)", f"{env.get('streamwatch')} ({str(env.get('git_commit', '—'))[:12]})"],
        ["`_kernel.status()`", env.get("kernel_status", "—")],
    ]
    rows += [[f"`_triton` {k}", v] for k, v in (env.get("triton_status") or {}).items()]
    return ["## Environment", "", *_table(["", ""], rows)]


def sections(data: dict[str, Any]) -> list[str]:
    rows = []
    for name, entry in data["sections"].items():
        error = (entry.get("error") or "").strip().splitlines()
        rows.append(
            [
                name,
                entry.get("status"),
                entry.get("seconds", "—"),
                entry.get("budget_s"),
                error[-1] if error else "",
            ]
        )
    return ["## Sections", "", *_table(["section", "status", "seconds", "budget s", "error"], rows)]


def cuda_tests(data: dict[str, Any]) -> list[str]:
    status, r = _result(data, "cuda_tests")
    lines = [
        "## CUDA tests",
        "",
        f"`{r.get('command', '')}`: {status}, exit {r.get('returncode')}, {r.get('seconds')} s",
        "",
    ]
    junit = r.get("junit") if isinstance(r.get("junit"), dict) else {}
    counts = junit.get("counts") or {}
    if counts:
        lines += _table(list(counts), [list(counts.values())])
    bad = [c for c in junit.get("cases", []) if c.get("outcome") != "passed"]
    if bad:
        lines += _table(
            ["test", "outcome", "message"],
            [[c["test"], c["outcome"], c.get("message", "")[:200]] for c in bad],
        )
    if r.get("summary"):
        lines += [f"pytest: `{r['summary']}`", ""]
    return lines


def _triple(counts: Any) -> str:
    if not isinstance(counts, dict):
        return str(counts)
    return " · ".join(_num(counts.get(k), 1) for k in ("launches", "kernels", "ops"))


def launch_counts(data: dict[str, Any]) -> list[str]:
    _, r = _result(data, "launches")
    rows = []
    for model, entry in r.items():
        if not isinstance(entry, dict):
            rows.append([model, "", entry, "", "", "", "", "", ""])
            continue
        base = entry.get("baseline")
        for route in ("default", "torch"):
            c = entry.get(route)
            if not isinstance(c, dict) or "error" in c:
                shown = c if not isinstance(c, dict) else "error: " + c["error"].strip().splitlines()[-1]
                rows.append([model, route, _triple(base), shown, "", "", "", "", ""])
                continue
            taps, weights = c.get("taps", {}), c.get("taps_weights", {})
            rows.append(
                [
                    model,
                    route,
                    _triple(base),
                    _triple(c["sampled"]["added"]),
                    _triple(c["sampled_weights"]["added"]),
                    _triple(c["unsampled"]["added"]),
                    f"{taps.get('activation', 0)} + {taps.get('output_grad', 0)}",
                    f"{taps.get('param_grad', 0)} ({weights.get('param', 0)}, {weights.get('update', 0)})",
                    _num(c.get("launches_beyond_tensor_taps"), 0) if c["sampled"].get("launches") else "—",
                ]
            )
    header = [
        "model",
        "route",
        "unmonitored step",
        "+ sampled step",
        "+ sampled, weights and updates",
        "+ unsampled step",
        "activations + output grads",
        "param grads (weights, updates)",
        "sampled launches − tensor taps",
    ]
    return [
        "## Launch counts",
        "",
        "Per step: runtime launches · device kernels · top-level aten ops; `+`: added over the unmonitored "
        "step. Taps: rows of that step's record by kind. Budget: launches per sampled step ≤ (activations + "
        "output gradients) + a few per group of parameters per kind + a few.",
        "",
        *_table(header, rows),
    ]


def overhead(data: dict[str, Any]) -> list[str]:
    _, r = _result(data, "overhead")
    shown = VARIANTS[1:]
    rows = []
    for model, entry in r.items():
        if not isinstance(entry, dict) or "ratios" not in entry:
            why = entry if not isinstance(entry, dict) else (entry.get("error") or entry.get("note") or "")
            rows.append([model, str(why).strip().splitlines()[-1] if why else "", *[""] * (len(shown) + 3)])
            continue
        ratios, gov = entry["ratios"], entry.get("governor") or {}
        backlog = entry.get("backlog_ms") or {}
        rows.append(
            [
                model,
                f"{_num(entry.get('baseline_ms'), 2)} ({entry.get('k')} × {entry.get('cycles')})",
                *[_num(ratios.get(name)) for name in shown],
                _num(entry.get("every1_over_floor")),
                f"{_num(gov.get('sampling_interval'))} / {_num(gov.get('overhead_ratio'))}",
                _num(backlog.get("every1"), 1),
            ]
        )
    header = [
        "model",
        "step ms (K × cycles)",
        *shown,
        "every1 / floor",
        "governor: interval / own estimate",
        "every1 backlog ms",
    ]
    return [
        "## Overhead ratios",
        "",
        "Median over cycles of a variant's round over the unmonitored round in the same cycle.",
        "",
        *_table(header, rows),
    ]


def _kernels(found: Any) -> str:
    """``kernels_in_a_step`` as ``name ×n, ... / total``."""
    if not isinstance(found, dict):
        return "—"
    ours = ", ".join(f"{name} ×{n}" for name, n in (found.get("streamwatch") or {}).items()) or "none"
    return f"{ours} / {found.get('kernels')}"


def compile_table(data: dict[str, Any]) -> list[str]:
    status, r = _result(data, "compiled")
    if "graph_breaks" not in r:
        return ["## Compiled transformer", "", f"{status}", ""]

    def breaks(key: str) -> str:
        found = r.get(key) or {}
        return _num(found.get("graph_breaks")) if "error" not in found else "error"

    watch = r.get("watch") or {}
    row = [
        r.get("model"),
        r.get("backend"),
        breaks("explain_plain"),
        breaks("explain_observed"),
        (r.get("explain_observed") or {}).get("partials_ops"),
        _kernels(r.get("kernels_in_a_step")),
        r.get("graph_breaks"),
        _num(r.get("first_step_s"), 1),
        ", ".join(_num(t, 1) for t in r.get("step_ms", [])),
        watch.get("hook_errors"),
        watch.get("skipped"),
    ]
    header = [
        "model",
        "backend",
        "breaks, forward unobserved",
        "breaks, forward observed",
        "streamwatch::partials in the forward",
        "streamwatch kernels / all kernels in a step",
        "graph breaks, training steps",
        "first step s",
        "later steps ms",
        "hook errors",
        "skipped",
    ]
    reasons = [f"- graph break: {x}" for x in r.get("graph_break_reasons") or []]
    recompiles = r.get("recompile_reasons") or {}
    reasons += [f"- recompiled `{code}`: {'; '.join(map(str, why))}" for code, why in recompiles.items()]
    return ["## Compiled transformer (`every=1`)", "", *_table(header, [row]), *reasons, ""]


def render(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [
        "# streamwatch GPU check",
        "",
        f"{meta.get('mode')} on {meta.get('device')}, started {meta.get('started')}, {meta.get('wall_s')} s "
        f"of a {meta.get('budget_s')} s budget.",
        "",
    ]
    for part in (environment, sections, cuda_tests, launch_counts, overhead, compile_table):
        lines += part(data)
    found = meta.get("problems") or []
    lines += ["## Problems", "", *([f"- {p}" for p in found] or ["none"]), ""]
    return "\n".join(lines)
