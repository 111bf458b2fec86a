"""Launching real ``torchrun`` jobs on gloo for the distributed tests.

* :func:`free_ports` finds ``n`` consecutive free ports of 127.0.0.1 (one ``/metrics`` port per rank:
  streamwatch serves on ``port + LOCAL_RANK``).
* :func:`command` is the ``torchrun`` command line (``python -m torch.distributed.run``) with a free
  rendezvous port on 127.0.0.1, and :func:`environment` its environment (one thread per rank, this
  checkout importable).
* :func:`launch` starts a job logging to ``out/torchrun.log``; :func:`finish` tells its ranks to end
  (they wait for ``out/done`` after their last step, so Prometheus can scrape them first) and asserts
  that it exited 0, showing the log's tail if not.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.promserver import free_port

ROOT = Path(__file__).parents[1]


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive ports of 127.0.0.1 free a moment ago."""
    for _ in range(50):
        base = free_port()
        sockets = [socket.socket() for _ in range(n)]
        try:
            for i, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


def environment() -> dict[str, str]:
    """The job's environment: one torch thread per rank (two cores run four ranks), this checkout on
    ``PYTHONPATH``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def command(script: Path, ranks: int, *args: str) -> list[str]:
    """``torchrun --nproc_per_node=ranks script args...`` with its rendezvous on a free local port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        "--master_addr=127.0.0.1",
        str(script),
        *args,
    ]


def run(script: Path, ranks: int, *args: str, timeout: float = 110) -> None:
    """Run ``script`` on ``ranks`` ranks to its end and assert that the job exited 0 (its output's tail in
    the message)."""
    done = subprocess.run(
        command(script, ranks, *args),
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def launch(script: Path, ranks: int, out: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start ``script`` on ``ranks`` ranks, its output in ``out/torchrun.log``."""
    with (out / "torchrun.log").open("wb") as log:
        return subprocess.Popen(
            command(script, ranks, *args), env=environment(), stdout=log, stderr=subprocess.STDOUT
        )


def finish(proc: subprocess.Popen[bytes], out: Path, timeout: float = 60) -> None:
    """Let the ranks end (``out/done``) and assert that the job exited 0 (killed after ``timeout`` s)."""
    (out / "done").touch()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    assert rc == 0, (out / "torchrun.log").read_text(errors="replace")[-3000:]


def write_json(path: Path, value: object) -> None:
    """Write ``value`` as JSON to ``path`` whole or not at all (a temporary file, then a rename): the test
    polls for the file and reads it as soon as it exists, which caught a half-written one under load."""
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


def linger(watch: object, out: Path, timeout: float = 90) -> None:
    """A rank's end (called by the job's script): wait until the test has scraped it (``out/done``, at
    most ``timeout`` s), then close the watch and leave the process group."""
    import time

    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while not (out / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.close()  # type: ignore[attr-defined]
    dist.destroy_process_group()
