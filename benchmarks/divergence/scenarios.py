"""The divergence suite's scenarios: small real models that go wrong (or stay healthy) reproducibly on CPU.

Each :class:`Scenario` builds a fresh :class:`Run` (model, optimizer, data, all from its own fixed seed)
whose ``step(t)`` does one whole training step — forward, loss, ``zero_grad``, ``backward``, optional
``clip_grad_norm_``, ``opt.step()`` — and returns the loss tensor. The harness (``harness.py``) calls
``watch.step(loss=...)`` after it. Nothing here knows about streamwatch: a run with and without a watch
trains the same weights (monitoring never changes training), so one run's losses are the ground truth for
every detector judged on it.

A scenario states its fault's *onset* (the first step the fault acts; ``None`` for the healthy controls):
a detector firing before it is a false alarm, not a warning. Where the run diverges is not stated by hand
but measured on its losses by the one criterion of ``harness.divergence_step``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SCENARIOS", "Run", "Scenario"]


@dataclass
class Run:
    """One scenario's training state: ``step(t)`` trains step ``t`` and returns its loss (a 0-d tensor)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class Scenario:
    """A reproducible run: ``build()`` makes it from a fixed seed; ``steps`` at most; ``onset`` the first
    step the fault acts (``None``: a healthy control); ``fault`` says what goes wrong, in words."""

    name: str
    steps: int
    onset: int | None
    fault: str
    build: Callable[[], Run]

    @property
    def control(self) -> bool:
        return self.onset is None


# -- the pieces ------------------------------------------------------------------------------------------


class Teacher:
    """A fixed random linear map labelling Gaussian inputs: a learnable classification task."""

    def __init__(self, seed: int, features: int = 32, classes: int = 10) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.features = features
        self.w = torch.randn(features, classes, generator=self.gen)
        self.classes = classes

    def batch(self, size: int, label_noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, self.features, generator=self.gen)
        y = (x @ self.w).argmax(-1)
        if label_noise:
            flip = torch.rand(size, generator=self.gen) < label_noise
            y = torch.where(flip, torch.randint(0, self.classes, (size,), generator=self.gen), y)
        return x, y


def mlp(features: int = 32, hidden: int = 128, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def sgd_step(
    model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, clip: float | None = None
) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


class TinyTransformer(nn.Module):
    """One pre-norm attention block and an MLP over a token sequence, next-token cross-entropy."""

    def __init__(self, vocab: int = 16, dim: int = 32, heads: int = 2, length: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.1)
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        self.heads = heads
        mask = torch.full((length, length), -math.inf).triu(1)
        self.register_buffer("mask", mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, n = tokens.shape
        h = self.embed(tokens) + self.pos[:n]
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        d = q.shape[-1] // self.heads
        q, k, v = (t.view(b, n, self.heads, d).transpose(1, 2) for t in (q, k, v))
        logits = q @ k.transpose(-1, -2) / math.sqrt(d) + self.mask[:n, :n]
        att = logits.softmax(-1) @ v
        h = h + self.proj(att.transpose(1, 2).reshape(b, n, -1))
        h = h + self.ff(self.norm2(h))
        return self.head(h)


def copy_task(gen: torch.Generator, batch: int, length: int = 16, vocab: int = 16) -> torch.Tensor:
    """Sequences whose second half repeats the first: the second half is predictable by attention."""
    half = torch.randint(0, vocab, (batch, length // 2), generator=gen)
    return torch.cat([half, half], dim=1)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# -- the scenarios ---------------------------------------------------------------------------------------


def _lr_ramp() -> Run:
    """SGD whose warm-up ramps the learning rate to a peak far too high (no plateau at a sane value)."""
    torch.manual_seed(1)
    task, model = Teacher(1), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(t: int) -> torch.Tensor:
        for group in opt.param_groups:  # 0.05 until the onset, then up 2 % a step
            group["lr"] = 0.05 * 1.02 ** max(0, t - LR_RAMP_ONSET)
        x, y = task.batch(32)
        return sgd_step(model, opt, F.cross_entropy(model(x), y))

    return Run(model, opt, step)


LR_RAMP_ONSET = 150


def _corrupt_batches() -> Run:
    """A run of 40 batches whose normalisation was dropped (inputs ×25) and labels shuffled."""
    torch.manual_seed(2)
    task, model = Teacher(2), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(t: int) -> torch.Tensor:
        x, y = task.batch(32)
        if CORRUPT_ONSET <= t < CORRUPT_ONSET + 40:
            x, y = 25.0 * x, y.roll(1)
        return sgd_step(model, opt, F.cross_entropy(model(x), y))

    return Run(model, opt, step)


CORRUPT_ONSET = 200


def _attention_logits() -> Run:
    """A tiny transformer (Adam 1e-2, clipped at 1.0) whose query/key/value projection gets a learning rate
    growing 5 % a step from the onset (a per-group schedule gone wrong): the attention logits grow until
    the softmax saturates."""
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)
    model = TinyTransformer()
    qkv = [model.qkv.weight, model.qkv.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in qkv)]
    opt = torch.optim.Adam([{"params": rest}, {"params": qkv}], lr=1e-2)

    def step(t: int) -> torch.Tensor:
        opt.param_groups[1]["lr"] = 1e-2 * 1.05 ** max(0, t - ATTENTION_ONSET)
        return sgd_step(model, opt, lm_loss(model, copy_task(gen, 32)), clip=1.0)

    return Run(model, opt, step)


ATTENTION_ONSET = 200


def _fp16_overflow() -> Run:
    """A regression MLP in float16 (no loss scaler, no master weights): the learning rate creeps up,
    the outputs grow and the squared error overflows float16."""
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).half()
    w = torch.randn(16, 1, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(t: int) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = 0.01 * 1.03 ** max(0, t - FP16_ONSET)
        x = torch.randn(64, 16, generator=gen)
        y = 10.0 * (x @ w)
        loss = F.mse_loss(model(x.half()), y.half())
        return sgd_step(model, opt, loss)

    return Run(model, opt, step)


FP16_ONSET = 100


def _dying_relu() -> Run:
    """A deep ReLU MLP hit by a few steps of a learning rate 40× too high (a schedule bug): the units
    die and the loss climbs back to chance and stays."""
    torch.manual_seed(5)
    task = Teacher(5)
    model = nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(t: int) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = 2.0 if DYING_ONSET <= t < DYING_ONSET + 5 else 0.05
        x, y = task.batch(32)
        return sgd_step(model, opt, F.cross_entropy(model(x), y))

    return Run(model, opt, step)


DYING_ONSET = 200


def _rnn_exploding() -> Run:
    """An Elman RNN (ReLU, identity-initialised recurrence) summing a 40-step sequence, clipped at 1.0 as
    usual: from the onset the learning rate is 30× higher, the recurrence's gain passes 1 and its hidden
    states and gradients explode through the 40 steps."""
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
    with torch.no_grad():
        rnn.weight_hh_l0.copy_(torch.eye(32))
    head = nn.Linear(32, 1)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(t: int) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = 1e-2 if t < RNN_ONSET else 0.3
        x = torch.randn(32, 40, 4, generator=gen)
        y = x[..., 0].sum(1, keepdim=True) / math.sqrt(40)
        out, _ = rnn(x)
        return sgd_step(model, opt, F.mse_loss(head(out[:, -1]), y), clip=1.0)

    return Run(model, opt, step)


RNN_ONSET = 150


def _control_noisy_mlp() -> Run:
    """Healthy: the MLP on batches of 8 with 20 % label noise and a cosine learning-rate decay."""
    torch.manual_seed(7)
    task, model = Teacher(7), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = 500

    def step(t: int) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = 0.05 * 0.5 * (1 + math.cos(math.pi * t / steps))
        x, y = task.batch(8, label_noise=0.2)
        return sgd_step(model, opt, F.cross_entropy(model(x), y))

    return Run(model, opt, step)


def _control_transformer() -> Run:
    """Healthy: the tiny transformer with Adam at 3e-3, clipped at 1.0, small batches of 8."""
    torch.manual_seed(8)
    gen = torch.Generator().manual_seed(8)
    model = TinyTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step(t: int) -> torch.Tensor:
        return sgd_step(model, opt, lm_loss(model, copy_task(gen, 8)), clip=1.0)

    return Run(model, opt, step)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("lr_ramp", 500, LR_RAMP_ONSET, "SGD lr ramps up 2 %/step from step 150", _lr_ramp),
    Scenario("corrupt_batches", 400, CORRUPT_ONSET, "40 batches: inputs ×25, labels off", _corrupt_batches),
    Scenario(
        "attention_logits",
        500,
        ATTENTION_ONSET,
        "qkv lr +5 %/step from 200",
        _attention_logits,
    ),
    Scenario("fp16_overflow", 400, FP16_ONSET, "float16 MLP, no scaler, lr creeping up", _fp16_overflow),
    Scenario("dying_relu", 400, DYING_ONSET, "5 steps at lr 40× kill the ReLUs", _dying_relu),
    Scenario("rnn_exploding", 500, RNN_ONSET, "ReLU RNN, lr 30× from step 150, clipped", _rnn_exploding),
    Scenario("control_noisy_mlp", 500, None, "batch 8, 20 % label noise, cosine lr", _control_noisy_mlp),
    Scenario("control_transformer", 500, None, "transformer, Adam 3e-3, batch 8", _control_transformer),
)
