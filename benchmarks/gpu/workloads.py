"""The GPU script's models and their training step: bench_cuda.py's three and a GPT-2-small-sized one.

A :class:`Workload` is everything one step needs: the model's builder, a batch, the loss, what
``watch.step()`` is given, the optimizer and the autocast dtype. ``workloads(dry=True)`` gives the same
models shrunk to a CPU's size (a few thousand parameters, batches of 2-4), so ``--dry-run`` runs every
code path in seconds.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import bench_cuda
import bench_observe
import torch
import torch.nn.functional as F
from torch import nn

SEED = 0
KERNEL_ENV = "STREAMWATCH_KERNEL"


class Block(nn.Module):
    """A GPT-2 decoder block: pre-norm causal self-attention (``scaled_dot_product_attention``) and MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(self.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2 small's shape (12 layers, d 768, 12 heads, context 1024, vocabulary 50257), plain torch; the
    head is not tied to the token embedding (163 M parameters instead of 124 M), no dropout."""

    def __init__(
        self, layers: int = 12, d: int = 768, heads: int = 12, context: int = 1024, vocab: int = 50257
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(positions))))


@dataclass(frozen=True)
class Workload:
    """One model's training step. ``classes`` is the label range; a token model's labels are (B, T)."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    classes: int
    optimizer: Callable[[Any], torch.optim.Optimizer]
    autocast: torch.dtype | None = None
    tokens: bool = False  # inputs are token ids, the loss is per position

    def batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(SEED)
        if self.tokens:
            x = torch.randint(0, self.classes, self.input_shape, generator=gen)
            y = torch.randint(0, self.classes, self.input_shape, generator=gen)
        else:
            x = torch.randn(self.input_shape, generator=gen)
            y = torch.randint(0, self.classes, (self.input_shape[0],), generator=gen)
        return x.to(device), y.to(device)

    def model(self, device: torch.device) -> nn.Module:
        torch.manual_seed(SEED)
        with device:  # parameters made on the device: a GPT-sized init on the host takes seconds
            return self.build().train()

    def copies(self, device: torch.device, n: int) -> list[nn.Module]:
        """``n`` models with the same initial weights."""
        first = self.model(device)
        return [first] + [copy.deepcopy(first) for _ in range(n - 1)]


def step(
    w: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    watch: Any = None,
    after_optimizer: Callable[[], None] | None = None,
) -> None:
    """Forward, loss, ``zero_grad``, backward, optimizer step, then ``after_optimizer()`` and
    ``watch.step(loss=..., outputs=..., targets=..., batch_size=...)``."""
    with torch.autocast(x.device.type, dtype=w.autocast or torch.bfloat16, enabled=w.autocast is not None):
        logits = model(x)
        if w.tokens:
            logits = logits.view(-1, logits.shape[-1])
        targets = y.view(-1)
        loss = F.cross_entropy(logits, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if after_optimizer is not None:
        after_optimizer()
    if watch is not None:
        watch.step(loss=loss, outputs=logits, targets=targets, batch_size=x.shape[0])


@contextlib.contextmanager
def kernel_route(route: str | None) -> Iterator[None]:
    """``STREAMWATCH_KERNEL`` set to ``route`` (``"torch"``) or unset (``None``: the default route) inside."""
    before = os.environ.get(KERNEL_ENV)
    if route is None:
        os.environ.pop(KERNEL_ENV, None)
    else:
        os.environ[KERNEL_ENV] = route
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = before


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def _from_bench_cuda(name: str) -> Workload:
    spec = bench_cuda.SPECS[name]
    return Workload(name, spec.build, spec.input_shape, 10, spec.optimizer, spec.autocast)


def workloads(dry: bool) -> dict[str, Workload]:
    """bench_cuda.py's MLP, CNN and transformer and the GPT-2-small-sized model; shrunk with ``dry``."""
    if not dry:
        found = {name: _from_bench_cuda(name) for name in ("mlp", "cnn", "transformer")}
        found["gpt2"] = Workload("gpt2", GPT, (8, 1024), 50257, _adamw, torch.bfloat16, tokens=True)
        return found
    sgd = bench_cuda.SPECS["mlp"].optimizer
    momentum = bench_cuda.SPECS["cnn"].optimizer
    return {
        "mlp": Workload("mlp", bench_observe.make_demo, (4, 20), 10, sgd),
        "cnn": Workload("cnn", lambda: bench_observe.make_cnn((8, 16)), (4, 3, 32, 32), 10, momentum),
        "transformer": Workload(
            "transformer",
            lambda: bench_observe.SmallTransformer(d_model=32, heads=2, feedforward=64, layers=2),
            (2, 16, 32),
            10,
            _adamw,
            torch.bfloat16,
        ),
        "gpt2": Workload(
            "gpt2",
            lambda: GPT(layers=2, d=32, heads=2, context=16, vocab=97),
            (2, 16),
            97,
            _adamw,
            torch.bfloat16,
            tokens=True,
        ),
    }


def compiled_workload(dry: bool) -> Workload:
    """The compile section's transformer: bench_cuda.py's widths, 2 layers (8 take minutes to compile)."""
    if dry:
        return Workload(
            "transformer",
            lambda: bench_observe.SmallTransformer(d_model=32, heads=2, feedforward=64, layers=1),
            (2, 8, 32),
            10,
            _adamw,
            torch.bfloat16,
        )
    return Workload(
        "transformer (2 layers)",
        lambda: bench_observe.SmallTransformer(d_model=1024, heads=16, feedforward=4096, layers=2),
        (32, 256, 1024),
        10,
        _adamw,
        torch.bfloat16,
    )
