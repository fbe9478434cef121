"""EffectivePyTorch's mixed-precision example: learn a checkerboard from grid coordinates.

``train`` returns the loss of every step, so a test can compare whole loss curves; the model
computes its own loss (``WithLoss``), so the MSE is part of the graph amprewrite transforms and
its precision can be checked like any other op's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = ("fp32", "autocast_bf16", "transform_bf16", "backend_bf16", "compile_amprewrite",
            "transform_fp16_scaler", "autocast_fp16_scaler")


def checkerboard(size: int = 64, squares: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid coordinates (1, 2, size, size) in [-1, 1]; the 0/1 checkerboard (1, 1, size, size)."""
    lin = torch.linspace(-1, 1, size)
    y, x = torch.meshgrid(lin, lin, indexing="ij")
    coords = torch.stack([x, y])[None]
    cells = ((x + 1) / 2 * squares).floor() + ((y + 1) / 2 * squares).floor()
    return coords, (cells % 2)[None, None]


def net(width: int = 256) -> nn.Module:
    layers: list[nn.Module] = []
    channels = 2
    for _ in range(3):
        layers += [nn.Conv2d(channels, width, 1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    layers.append(nn.Conv2d(width, 1, 1))
    return nn.Sequential(*layers)


class WithLoss(nn.Module):
    """The network and its MSE loss in one forward."""

    def __init__(self, width: int):
        super().__init__()
        self.net = net(width)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x).float(), target)


@contextlib.contextmanager
def _threads(n: int | None):
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(variant: str, steps: int = 300, seed: int = 0, width: int = 256, size: int = 64,
          lr: float = 1e-3, graphs: list | None = None, threads: int | None = None
          ) -> list[float]:
    """Train one variant with Adam; return the loss of every step.

    ``graphs``, if given, receives (graph, example inputs) of what amprewrite built, for a
    test to check the precision each op ran in. ``threads`` sets torch's intra-op threads
    for the run (a small configuration runs fastest on one: its kernels are too small to
    split, and on a busy machine a second thread only spins)."""
    if variant not in VARIANTS:
        raise ValueError(variant)
    with _threads(threads):
        return _train(variant, steps, seed, width, size, lr, graphs)


def _train(variant, steps, seed, width, size, lr, graphs) -> list[float]:
    import amprewrite

    torch.manual_seed(seed)
    model = WithLoss(width)
    x, target = checkerboard(size)
    run: nn.Module = model
    autocast = contextlib.nullcontext
    scaler = None
    low = torch.float16 if "fp16" in variant else torch.bfloat16
    if variant.startswith("autocast"):
        def autocast():
            return torch.autocast("cpu", dtype=low)
    elif variant.startswith("transform"):
        run = amprewrite.transform(model, dtype=low)
        if graphs is not None:
            graphs.append((run, (x, target)))
    elif variant == "backend_bf16":  # the backend, its graph kept, compiled by aot_eager
        from torch._dynamo.backends.registry import lookup_backend

        def inner(gm, example_inputs):
            if graphs is not None:
                graphs.append((gm, tuple(example_inputs)))
            return lookup_backend("aot_eager")(gm, example_inputs)

        torch._dynamo.reset()
        run = torch.compile(model, backend=amprewrite.backend(dtype=low, inner=inner))
    elif variant == "compile_amprewrite":  # the registered backend with its defaults (inductor)
        torch._dynamo.reset()
        run = torch.compile(model, backend="amprewrite")
    if variant.endswith("scaler"):
        scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = run(x, target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
    return losses
