"""A Lightning fit stopped by SIGTERM, for ``tests/test_exit.py``: ``python lightning_sigterm.py RUN_DIR``.

``StreamwatchCallback(run_dir=RUN_DIR)`` (the default governor) on a small classifier trained on random
batches until the process is sent SIGTERM; Lightning's own handler ends the fit at the next batch. The
module prints ``STEP LOSS`` (``float.hex``) at the end of each training batch (one optimizer step each,
``STEP`` the step the record carries), and the script prints ``stopped at GLOBAL_STEP`` when the fit
ends, before the exception goes on.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore", message=r".*does not have many workers")
warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)

import lightning.pytorch as pl  # noqa: E402

from streamwatch.integrations.lightning import StreamwatchCallback  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs: dict[str, torch.Tensor], batch: object, batch_idx: int) -> None:
        print(self.global_step - 1, outputs["loss"].item().hex(), flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(run_dir: str) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 8), torch.randint(0, 2, (4096,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1000,
        callbacks=[StreamwatchCallback(run_dir=run_dir, expose=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run_dir,
    )
    try:
        trainer.fit(Net(), DataLoader(data, batch_size=8))
    finally:
        print("stopped at", trainer.global_step, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
