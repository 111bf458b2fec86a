"""A Hugging Face Trainer whose training step raises part way, for ``tests/test_exit.py``:
``python transformers_crash.py RUN_DIR``.

``StreamwatchCallback(run_dir=RUN_DIR)`` (the default governor) on a small classifier; the model's
forward raises at its 121st training call, so ``trainer.train()`` raises after 120 optimizer steps and
the script ends with that exception (the Trainer has no event for it: nothing calls ``close()``). A
callback prints each completed optimizer step (``step N``: other libraries may print to stdout too, as
DeepSpeed's logger does when transformers imports it), as the step its record carries.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

warnings.filterwarnings("ignore", category=FutureWarning)

import transformers  # noqa: E402

from streamwatch.integrations.transformers import StreamwatchCallback  # noqa: E402

FAIL_AT = 121


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls == FAIL_AT:
            raise RuntimeError("the training step failed")
        return {"loss": F.cross_entropy(self.net(x), labels)}


class Data(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(4096, 6, generator=gen)
        self.y = torch.randint(0, 3, (4096,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Printer(transformers.TrainerCallback):
    """Prints each completed optimizer step as the streamwatch callback numbers it."""

    def on_step_end(self, args: object, state: transformers.TrainerState, control: object, **_: Any) -> None:
        print("step", state.global_step - 1, flush=True)


def main(run_dir: str) -> None:
    torch.manual_seed(0)
    trainer = transformers.Trainer(
        model=Net(),
        args=transformers.TrainingArguments(
            output_dir=run_dir,
            per_device_train_batch_size=4,
            max_steps=1000,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
        ),
        train_dataset=Data(),
        callbacks=[StreamwatchCallback(run_dir=run_dir, expose=False), Printer()],
    )
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])
