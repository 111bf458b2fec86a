"""A real 2-rank run of a trainer with ``StreamwatchCallback(expose=PORT, run_dir=DIR)``, scraped while it
trains: started by ``tests/test_integrations_serving.py`` as
``torchrun --nproc_per_node=2 trainer_serve.py {lightning|transformers} PORT DIR``.

At its third optimizer step every rank waits for the others (a barrier), then scrapes the ``/metrics``
of every rank (``PORT + LOCAL_RANK``), waits again and trains on; it writes what it saw, with its rank
and the ranks of its records, to ``DIR/rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
import urllib.request
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("error")
warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*does not have many workers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import streamwatch as sw  # noqa: E402

SCRAPE_AT = 3  # the optimizer step after which every rank scrapes every rank


def scrape_all(port: int) -> dict[str, str]:
    """Every rank's /metrics, between two barriers: all ranks are training (none has finished)."""
    dist.barrier()
    bodies = {}
    for local_rank in range(dist.get_world_size()):
        url = f"http://127.0.0.1:{port + local_rank}/metrics"
        bodies[str(local_rank)] = urllib.request.urlopen(url, timeout=30).read().decode()
    dist.barrier()
    return bodies


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def lightning(port: int, out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from streamwatch.integrations.lightning import StreamwatchCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            self.log("train_acc", (logits.argmax(1) == y).float().mean())
            return F.cross_entropy(logits, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen: dict[str, Any] = {}

    class Scrape(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == SCRAPE_AT and "bodies" not in seen:
                seen["bodies"] = scrape_all(port)

    records = sw.sinks.collect()
    callback = StreamwatchCallback(expose=port, run_dir=out / "run", sinks=[records], every=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=6,
        log_every_n_steps=1,
        callbacks=[callback, Scrape()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(data(), batch_size=4))
    assert callback.exporter is not None
    return {
        "rank": trainer.global_rank,
        "url": callback.exporter.url,
        "record_ranks": sorted({r.rank for r in records.items}),
        "closed": callback.watch is not None and callback.watch.closed,
        **seen,
    }


def transformers(port: int, out: Path) -> dict[str, Any]:
    import transformers as hf

    from streamwatch.integrations.transformers import StreamwatchCallback

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.cross_entropy(self.net(x), labels)}

    seen: dict[str, Any] = {}

    class Scrape(hf.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == SCRAPE_AT and "bodies" not in seen:
                seen["bodies"] = scrape_all(port)

    records = sw.sinks.collect()
    callback = StreamwatchCallback(expose=port, run_dir=out / "run", sinks=[records], every=1)
    args = hf.TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=4,
        max_steps=6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    train = [{"x": x, "labels": y} for x, y in data()]
    trainer = hf.Trainer(model=Net(), args=args, train_dataset=train, callbacks=[callback, Scrape()])
    trainer.train()
    assert callback.exporter is not None
    return {
        "rank": args.process_index,
        "url": callback.exporter.url,
        "record_ranks": sorted({r.rank for r in records.items}),
        "closed": callback.watch is not None and callback.watch.closed,
        **seen,
    }


def main() -> None:
    trainer, port, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    seen = {"lightning": lightning, "transformers": transformers}[trainer](port, out)
    (out / f"rank{seen['rank']}.json").write_text(json.dumps(seen))
    if dist.is_initialized():  # (left to the interpreter's exit, gloo's teardown sometimes aborts a rank)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
