"""The ``streamwatch`` command: ``demo`` (a real training run, observed, served and recorded, with a live
console view), ``report`` (a summary of a recorded run), ``replay`` (a recorded run served on /metrics
again) and ``plot`` (a recorded run as a PNG).

``streamwatch demo`` trains a small MLP on **synthetic** data — four Gaussian clusters in 20 dimensions,
generated from a fixed seed, so nothing is downloaded — with :func:`streamwatch.observe` on, serves
``/metrics`` on 127.0.0.1, appends every sampled step to a run file in the run directory and prints a
line of progress per interval. Ctrl-C ends it cleanly: every completed step is flushed to the run file.

Example:
    >>> parser = build_parser()
    >>> parser.parse_args(["demo", "--steps", "5", "--no-live"]).steps
    5
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_parser", "main"]

CLASSES = 4
FEATURES = 20


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``demo`` and ``report``."""
    parser = argparse.ArgumentParser(
        prog="streamwatch", description="A live, low-overhead PyTorch training monitor."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model with streamwatch on (synthetic data)")
    demo.add_argument("--steps", type=int, default=500, help="training steps (default 500)")
    demo.add_argument("--port", type=int, default=9400, help="base /metrics port, + LOCAL_RANK (0: any free)")
    demo.add_argument("--hidden", type=int, default=128, help="hidden layer width (model size)")
    demo.add_argument("--layers", type=int, default=3, help="hidden layers")
    demo.add_argument("--batch", type=int, default=64, help="batch size")
    demo.add_argument("--every", type=int, default=1, help="sample one step in EVERY")
    demo.add_argument(
        "--run-dir", type=Path, default=None, help="where the run file goes (default runs/<time>)"
    )
    demo.add_argument("--no-live", action="store_true", help="print log lines instead of a live view")
    demo.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    demo.add_argument(
        "--linger", type=float, default=0.0, help="keep serving /metrics this many seconds at the end"
    )
    report = commands.add_parser("report", help="summarise a recorded run (a run directory or its run file)")
    report.add_argument("run", type=Path)
    report.add_argument("--top", type=int, default=5, help="how many worst layers to list")
    replay = commands.add_parser("replay", help="serve a recorded run's series on /metrics again")
    replay.add_argument("run", type=Path)
    replay.add_argument("--port", type=int, default=9400, help="/metrics port (0: any free)")
    replay.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    replay.add_argument(
        "--speed", type=float, default=10.0, help="steps per second (0: the last step at once)"
    )
    replay.add_argument("--loop", action="store_true", help="start over at the end")
    plot = commands.add_parser("plot", help="draw a recorded run as a PNG")
    plot.add_argument("run", type=Path)
    plot.add_argument("-o", "--output", type=Path, default=Path("run.png"), help="the PNG to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return {"demo": _demo, "report": _report, "replay": _replay, "plot": _plot}[args.command](args)
    except (FileNotFoundError, ValueError, OSError) as err:  # a clear line, never a traceback
        print(f"streamwatch {args.command}: error: {err}", file=sys.stderr)
        return 2


def _run_file(path: Path) -> Path:
    """``path`` itself if it is a file, else the run file inside the run directory ``path``."""
    if path.is_dir():
        candidate = path / "run.jsonl"
        if not candidate.exists():
            raise FileNotFoundError(
                f"{path} is a directory without a run file (run.jsonl): is it a run directory?"
            )
        return candidate
    if not path.exists():
        raise FileNotFoundError(f"no run directory or run file at {path}")
    return path


def _report(args: argparse.Namespace) -> int:
    from streamwatch.sinks._runfile import read_run, report

    path = _run_file(args.run)
    run = read_run(path)
    print(report(run, top=args.top))
    if run.truncated:
        print(
            f"note: {path} ends in a truncated record; read up to step {run.last_good_step}", file=sys.stderr
        )
    return 0


def _replay(args: argparse.Namespace) -> int:
    from streamwatch._replay import Replay
    from streamwatch.sinks._runfile import read_run

    run = read_run(_run_file(args.run))
    with Replay(run, port=args.port, host=args.host, speed=args.speed, loop=args.loop).start() as replay:
        print(f"replaying {len(run.records)} steps on {replay.url} at {args.speed:g} steps/s", flush=True)
        try:
            while not replay.wait_until_done(timeout=1.0) or args.loop:
                pass
            print("replay done: serving the last step until Ctrl-C", flush=True)
            while True:
                time.sleep(1.0)
        except KeyboardInterrupt:
            print("\nreplay stopped", flush=True)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from streamwatch._plot import plot
    from streamwatch.sinks._runfile import read_run

    out = plot(read_run(_run_file(args.run)), args.output)
    print(f"wrote {out}", flush=True)
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import streamwatch as sw
    from streamwatch.sinks._runfile import RunFile

    if args.steps < 1 or args.hidden < 1 or args.layers < 1 or args.batch < 1 or args.every < 1:
        raise ValueError("--steps, --hidden, --layers, --batch and --every must be positive")
    run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.3  # overlapping: accuracy tops out below 100 %
    torch.manual_seed(0)
    widths = [FEATURES, *[args.hidden] * args.layers]
    blocks: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        blocks += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(widths[-1], CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run_file = RunFile(run_dir / "run.jsonl")
    print("streamwatch demo: synthetic data (4 Gaussian clusters in 20-D, seed 0), no download", flush=True)
    step = 0
    with sw.observe(model, opt, every=args.every, sinks=[run_file]) as watch, contextlib.ExitStack() as stack:
        exporter = watch.expose(port=args.port, run="demo")
        print(f"serving {exporter.url}; run file {run_dir / 'run.jsonl'}", flush=True)
        view = None
        if not args.no_live:
            try:
                from streamwatch._live import LiveView
            except ImportError as err:  # rich is the demo extra
                raise ValueError(
                    f"the live view needs rich (pip install 'streamwatch[demo]'), or pass --no-live: {err}"
                ) from err
            view = stack.enter_context(LiveView(watch, total_steps=args.steps, url=exporter.url))
        try:
            for step in range(args.steps):
                y = torch.randint(0, CLASSES, (args.batch,), generator=g)
                x = centers[y] + torch.randn(args.batch, FEATURES, generator=g)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                watch.step(loss=loss, outputs=logits, targets=y, batch_size=args.batch)
                if view is not None:
                    view.update(step + 1)
                elif (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                    _log(watch, step)
            if args.linger > 0:
                watch.flush()
                print(f"training done; serving {exporter.url} for {args.linger:g} s more", flush=True)
                time.sleep(args.linger)
        except KeyboardInterrupt:
            print(f"\ninterrupted at step {step}: flushing every completed step", flush=True)
    stats = watch.statistics()
    print(
        f"done: {stats.steps} steps, {stats.records_received} records, "
        f"{stats.dropped_oldest + stats.dropped_newest} dropped; run file {run_dir / 'run.jsonl'}",
        flush=True,
    )
    return 0


def _log(watch: object, step: int) -> None:
    from streamwatch import Watch

    assert isinstance(watch, Watch)
    latest = {(s.name, s.labels.get("phase")): s.value for s in watch.snapshot()}
    stats = watch.statistics()
    loss = latest.get(("streamwatch_loss", "train"), float("nan"))
    accuracy = latest.get(("streamwatch_accuracy", "train"), float("nan"))
    dropped = stats.dropped_oldest + stats.dropped_newest
    print(
        f"step {step + 1:>6}  loss {loss:8.4f}  accuracy {accuracy:6.3f}  dropped {dropped}  "
        f"lag {stats.worker_lag_seconds * 1e3:6.1f} ms  overhead {stats.overhead_seconds * 1e3:6.2f} ms/step",
        flush=True,
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
