"""EffectivePyTorch's mixed-precision example: learn a checkerboard from grid coordinates."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


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


def train(variant: str, steps: int = 300, seed: int = 0, width: int = 256) -> float:
    """Train one variant; return the final MSE loss (evaluated in fp32 arithmetic on outputs)."""
    import amprewrite

    torch.manual_seed(seed)
    model = net(width)
    x, target = checkerboard()
    run: nn.Module = model
    autocast = contextlib.nullcontext
    scaler = None
    if variant == "autocast_bf16":
        def autocast():
            return torch.autocast("cpu", dtype=torch.bfloat16)
    elif variant == "transform_bf16":
        run = amprewrite.transform(model, dtype=torch.bfloat16)
    elif variant == "transform_fp16_scaler":
        run = amprewrite.transform(model, dtype=torch.float16)
        scaler = torch.amp.GradScaler("cpu")
    elif variant == "compile_amprewrite":
        run = torch.compile(model, backend="amprewrite")
    elif variant != "fp32":
        raise ValueError(variant)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with autocast():
            out = run(x)
        loss = loss_fn(out.float(), target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    return float(loss.detach())
