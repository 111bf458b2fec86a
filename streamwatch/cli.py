"""The ``streamwatch`` command: ``demo`` (a real training run, observed, served and recorded, with a live
console view), ``report`` (a summary of a recorded run), ``replay`` (a recorded run served on /metrics
again), ``plot`` (a recorded run as a PNG) and ``stack`` (a real Prometheus scraping this machine's ranks,
with the alert rules: :mod:`streamwatch._stack`).

Every bad input — an option value out of range, a missing or corrupt run file, a port in use, an output
path that cannot be written — is one line on stderr, ``streamwatch <command>: error: ...``, and exit
status 2; never a traceback. A demo that fails before training starts removes the run directory (and the
run file) it created.

``streamwatch demo`` trains a small MLP on **synthetic** data — four Gaussian clusters in 20 dimensions,
generated from a fixed seed, so nothing is downloaded — with :func:`streamwatch.observe` on, serves
``/metrics`` on 127.0.0.1, appends every sampled step to a run file in the run directory and prints a
line of progress per interval. After training it keeps serving ``/metrics`` so that Prometheus can scrape
the final values: until Ctrl-C with the live view on a terminal, else :data:`NO_LIVE_LINGER` seconds
(``--linger`` sets it). Ctrl-C ends it cleanly: every completed step is flushed to the run file.

Example:
    >>> parser = build_parser()
    >>> parser.parse_args(["demo", "--steps", "5", "--no-live"]).steps
    5
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import math
import os
import re
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from streamwatch._console import log_line
from streamwatch._version import DISTRIBUTION, extra, version
from streamwatch.sinks import DEFAULT_PORT
from streamwatch.sinks._runreader import RUN_FILE, find_run_file

if TYPE_CHECKING:
    from torch import nn, optim

    from streamwatch._observe import Watch

__all__ = ["build_parser", "main"]

CLASSES = 4
FEATURES = 20
NO_LIVE_LINGER = 15.0
"""Seconds ``demo --no-live`` keeps serving /metrics after training by default: a Prometheus that
scrapes every 5 s gets the final values at least twice. With the live view it serves until Ctrl-C."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``streamwatch demo: error: ... (see 'streamwatch demo --help')``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see '{self.prog} --help')\n")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _budget(text: str) -> float:
    """An argparse type: a fraction in (0, 1), as ``observe(overhead=...)`` takes it."""
    from streamwatch._governor import check_budget

    try:
        return check_budget(float(text), "--overhead")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in (0, 1) (0.02 is 2 %), got {text!r}"
        ) from None


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    """An argparse type: a finite float >= 0 (no NaN, no infinity)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``demo``, ``report``, ``replay``, ``plot`` and ``stack``.

    Every numeric option is checked here (a positive int, a port in [0, 65535], a finite number >= 0):
    a bad value is argparse's error, on one line, with exit status 2.
    """
    parser = _Parser(prog="streamwatch", description="A live, low-overhead PyTorch training monitor.")
    parser.add_argument("--version", action="version", version=f"streamwatch {version()} ({DISTRIBUTION})")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = commands.add_parser("demo", help="train a small model with streamwatch on (synthetic data)")
    demo.add_argument("--steps", type=_positive_int, default=500, help="training steps (default 500)")
    demo.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"base /metrics port, + LOCAL_RANK (default {DEFAULT_PORT}; 0: any free)",
    )
    demo.add_argument("--hidden", type=_positive_int, default=128, help="hidden layer width (model size)")
    demo.add_argument("--layers", type=_positive_int, default=3, help="hidden layers")
    demo.add_argument("--batch", type=_positive_int, default=64, help="batch size")
    sampling = demo.add_mutually_exclusive_group()
    sampling.add_argument(
        "--every", type=_positive_int, default=None, help="sample one step in EVERY (turns the governor off)"
    )
    sampling.add_argument(
        "--overhead",
        type=_budget,
        default=None,
        help="the overhead governor's budget, a fraction of the run's time (default 0.02)",
    )
    demo.add_argument(
        "--run-dir", type=Path, default=None, help="where the run file goes (default runs/<time>)"
    )
    demo.add_argument("--no-live", action="store_true", help="print log lines instead of a live view")
    demo.add_argument("--log-every", type=_positive_int, default=50, help="steps between log lines")
    demo.add_argument(
        "--linger",
        type=_non_negative,
        default=None,
        help="keep serving /metrics this many seconds after training (default: until Ctrl-C with the "
        f"live view on a terminal, else {NO_LIVE_LINGER:g} s, three scrapes at a 5 s interval; 0: at once)",
    )
    report = commands.add_parser("report", help="summarise a recorded run (a run directory or its run file)")
    report.add_argument("run", type=Path)
    report.add_argument("--top", type=_positive_int, default=5, help="how many worst layers to list")
    replay = commands.add_parser("replay", help="serve a recorded run's series on /metrics again")
    replay.add_argument("run", type=Path)
    replay.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"/metrics port (default {DEFAULT_PORT}; 0: any free)",
    )
    replay.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    replay.add_argument(
        "--speed",
        type=_non_negative,
        default=10.0,
        help="recorded steps (records) per second; a run sampled 1 in N advances N training steps "
        "a record (0: the last record at once; with --loop it is served until Ctrl-C)",
    )
    replay.add_argument("--loop", action="store_true", help="start over at the end")
    replay.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the rank to serve, of a run file with several (default: the first)",
    )
    plot = commands.add_parser("plot", help="draw a recorded run as a PNG")
    plot.add_argument("run", type=Path)
    plot.add_argument("-o", "--output", type=Path, default=Path("run.png"), help="the PNG to write")
    plot.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the rank to draw, of a run file with several (default: the first)",
    )
    stack = commands.add_parser(
        "stack", help="start a real Prometheus scraping this machine's ranks, with the alert rules"
    )
    stack.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"the ranks' base /metrics port (default {DEFAULT_PORT})",
    )
    stack.add_argument("--ranks", type=_positive_int, default=1, help="local ranks to scrape (default 1)")
    stack.add_argument(
        "--web-port",
        type=_port,
        default=9090,
        help="Prometheus' port on 127.0.0.1 (default 9090; 0: any free)",
    )
    stack.add_argument(
        "--scrape-interval", type=_duration, default="5s", help="scrape and rule interval (default 5s)"
    )
    stack.add_argument("--rules", type=Path, default=None, help="the rules file (default: the checkout's)")
    stack.add_argument(
        "--data-dir", type=Path, default=None, help="keep Prometheus' data here (default: a temporary dir)"
    )
    stack.add_argument("--prometheus", default=None, help="the prometheus binary (default: the one on PATH)")
    return parser


def _duration(text: str) -> str:
    """An argparse type: a Prometheus duration of whole units (``500ms``, ``5s``, ``1m``), at least 1 s."""
    match = re.fullmatch(r"(\d+)(ms|s|m)", text)
    seconds = 0.0 if match is None else int(match[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match[2]]
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"expected a duration of at least 1s such as 5s or 1m, got {text!r}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2: bad input, reported on one line of stderr)."""
    args = build_parser().parse_args(argv)
    try:
        commands = {"demo": _demo, "report": _report, "replay": _replay, "plot": _plot, "stack": _stack}
        return commands[args.command](args)
    except BrokenPipeError as err:
        from streamwatch._exceptions import ChannelClosed

        if isinstance(err, ChannelClosed):  # streamwatch's own channel: an error like any other
            message = _describe(err)
        else:  # `streamwatch report run | head`: the reader has what it wanted; stop quietly, as cat does
            _drop_stdout()
            return 128 + 13  # the status of a process ended by SIGPIPE
    except (ValueError, OSError, OverflowError, ImportError) as err:  # a clear line, never a traceback
        # ValueError includes RunFileError (not a run file, a corrupt line); OSError: a missing or
        # unreadable file, a port in use, an output that cannot be written
        message = _describe(err)
    except RuntimeError as err:  # (RecursionError, below, is one too)
        from streamwatch._exceptions import PipelineError

        if isinstance(err, RecursionError):
            message = "the input is nested too deeply to read (is it a streamwatch run file?)"
        elif isinstance(err, PipelineError):  # a sink failed (a full disk under the run file): said
            message = f"training ran, but {err}"  # once on one line, as any other error
        else:
            raise
    except RecursionError:  # read_run reports deep nesting as RunFileError; this is a second guard
        message = "the input is nested too deeply to read (is it a streamwatch run file?)"
    except KeyboardInterrupt:  # Ctrl-C before the command's own handling (importing torch, say)
        print(f"streamwatch {args.command}: interrupted", file=sys.stderr)
        return 130
    print(f"streamwatch {args.command}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def _drop_stdout() -> None:
    """Point standard output at the null device: its reader has gone away, and the interpreter's final
    flush must not fail again on the way out."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _describe(err: BaseException) -> str:
    """An error as a sentence: an OSError without its ``[Errno N]`` prefix, naming its file."""
    if isinstance(err, OSError) and err.strerror:
        where = ": ".join(str(name) for name in (err.filename, err.filename2) if name is not None)
        return f"{where}: {err.strerror}" if where else err.strerror
    return str(err) or type(err).__name__


def _stack(args: argparse.Namespace) -> int:
    """Start Prometheus (streamwatch._stack), print its URL, and stop it on Ctrl-C or SIGTERM."""
    from streamwatch._stack import Stack

    stack = Stack(
        base_port=args.port,
        ranks=args.ranks,
        web_port=args.web_port,
        scrape_interval=args.scrape_interval,
        rules=args.rules,
        data_dir=args.data_dir,
        binary=args.prometheus,
    )

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            stack.start()
        except RuntimeError as err:
            print(f"streamwatch stack: error: {_one_line(str(err))}", file=sys.stderr)
            return 2
        rules = "no rules (pass --rules)" if stack.rules is None else f"rules {stack.rules}"
        print(f"Prometheus: {stack.url}", flush=True)
        kept = "kept" if args.data_dir is not None else "removed at exit"
        print(
            f"scraping {', '.join(stack.targets)} every {args.scrape_interval} as job streamwatch; {rules}; "
            f"data in {stack.workdir} ({kept}); Ctrl-C stops it",
            flush=True,
        )
        while stack.running():
            time.sleep(0.2)
        print(f"streamwatch stack: error: prometheus exited: {_one_line(stack.log_tail())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        status = stack.stop()
        signal.signal(signal.SIGTERM, previous)
    print(f"streamwatch stack: Prometheus stopped (exit status {status})", flush=True)
    return 0


def _report(args: argparse.Namespace) -> int:
    from streamwatch._report import report
    from streamwatch.sinks import read_run

    path = find_run_file(args.run)
    run = read_run(path)
    print(report(run, top=args.top))
    if run.truncated:
        last = run.last_good_step
        where = "no complete step" if last is None else f"read up to step {last}"
        print(f"note: {path} ends in a truncated record; {where}", file=sys.stderr)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from streamwatch._replay import Replay
    from streamwatch.sinks import read_run

    path = find_run_file(args.run)
    run = read_run(path)
    replay = Replay(run, port=args.port, host=args.host, speed=args.speed, loop=args.loop, rank=args.rank)
    if len(replay.ranks) > 1:
        others = ", ".join(str(r) for r in replay.ranks if str(r) != replay.labels["rank"])
        print(
            f"note: {path} holds ranks {', '.join(map(str, replay.ranks))}; serving rank "
            f"{replay.labels['rank']} (--rank picks another: {others})",
            file=sys.stderr,
        )
    try:
        replay.start()
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise OSError(
                errno.EADDRINUSE,
                f"port {replay.port} on {args.host} is already in use; pass --port another port "
                "(--port 0 picks a free one), or stop the process that holds it",
            ) from err
        raise OSError(
            err.errno, f"cannot serve /metrics on {args.host} port {replay.port}: {_describe(err)}"
        ) from err
    with replay:
        print(f"replaying {len(run.records)} records on {replay.url} at {args.speed:g} records/s", flush=True)
        if not run.records:
            print(
                f"note: {path} has no steps recorded: serving only streamwatch_info and the replay's own "
                "counters until Ctrl-C",
                file=sys.stderr,
                flush=True,
            )
        elif args.loop and args.speed == 0:
            print("note: --loop with --speed 0: nothing to step through; serving the last step until Ctrl-C")
        try:
            if not args.loop and run.records:
                while not replay.wait_until_done(timeout=1.0):
                    pass
                print("replay done: serving the last step until Ctrl-C", flush=True)
            while True:  # until Ctrl-C; the stepping (with --loop) is the replay's thread
                time.sleep(1.0)
        except KeyboardInterrupt:
            print("\nreplay stopped", flush=True)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from streamwatch._plot import plot
    from streamwatch.sinks import read_run

    run = read_run(find_run_file(args.run))
    ranks = sorted({r.rank for r in run.records})
    out = plot(run, args.output, rank=args.rank)
    if len(ranks) > 1:
        drawn = args.rank if args.rank is not None else run.records[0].rank
        others = ", ".join(str(r) for r in ranks if r != drawn)
        print(
            f"note: {run.path} holds ranks {', '.join(map(str, ranks))}; drew rank {drawn} (--rank picks "
            f"another: {others})",
            flush=True,
        )
    print(f"wrote {out}", flush=True)
    return 0


def _sleep(seconds: float) -> None:
    """``time.sleep`` for any finite duration (one call overflows past ~2**63 ns)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 3600.0))


def _make_dirs(path: Path) -> list[Path]:
    """``path.mkdir(parents=True, exist_ok=True)``; returns the directories it created, outermost first."""
    missing: list[Path] = []
    for directory in (path, *path.parents):
        if directory.exists() or directory.is_symlink():
            break
        missing.append(directory)
    path.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _new_run_dir(parent: Path, stamp: str) -> tuple[Path, list[Path]]:
    """A directory of its own under ``parent``: ``stamp``, else ``stamp-2``, ``stamp-3``, ... (two demos
    started in the same second must not append to one run file); and the directories created."""
    created = _make_dirs(parent)
    for n in itertools.count(1):
        run_dir = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return run_dir, [*created, run_dir]
    raise AssertionError("unreachable")  # pragma: no cover


def _remove_created(run_file: Path | None, created: list[Path]) -> None:
    """Undo a demo that never started: its run file (if it made it) and the directories it made."""
    if run_file is not None:
        with contextlib.suppress(OSError):
            run_file.unlink()
    for directory in reversed(created):
        with contextlib.suppress(OSError):  # not empty: something else was put there; keep it
            directory.rmdir()


def _build_model(args: argparse.Namespace) -> tuple[nn.Module, optim.Optimizer]:
    """The demo's MLP and optimizer, after one trial forward and backward pass on a zero batch, so a model
    or batch too large for this machine is a clear error before anything is created."""
    import torch

    try:
        torch.manual_seed(0)
        widths = [FEATURES, *[args.hidden] * args.layers]
        blocks: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            blocks += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        model = torch.nn.Sequential(*blocks, torch.nn.Linear(widths[-1], CLASSES))
        model(torch.zeros(args.batch, FEATURES)).sum().backward()
        model.zero_grad(set_to_none=True)
    except (RuntimeError, MemoryError) as err:  # torch's allocator failure is a RuntimeError
        raise ValueError(
            f"cannot build the demo model (--hidden {args.hidden}, --layers {args.layers}, "
            f"--batch {args.batch}) on this machine; pass smaller values: {err}"
        ) from None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


_RAISED_AT_CLOSE = r"(?s)streamwatch: .*raised again at close\(\)$"
"""The warning a failure in a hook or on the worker gets at the next ``watch.step()`` (``close()`` raises
it again)."""


def _demo(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        # a failure on the worker (a full disk under the run file) is said once, on one line, when the
        # watch closes (main()); its warning at the next step would say it twice, with a source line
        warnings.filterwarnings("ignore", _RAISED_AT_CLOSE, RuntimeWarning)
        return _train_demo(args)


def _train_demo(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    import streamwatch as sw
    from streamwatch.sinks import RunFile

    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.3  # overlapping: accuracy tops out below 100 %
    model, opt = _build_model(args)
    if args.run_dir is not None:
        run_dir = args.run_dir
        created = _make_dirs(run_dir)
    else:
        run_dir, created = _new_run_dir(Path("runs"), time.strftime("%Y%m%d-%H%M%S"))
    run_path = run_dir / RUN_FILE
    new_file = not run_path.exists()
    started = False  # until training starts, a failure removes what the demo created
    try:
        run_file = RunFile(run_path)
        print(
            "streamwatch demo: synthetic data (4 Gaussian clusters in 20-D, seed 0), no download", flush=True
        )
        step = 0
        with (
            sw.observe(
                model,
                opt,
                every=args.every,
                overhead=args.overhead,
                sinks=[run_file],
                start_step=run_file.next_step,  # a second demo in one --run-dir goes on after the first
            ) as watch,
            contextlib.ExitStack() as stack,
        ):
            try:
                exporter = watch.expose(port=args.port, run="demo")
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    port = args.port + int(os.environ.get("LOCAL_RANK", "0") or 0)
                    raise OSError(
                        errno.EADDRINUSE,
                        f"port {port} on 127.0.0.1 is already in use (the /metrics port is --port + "
                        "LOCAL_RANK); pass --port another port (--port 0 picks a free one), or stop the "
                        "process that holds it",
                    ) from err
                raise
            print(f"serving {exporter.url}; run file {run_path}", flush=True)
            view = None
            if not args.no_live:
                try:
                    from streamwatch._live import LiveView
                except ImportError as err:  # rich is the demo extra
                    raise ValueError(
                        f"the live view needs rich ({extra('demo')}), or pass --no-live: {err}"
                    ) from err
                view = stack.enter_context(
                    LiveView(watch, total_steps=args.steps, url=exporter.url, title="streamwatch demo")
                )
            started = True
            trained = False
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
                        line = log_line(watch.store, watch.statistics(), step + 1, loss=loss.item())
                        print(line, flush=True)
                trained = True
                _linger(args, view is not None, watch, exporter.url)
            except KeyboardInterrupt:
                if trained:
                    print(f"\nstopped serving {exporter.url}", flush=True)
                else:
                    print(f"\ninterrupted at step {step}: flushing every completed step", flush=True)
    except BaseException:
        if not started:
            _remove_created(run_path if new_file else None, created)
        raise
    stats = watch.statistics()
    print(
        f"done: {stats.steps} steps, {stats.records_received} records, "
        f"{stats.dropped_oldest + stats.dropped_newest} dropped; run file {run_path}",
        flush=True,
    )
    return 0


def _linger(args: argparse.Namespace, live: bool, watch: Watch, url: str) -> None:
    """After training: keep serving /metrics (``--linger`` seconds; by default until Ctrl-C with the live
    view on a terminal, else :data:`NO_LIVE_LINGER` seconds), saying how to scrape it."""
    if args.linger is not None:
        linger = args.linger
    else:  # the live view on a terminal: until Ctrl-C; else (log lines, a pipe) long enough for scrapes
        linger = math.inf if live and sys.stdout.isatty() else NO_LIVE_LINGER
    if linger <= 0:
        return
    watch.flush()
    until = "until Ctrl-C" if math.isinf(linger) else f"for {linger:g} s more (Ctrl-C ends it)"
    print(
        f"training done; serving {url} {until}: curl {url}, or scrape it with Prometheus "
        "(docs/prometheus.md, dashboards/scrape/prometheus.yml)",
        flush=True,
    )
    _sleep(linger)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
