"""Models and a training loop for "one plan at scale" (DESIGN.md): blocks compiled one by one
whose later block overflows fp16, and a model whose values outgrow fp16 mid-training.

Shared by tests/test_one_plan.py, tests/training/test_one_plan_ranks.py and
``python -m benchmarks.one_plan``.

>>> model = blocks_model()
>>> [type(b).__name__ for b in model.blocks]
['Block', 'Block', 'Block', 'Block']
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Block", "Blocks", "TrainRun", "blocks_model", "compile_blocks", "growing_batches",
           "growing_mlp", "train"]


class Block(nn.Module):
    """A pre-norm MLP block: ``x + fc2(relu(fc1(norm(x))))``."""

    def __init__(self, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Blocks(nn.Module):
    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def blocks_model(n: int = 4, hot: int | None = 2, scale: float = 1e5, dim: int = 64,
                 hidden: int = 256, seed: int = 0) -> Blocks:
    """``n`` blocks of one class; block ``hot``'s up projection scaled by ``scale`` so that its
    values pass fp16's 65504 (real models keep their largest activations in a few layers)."""
    torch.manual_seed(seed)
    model = Blocks(n, dim, hidden)
    if hot is not None:
        with torch.no_grad():
            model.blocks[hot].fc1.weight.mul_(scale)
    return model


def compile_blocks(model: nn.Module, backend: str | Callable = "amprewrite", **kwargs: object
                   ) -> nn.Module:
    """The per-block recipe (docs/guide.md, "Distributed training"): each block of
    ``model.blocks`` compiled on its own, as torchtitan compiles a transformer's layers."""
    for k, block in enumerate(model.blocks):
        model.blocks[k] = torch.compile(block, backend=backend, **kwargs)
    return model


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def growing_mlp(dim: int = 32, hidden: int = 128, seed: int = 0) -> nn.Module:
    """A small MLP without a norm in front: its values grow with its inputs."""
    torch.manual_seed(seed)
    return _MLP(dim, hidden)


def growing_batches(steps: int, shift_at: int = 10, factor: float = 3e4, batch: int = 16,
                    dim: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) batches whose inputs grow ``factor`` times from step ``shift_at`` on;
    the targets are a fixed fp32 teacher's outputs on the inputs (so the task stays the same)."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        teacher = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
    out = []
    for step in range(steps):
        x = torch.randn(batch, dim, generator=g)
        with torch.no_grad():
            y = teacher(x)
        scale = factor if step >= shift_at else 1.0
        out.append((x * scale, y * scale))
    return out


@dataclass
class TrainRun:
    """One training run: the loss of every step (``nan`` where it was not finite), how many
    steps the scaler skipped, and the wall time."""

    losses: list[float]
    skipped: int = 0
    seconds: float = 0.0

    @property
    def nonfinite(self) -> int:
        return sum(not math.isfinite(v) for v in self.losses)

    def mean_loss(self, start: int = 0) -> float:
        finite = [v for v in self.losses[start:] if math.isfinite(v)]
        return sum(finite) / len(finite) if finite else math.nan


def _relative_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error relative to the target's mean square: the same task at any scale."""
    out = out.float()
    return ((out - target) ** 2).mean() / (target ** 2).mean()


def train(model: nn.Module, batches: list, recipe: str, lr: float = 1e-3) -> TrainRun:
    """Train ``model`` (already compiled or not) with Adam on ``batches``.

    ``recipe``: ``"fp32"``; ``"autocast"`` (fp16 autocast with ``torch.amp.GradScaler``);
    ``"scaler"`` (``torch.amp.GradScaler`` alone, for a model compiled with amprewrite);
    ``"amprewrite"`` (:class:`amprewrite.GradScaler`)."""
    from ..compile.scaler import GradScaler

    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = {"fp32": None, "autocast": torch.amp.GradScaler("cpu"),
              "scaler": torch.amp.GradScaler("cpu"), "amprewrite": GradScaler("cpu")}[recipe]
    run = TrainRun([])
    start = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        if recipe == "autocast":
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
        else:
            out = model(x)
        loss = _relative_mse(out, y)
        run.losses.append(float(loss.detach()))
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        run.skipped += scaler.get_scale() < before
    run.seconds = time.perf_counter() - start
    return run
