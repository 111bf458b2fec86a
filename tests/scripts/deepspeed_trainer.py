"""A Hugging Face Trainer run with DeepSpeed ZeRO (CPU accelerator, one process), observed by
``StreamwatchCallback``, for ``tests/test_deepspeed.py``: ``python deepspeed_trainer.py STAGE OUT_JSON
watched|plain`` (``MASTER_PORT`` set by the test; ``plain``: without the callback, whose logged losses and
gradient norms the watched run's must equal: monitoring changes no weight).

Writes every step's logged loss and gradient norm, the final master weights and, per optimizer step, the
global gradient norm the Trainer logs (DeepSpeed's, of the averaged gradient before clipping: the default
clip at 1.0 never acts on this model) and the one streamwatch's ``param_grad`` rows give (the square root
of their sums of squares), and the record's kinds and names.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch
import transformers
from torch.utils.data import Dataset

import streamwatch as sw
from streamwatch.integrations.transformers import StreamwatchCallback
from tests.hfnet import HFNet


class Data(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(6, generator=g), "labels": torch.randint(0, 3, (), generator=g)}


def _model() -> HFNet:
    torch.manual_seed(0)
    return HFNet()


def _trained(trainer: transformers.Trainer) -> list[tuple[float, float]]:
    """Every step's logged loss and gradient norm: equal exactly when training was not changed."""
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]


def _weights(trainer: transformers.Trainer) -> dict[str, str]:
    """Each parameter's whole float32 master weight at the end, as the hex of its bytes (DeepSpeed's own
    accessor: under ZeRO-3 the model holds none of it between steps)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name: safe_get_full_fp32_param(p).detach().cpu().numpy().tobytes().hex()
        for name, p in trainer.model.named_parameters()
    }


def main() -> None:
    stage, out, watched = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "watched"
    warnings.filterwarnings("ignore", category=FutureWarning)
    # (one process as a rank of a job of one; set here, not at import: pytest imports this file to
    # collect its doctests, and these variables would then make every later Trainer a distributed one)
    one = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in one.items():
        os.environ.setdefault(name, value)
    deepspeed = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    args = transformers.TrainingArguments(
        output_dir=str(out.parent / "trainer"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        deepspeed=deepspeed,
        disable_tqdm=True,
    )
    records = sw.sinks.collect()
    callback = StreamwatchCallback(every=1, cadence={"param": 1, "update": 1}, sinks=[records])
    callbacks = [callback] if watched else []
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=Data(), callbacks=callbacks)
    trainer.train()
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    norms, kinds = [], []
    for record in records.items:
        rows = record.rows("param_grad")
        norms.append(math.sqrt(sum(float(record.column("sumsq")[i]) for i in rows)))
        kinds.append(sorted({f"{key.kind}/{key.layer}/{key.name}" for key in record.keys}))
    out.write_text(
        json.dumps(
            {
                "deepspeed": trainer.is_deepspeed_enabled,
                "trained": _trained(trainer),
                "weights": _weights(trainer),
                "logged": logged,
                "norms": norms,
                "kinds": kinds,
                "skipped": dict(callback.watch.statistics().skipped) if callback.watch else None,
            }
        )
    )


if __name__ == "__main__":
    main()
