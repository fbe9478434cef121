"""The built-in demo model: a tiny diffusion-style denoiser with every hazard amprewrite handles.

>>> model, inputs = demo_model()
>>> [t.shape for t in model(*inputs)][0]
torch.Size([2, 3, 16, 16])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DemoNet", "demo_model"]


class DemoNet(nn.Module):
    """Conv + BatchNorm, a sinusoidal timestep embedding, self-attention with a softmax, nearest
    upsampling, a per-sample loop (each sample's most-attended tokens) and a BCE loss head."""

    def __init__(self, channels: int = 32):
        super().__init__()
        self.channels = channels
        self.conv_in = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.time_mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(),
                                      nn.Linear(channels, channels))
        self.down = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)
        self.head = nn.Linear(channels, 1)
        self.bce = nn.BCELoss()

    def timestep_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = self.channels // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None, :]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, target: torch.Tensor):
        h = F.relu(self.bn(self.conv_in(x)))
        h = h + self.time_mlp(self.timestep_embedding(t))[:, :, None, None]
        h = self.down(h)
        tokens = h.flatten(2).transpose(1, 2)  # (batch, positions, channels)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(self.channels), dim=-1)
        tokens = tokens + self.proj(attn @ v)
        h = tokens.transpose(1, 2).reshape(h.shape)
        out = self.conv_out(self.up(h))
        top = attn.mean(1).topk(4, dim=-1).indices  # per sample: the 4 most-attended tokens
        picked = torch.stack([tokens[i][top[i]] for i in range(tokens.size(0))])  # a loop
        prob = torch.sigmoid(self.head(picked.mean(1)))
        return out, self.bce(prob, target)


def demo_model(batch: int = 2, size: int = 16, seed: int = 0):
    """The demo model (eval mode) and example inputs ``(x, timesteps, target)``."""
    torch.manual_seed(seed)
    model = DemoNet().eval()
    x = torch.randn(batch, 3, size, size)
    t = torch.randint(0, 1000, (batch,))
    target = torch.rand(batch, 1).round()
    return model, (x, t, target)
